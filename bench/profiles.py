"""The benchmark's text profiles: real English from gensim's test data, read without importing gensim.

* ``queries``: the distinct word pairs of WordSim-353 and SimLex-999 as two-word queries
  ("tiger cat"), 1,349 texts of about 4 tokens with all-MiniLM-L6-v2's tokenizer;
* ``paragraphs``: sentences of the Lee corpora (``lee_background.cor``, ``lee.cor``) and the
  ``para2para`` Wikipedia texts, split at sentence ends, 2,000 drawn with a fixed seed: about
  30 tokens each, like the issue's 63,327 tokens in 2,000 paragraphs;
* ``docs``: the 300 news documents of ``lee_background.cor``, cut at the model maximum (256
  tokens for all-MiniLM-L6-v2) as sentence-transformers does;
* ``smollm2``: the first 500 paragraphs, embedded by SmolLM2-135M with LAST pooling.
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
    model: str  # "minilm" or "smollm2"
    default_texts: int
    description: str


PROFILES = {
    p.name: p
    for p in (
        Profile("queries", "minilm", 1349, "WordSim-353 + SimLex-999 word pairs"),
        Profile("paragraphs", "minilm", 2000, "sentences of the Lee corpora and para2para"),
        Profile("docs", "minilm", 300, "lee_background.cor news documents, cut at the model maximum"),
        Profile("smollm2", "smollm2", 500, "paragraphs, SmolLM2-135M LAST pooling"),
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


def load_texts(profile: Profile, limit: int | None) -> list[str]:
    """The profile's texts, the first ``limit`` of them (all when ``None``)."""
    if profile.name == "queries":
        texts = _word_pairs()
    elif profile.name == "docs":
        texts = _lines("lee_background.cor", "cp1252")
    else:
        texts = _sentences()[:2000]
    return texts[: limit or profile.default_texts]
