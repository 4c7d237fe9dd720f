"""The embedders the benchmark compares: one builder per system, each returning ``embed``.

``embed(texts: list[str]) -> np.ndarray`` float32 ``[len(texts), hidden_size]``. Builders import
their library lazily: this module is also imported by the peers' own virtual environments,
which hold only numpy, torch and that peer. ``spec`` is the worker's job description (see
``worker.py``): ``model`` (a local folder), ``pooling`` ("MEAN" or "LAST"), ``max_length`` (the
model maximum in tokens) and ``dtype`` ("float32", "bfloat16" or, for poolrunner, "auto" or "int8").

With ``spec["inputs"] == "images"`` (the ``images`` profile) the items are image file paths and
``model`` a CLIP folder (``st_model``: the same as a sentence-transformers folder): every system
reads and decodes the files itself, so decoding is part of each one's time. Such an ``embed``
may carry ``stages``: ``{"decode": f(paths) -> images, "preprocess": f(images)}``, the system's
own first two stages, which the worker times apart (``worker.py``).
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
    if spec.get("inputs") == "images":
        from pathlib import Path

        def embed_images(paths: list[str]) -> np.ndarray:
            return runtime.embed([Path(p) for p in paths])

        images = runtime.frontend.images  # the same two calls Frontend.plan makes per image
        embed_images.stages = {"decode": lambda paths: [images.open(Path(p), i) for i, p in enumerate(paths)],
                               "preprocess": lambda decoded: [images.pixels(im, i) for i, im in enumerate(decoded)]}
        return embed_images
    return lambda texts: runtime.embed(texts, truncate_prompt_tokens=-1)


def poolrunner_eager_system(spec: dict) -> Embed:
    """poolrunner with ``compile="off"``: transformers' modules as they are, the path before the
    oneDNN fast path."""
    return poolrunner_system(spec, compile="off")


def sentence_transformers_system(spec: dict) -> Embed:
    """sentence-transformers fp32 with its own length sorting (by characters), batch 32."""
    from sentence_transformers import SentenceTransformer

    if spec.get("inputs") == "images":  # image paths: ST reads them (transformers' load_image)
        model = SentenceTransformer(spec["st_model"], device="cpu")
        return _with_pil_stages(lambda paths: model.encode(paths, batch_size=BATCH_SIZE, convert_to_numpy=True), spec)
    model = SentenceTransformer(spec["model"], device="cpu")
    return lambda texts: model.encode(texts, batch_size=BATCH_SIZE, convert_to_numpy=True)


def _with_pil_stages(embed: Embed, spec: dict) -> Embed:
    """``embed`` with the stages a peer runs before its towers, as it runs them: PIL decodes
    each file to RGB, then the folder's ``AutoImageProcessor`` (in the peer's own environment,
    so its own transformers) makes the pixel values."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(spec["model"])

    def decode(paths: list[str]) -> list:
        return [Image.open(p).convert("RGB") for p in paths]

    def run(items: list) -> np.ndarray:
        return embed(items)

    run.stages = {"decode": decode,
                  "preprocess": lambda decoded: [processor(images=im, return_tensors="pt") for im in decoded]}
    return run


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

    if spec.get("inputs") == "images":
        return _vllm_images(spec)
    llm = LLM(model=spec["model"], runner="pooling", dtype=spec["dtype"], max_model_len=spec["max_length"],
              pooler_config=PoolerConfig(pooling_type=spec["pooling"]), seed=0)

    def embed(texts: list[str]) -> np.ndarray:
        outputs = llm.embed(texts, tokenization_kwargs={"truncate_prompt_tokens": -1}, use_tqdm=False)
        return np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)

    return embed


def _vllm_images(spec: dict) -> Embed:
    """vLLM's CLIP pooling (``CLIPEmbeddingModel``): an image is a prompt with an empty text and
    the decoded image as ``multi_modal_data`` (vLLM refuses text and image in one prompt). Its
    processed-input cache (``mm_processor_cache_gb=0``) and its prefix cache are off: the profile
    repeats its files, and every other system preprocesses and runs each one (with the prefix
    cache on, a repeated image's whole prompt is a cache hit and vLLM measured 656% of the
    matmul ceiling)."""
    from PIL import Image
    from vllm import LLM

    llm = LLM(model=spec["model"], runner="pooling", dtype=spec["dtype"], seed=0, limit_mm_per_prompt={"image": 1},
              mm_processor_cache_gb=0, enable_prefix_caching=False)

    def embed(paths: list[str]) -> np.ndarray:
        prompts = [{"prompt": "", "multi_modal_data": {"image": Image.open(p).convert("RGB")}} for p in paths]
        outputs = llm.embed(prompts, use_tqdm=False)
        return np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)

    return _with_pil_stages(embed, spec)


def poolrunner_lora_system(spec: dict, *, mixed: bool) -> Embed:
    """poolrunner serving the ``lora`` profile's adapters (``spec["lora_modules"]``): the base
    model's requests (``mixed=False``), or the texts dealt over the adapters in turn, one caller
    per adapter on one serving loop, so that steps mix them (vLLM's ``lora_request`` per prompt)."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    from poolrunner import Runtime, RuntimeConfig

    modules = spec["lora_modules"]
    runtime = Runtime.from_config(RuntimeConfig(model=spec["model"], dtype=spec["dtype"], load_entrypoints=False,
                                                lora_modules=modules, max_lora_rank=spec["lora_rank"]))
    if not mixed:
        return lambda texts: runtime.embed(texts, truncate_prompt_tokens=-1)
    stack = contextlib.ExitStack()
    stack.enter_context(runtime.serving())  # held for the worker's life: each call below joins its steps
    names = list(modules)
    pool = ThreadPoolExecutor(len(names))

    def embed(texts: list[str]) -> np.ndarray:
        dealt = [list(range(k, len(texts), len(names))) for k in range(len(names))]
        parts = pool.map(lambda k: runtime.embed([texts[i] for i in dealt[k]], lora=names[k],
                                                 truncate_prompt_tokens=-1) if dealt[k] else None, range(len(names)))
        vectors = np.empty((len(texts), runtime.model_config.embedding_size), dtype=np.float32)
        for rows, part in zip(dealt, parts, strict=True):
            if rows:
                vectors[rows] = part
        return vectors

    return embed


SYSTEMS: dict[str, Callable[[dict], Embed]] = {
    "poolrunner": poolrunner_system,
    "poolrunner-eager": poolrunner_eager_system,
    "poolrunner-lora-base": lambda spec: poolrunner_lora_system(spec, mixed=False),
    "poolrunner-lora-mixed": lambda spec: poolrunner_lora_system(spec, mixed=True),
    "poolrunner-merged": lambda spec: poolrunner_system({**spec, "model": spec["merged"]}),
    "sentence-transformers": sentence_transformers_system,
    "transformers": transformers_system,
    "openvino": openvino_system,
    "vllm": vllm_system,
}
