"""The benchmark's text profiles: real English from gensim's test data, read without importing gensim.

* ``queries``: the distinct word pairs of WordSim-353 and SimLex-999 as two-word queries
  ("tiger cat"), 1,349 texts of about 4 tokens with all-MiniLM-L6-v2's tokenizer;
* ``paragraphs``: sentences of the Lee corpora (``lee_background.cor``, ``lee.cor``) and the
  ``para2para`` Wikipedia texts, split at sentence ends, 2,000 drawn with a fixed seed: about
  30 tokens each, like the issue's 63,327 tokens in 2,000 paragraphs;
* ``docs``: the 300 news documents of ``lee_background.cor``, cut at the model maximum (256
  tokens for all-MiniLM-L6-v2) as sentence-transformers does;
* ``smollm2``: the first 500 paragraphs, embedded by SmolLM2-135M with LAST pooling;
* ``images``: scikit-image's 26 photographs and scans (``skimage/data/*.png``, ``*.jpg``: 102 x
  102 to 1411 x 1411 pixels; RGB, grayscale and RGBA; about 200 KB each), cycled to 104 files,
  embedded from their files by a CLIP of ViT-B/32's shape (``clip_folder.py``): 50 positions each;
* ``lora``: the first 512 paragraphs, all-MiniLM-L6-v2 with 8 PEFT LoRA adapters of rank 16 on
  every linear layer (``lora.py``): the base model alone, the base on a runtime serving the
  adapters, the texts spread over the 8 adapters (mixed steps) and one adapter merged.
"""

from __future__ import annotations

import importlib.util
import random
import re
from dataclasses import dataclass
from pathlib import Path

SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


@dataclass(frozen=True)
class Profile:
    name: str
    model: str  # "minilm", "smollm2", "clip" or "minilm-lora"
    default_texts: int
    description: str


PROFILES = {
    p.name: p
    for p in (
        Profile("queries", "minilm", 1349, "WordSim-353 + SimLex-999 word pairs"),
        Profile("paragraphs", "minilm", 2000, "sentences of the Lee corpora and para2para"),
        Profile("docs", "minilm", 300, "lee_background.cor news documents, cut at the model maximum"),
        Profile("smollm2", "smollm2", 500, "paragraphs, SmolLM2-135M LAST pooling"),
        Profile("images", "clip", 104, "scikit-image's photographs and scans, PNG and JPEG files"),
        Profile("lora", "minilm-lora", 512, "paragraphs; 8 rank-16 LoRA adapters mixed, the base, merged weights"),
    )
}


def _data_dir() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("gensim is not installed: pip install -e '.[test]'")
    return Path(spec.submodule_search_locations[0]) / "test" / "test_data"


def _lines(name: str, encoding: str = "utf-8") -> list[str]:
    text = (_data_dir() / name).read_text(encoding=encoding)
    return [line.strip() for line in text.splitlines() if line.strip()]


def _word_pairs() -> list[str]:
    rows = [line.split("\t") for name in ("wordsim353.tsv", "simlex999.txt") for line in _lines(name)]
    return list(dict.fromkeys(f"{row[0]} {row[1]}" for row in rows if not row[0].startswith("#")))


def _sentences() -> list[str]:
    docs = _lines("lee_background.cor", "cp1252") + _lines("lee.cor", "cp1252")
    docs += _lines("para2para_text1.txt") + _lines("para2para_text2.txt")
    sentences = [s for doc in docs for s in SENTENCE_END.split(doc)]
    random.Random(0).shuffle(sentences)  # mixes the sources and the request order
    return sentences


def image_files() -> list[str]:
    """scikit-image's bundled photographs and scans, sorted: the PNG and JPEG files of
    ``skimage/data`` (no download; the GIF and TIFF files are left out)."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-image is not installed: pip install -e '.[test]'")
    data = Path(spec.submodule_search_locations[0]) / "data"
    return sorted(str(path) for path in data.iterdir() if path.suffix in (".png", ".jpg"))


def load_texts(profile: Profile, limit: int | None) -> list[str]:
    """The profile's texts (for ``images``: image file paths, cycled), the first ``limit`` of
    them (the profile's default when ``None``)."""
    if profile.name == "images":
        files = image_files()
        return [files[i % len(files)] for i in range(limit or profile.default_texts)]
    if profile.name == "queries":
        texts = _word_pairs()
    elif profile.name == "docs":
        texts = _lines("lee_background.cor", "cp1252")
    else:
        texts = _sentences()[:2000]
    return texts[: limit or profile.default_texts]
