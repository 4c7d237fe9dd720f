"""The embedders the benchmark compares: one builder per system, each returning ``embed``.

``embed(texts: list[str]) -> np.ndarray`` float32 ``[len(texts), hidden_size]``. Builders import
their library lazily: this module is also imported by the peers' own virtual environments,
which hold only numpy, torch and that peer. ``spec`` is the worker's job description (see
``worker.py``): ``model`` (a local folder), ``pooling`` ("MEAN" or "LAST"), ``max_length`` (the
model maximum in tokens) and ``dtype`` ("float32", "bfloat16" or, for poolrunner, "auto" or "int8").
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Embed = Callable[[list[str]], np.ndarray]
BATCH_SIZE = 32  # sentence-transformers' default, used by every batching peer


def poolrunner_system(spec: dict, compile: str = "auto") -> Embed:
    """poolrunner as a user runs it: the lead adjusts the invocation here only."""
    from poolrunner import Runtime, RuntimeConfig

    config = RuntimeConfig(model=spec["model"], dtype=spec["dtype"], compile=compile, load_entrypoints=False)
    runtime = Runtime.from_config(config)
    return lambda texts: runtime.embed(texts, truncate_prompt_tokens=-1)


def poolrunner_eager_system(spec: dict) -> Embed:
    """poolrunner with ``compile="off"``: transformers' modules as they are, the path before the
    oneDNN fast path."""
    return poolrunner_system(spec, compile="off")


def sentence_transformers_system(spec: dict) -> Embed:
    """sentence-transformers fp32 with its own length sorting (by characters), batch 32."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(spec["model"], device="cpu")
    return lambda texts: model.encode(texts, batch_size=BATCH_SIZE, convert_to_numpy=True)


def openvino_system(spec: dict) -> Embed:
    """sentence-transformers' OpenVINO backend; ``dtype`` becomes OpenVINO's precision hint."""
    from sentence_transformers import SentenceTransformer

    hint = {"float32": "f32", "bfloat16": "bf16"}[spec["dtype"]]
    model = SentenceTransformer(spec["model"], device="cpu", backend="openvino",
                                model_kwargs={"ov_config": {"INFERENCE_PRECISION_HINT": hint}})
    return lambda texts: model.encode(texts, batch_size=BATCH_SIZE, convert_to_numpy=True)


def transformers_system(spec: dict) -> Embed:
    """Plain transformers: batches of 32 sorted by token length, padded, SDPA attention,
    MEAN or LAST pooling in fp32 over the mask, L2-normalized."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    tokenizer.padding_side = "right"  # LAST pooling reads the last real token from the mask
    model = AutoModel.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).eval()
    options = {"truncation": True, "max_length": spec["max_length"]}

    def pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if spec["pooling"] == "LAST":
            return hidden[torch.arange(len(hidden)), mask.sum(1) - 1]
        weights = mask.unsqueeze(-1).float()
        return (hidden * weights).sum(1) / weights.sum(1)

    @torch.inference_mode()
    def embed(texts: list[str]) -> np.ndarray:
        lengths = [len(ids) for ids in tokenizer(texts, **options)["input_ids"]]
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
        for start in range(0, len(order), BATCH_SIZE):
            idx = order[start : start + BATCH_SIZE]
            batch = tokenizer([texts[i] for i in idx], padding=True, return_tensors="pt", **options)
            hidden = model(**batch).last_hidden_state.float()
            out[idx] = torch.nn.functional.normalize(pool(hidden, batch["attention_mask"]), dim=-1).numpy()
        return out

    return embed


def vllm_system(spec: dict) -> Embed:
    """vLLM's offline ``LLM`` with the pooling runner; it schedules and batches by itself."""
    from vllm import LLM
    from vllm.config import PoolerConfig

    llm = LLM(model=spec["model"], runner="pooling", dtype=spec["dtype"], max_model_len=spec["max_length"],
              pooler_config=PoolerConfig(pooling_type=spec["pooling"]), seed=0)

    def embed(texts: list[str]) -> np.ndarray:
        outputs = llm.embed(texts, tokenization_kwargs={"truncate_prompt_tokens": -1}, use_tqdm=False)
        return np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)

    return embed


SYSTEMS: dict[str, Callable[[dict], Embed]] = {
    "poolrunner": poolrunner_system,
    "poolrunner-eager": poolrunner_eager_system,
    "sentence-transformers": sentence_transformers_system,
    "transformers": transformers_system,
    "openvino": openvino_system,
    "vllm": vllm_system,
}
