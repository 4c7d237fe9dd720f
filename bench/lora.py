"""The ``lora`` profile's adapters (``run.py --profiles lora``): PEFT adapters of all-MiniLM-L6-v2
on every linear layer (query, key, value, the dense layers; A and B drawn at a trained adapter's
scale, as PEFT starts B at zero), and one of them merged into the weights (``merge_and_unload``).
Needs ``peft`` (the test extra).
"""

from __future__ import annotations

from pathlib import Path

import torch

TARGETS = ["query", "key", "value", "dense"]


def make_adapters(base: str, root: Path, count: int, rank: int) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    adapters = {}
    for i in range(count):
        model = get_peft_model(AutoModel.from_pretrained(base), LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                           target_modules=TARGETS))
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        model.save_pretrained(root / f"a{i}")
        adapters[f"a{i}"] = root / f"a{i}"
    return adapters


def merged_folder(base: str, adapter: Path, folder: Path) -> Path:
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    PeftModel.from_pretrained(AutoModel.from_pretrained(base), adapter).merge_and_unload().save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder
