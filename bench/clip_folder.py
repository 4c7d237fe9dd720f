"""The ``images`` profile's model: a CLIP folder of ViT-B/32's real shape with seeded weights.

No real CLIP weights install offline here, so the benchmark builds ``openai/clip-vit-base-patch32``'s
architecture (its ``config.json``: text tower 512 wide, 12 layers, 8 heads; vision tower 768
wide, 12 layers, 12 heads, patches of 32 on 224 x 224 pixels, so 50 positions per image;
projections to 512) with ``CLIPModel``'s own initialization under ``torch.manual_seed(0)``, and
its preprocessing (``preprocessor_config.json``: ``CLIPImageProcessor``, shortest edge to 224
with bicubic resampling, centre crop 224, CLIP's mean and std). The time a system spends per
image is the same as with the real weights: same shapes, same FLOPs, same pixels.

The tokenizer is a WordLevel one over ``w0 .. w49404`` (CLIP's BPE vocabulary does not install
offline), with CLIP's special ids: ``<|startoftext|>`` 49406, ``<|endoftext|>`` 49407 (also
the pad token). Texts for this folder are words like ``"w17 w230 w9"``.

Cache: ``$POOLRUNNER_CACHE/bench-clip-vit-b32-seed0``, else
``~/.cache/poolrunner/bench-clip-vit-b32-seed0`` (about 600 MB in fp32), built once (about
20 s) into a temporary folder and renamed into place, so a reader never sees half a folder.
``sentence_transformers_folder`` is a sibling folder whose files link to it, plus a
``modules.json`` naming sentence-transformers' ``CLIPModel`` module, as the ``clip-ViT-B-32``
folders on the hub are laid out.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

SEED = 0
RECIPE_VERSION = 1  # bump when what build() writes changes: cached folders are rebuilt
VOCAB_WORDS = 49405
BOS_ID, EOS_ID = 49406, 49407
# openai/clip-vit-base-patch32's config.json, the fields that set shapes and numerics.
TEXT_CONFIG = {"vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
               "num_attention_heads": 8, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
               "layer_norm_eps": 1e-5, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": 1}
VISION_CONFIG = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "image_size": 224, "patch_size": 32, "num_channels": 3, "hidden_act": "quick_gelu",
                 "layer_norm_eps": 1e-5}
PROJECTION_DIM = 512
# openai/clip-vit-base-patch32's preprocessor_config.json.
PREPROCESSOR = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}, "resample": 3,
                "do_resize": True, "do_center_crop": True, "do_rescale": True, "rescale_factor": 1 / 255,
                "do_normalize": True, "do_convert_rgb": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711]}


def cache_root() -> Path:
    return Path(os.environ.get("POOLRUNNER_CACHE") or Path.home() / ".cache" / "poolrunner")


def clip_folder() -> Path:
    """The cached CLIP ViT-B/32-shaped folder, built on first use."""
    folder = cache_root() / f"bench-clip-vit-b32-seed{SEED}"
    marker = folder / ".complete"
    if marker.exists() and json.loads(marker.read_text()) == _recipe():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        build(tmp)
        (tmp / ".complete").write_text(json.dumps(_recipe()))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def sentence_transformers_folder() -> Path:
    """:func:`clip_folder` as a sentence-transformers folder (``modules.json``: one ``CLIPModel``
    module at the folder's root), its files linked, not copied."""
    source = clip_folder()
    folder = source.with_name(source.name + "-st")
    if (folder / "modules.json").exists() and (folder / ".complete").read_text() == (source / ".complete").read_text():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for path in source.iterdir():
        if path.name != ".complete":
            (folder / path.name).symlink_to(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.CLIPModel"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    shutil.copy(source / ".complete", folder / ".complete")
    return folder


def _recipe() -> dict:
    import transformers

    return {"recipe": RECIPE_VERSION, "seed": SEED, "transformers": transformers.__version__}


def build(folder: Path) -> None:
    """Write the tokenizer, the image processor, the config and the seeded weights into ``folder``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPImageProcessor, CLIPProcessor, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB_WORDS)}
    vocab.update({"<unk>": VOCAB_WORDS, "<|startoftext|>": BOS_ID, "<|endoftext|>": EOS_ID})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", BOS_ID),
                                                                   ("<|endoftext|>", EOS_ID)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|startoftext|>", eos_token="<|endoftext|>", unk_token="<unk>",
        pad_token="<|endoftext|>", model_max_length=77, model_input_names=["input_ids", "attention_mask"])
    CLIPProcessor(image_processor=CLIPImageProcessor(**PREPROCESSOR), tokenizer=tokenizer).save_pretrained(folder)
    config = transformers.CLIPConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG,
                                     projection_dim=PROJECTION_DIM, architectures=["CLIPModel"])
    torch.manual_seed(SEED)
    transformers.CLIPModel(config).eval().save_pretrained(folder)


if __name__ == "__main__":
    print(clip_folder())
    print(sentence_transformers_folder())
