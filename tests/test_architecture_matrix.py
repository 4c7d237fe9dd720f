"""The architecture matrix (issue 13): for every model family a user brings, poolrunner gives
transformers' own result, or refuses the folder at load with a clear error.

The table is :data:`tests.models.architectures.FAMILIES`: one seeded tiny folder per
``(family, head)`` row, saved with ``save_pretrained``. The right answer for an input is
transformers' own forward of that folder: the row's class, eager attention (it implements every
feature: Gemma2's soft-capping, sliding windows), fp32, eval, the input run alone (a batch of
one, no padding). ``exact`` rows must give it in every mode:

* ``alone``: one call per input;
* ``mixed``: one call, lengths 3, 9, 17, 30 (longer than every sliding window);
* ``equal``: one call, three different inputs of 12 tokens (nothing padded: the classic trap
  for a causal mask built only for padded batches);
* ``budget8``: every input in one call with ``max_num_batched_tokens=8`` (decoders that are
  causal in every layer run prompts in chunks with a KV cache; the others run each prompt whole);
* ``eos`` (decoder sequence heads): inputs ending in EOS == pad, the reranker layout; transformers
  reads the rightmost token that is not the pad id, i.e. the row before the EOS;
* ``embed-mean`` (``*Model`` rows): ``task="embed"`` with ``pooling_type="MEAN"`` against the mean
  of ``last_hidden_state``.

Outputs: ``*Model`` -> ``token_embed`` rows ``[T, hidden]`` (per-token cosine >= 0.9999 and max
abs <= 1e-4); ``*ForSequenceClassification`` -> ``classify`` raw logits ``[num_labels]`` and
``*ForTokenClassification`` -> ``token_classify`` raw logits ``[T, num_labels]`` (max abs <= 1e-4).
``exact (text, image)`` rows (CLIP, SigLIP, SigLIP2) load with both towers: one text and one image
embed as ``get_text_features`` / ``get_image_features`` do (SigLIP's text padded as the folder's
tokenizer pads it to the text tower's length; ``tests/test_clip.py`` and ``tests/test_siglip.py``
hold the rest). ``exact (queries, pages)`` rows (ColPali, ColQwen2): a query and a page give the
model's ``embeddings`` of its processor's inputs (``tests/test_colpali.py`` holds the rest).
``refused`` rows must raise :class:`poolrunner.ModelLoadError` naming the architecture, and so
must the folders of :data:`~tests.models.architectures.VARIANTS` (a row's folder edited into a
layout poolrunner refuses: remote code, weights the class would drop or leave random, malformed
configs), with one line that names only classes transformers has.

Every test prints its measured deviation (``pytest -s``): ``deviation <row>/<mode>: ...``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.models.architectures import (
    EXACT,
    FAMILIES,
    HEADS,
    LORA_REFUSED,
    PAGE_RETRIEVAL,
    REFUSED,
    REMOTE_CODE_MARKER,
    TEXT_IMAGE,
    VARIANTS,
    Inputs,
    Row,
    build_folder,
    inputs_for,
    load_reference,
    lora_status,
    reference_output,
    rows,
    support_table,
)

README = Path(__file__).resolve().parents[1] / "README.md"
MIN_COSINE = 0.9999
ATOL = 1e-4
BUDGET = 8

ROWS = rows()


def _modes(row: Row) -> list[str]:
    modes = ["alone", "mixed", "equal", "budget8"]
    if row.family.decoder and row.head == "sequence":
        modes.append("eos")
    if row.head == "model":
        modes.append("embed-mean")
    return modes


CASES = [pytest.param(row, mode, id=f"{row.id}/{mode}") for row in ROWS if row.status == EXACT
         for mode in _modes(row)]


# --------------------------------------------------------------------------- fixtures


class Matrix:
    """Per module: each row's folder, its references and its runtimes, built once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._folders: dict[str, Path] = {}
        self._expected: dict[str, dict[tuple[int, ...], np.ndarray]] = {}
        self._runtimes: dict[tuple[Any, ...], Any] = {}

    def folder(self, row: Row) -> Path:
        if row.id not in self._folders:
            self._folders[row.id] = build_folder(row, self.root / row.id.replace("/", "__"))
        return self._folders[row.id]

    def inputs(self, row: Row) -> Inputs:
        return inputs_for(row)

    def expected(self, row: Row, ids: tuple[int, ...]) -> np.ndarray:
        """transformers' answer for ``ids`` run alone (all of the row's inputs computed at once)."""
        if row.id not in self._expected:
            model = load_reference(row, self.folder(row))
            self._expected[row.id] = {x: reference_output(model, x) for x in self.inputs(row).all}
        return self._expected[row.id][ids]

    def runtime(self, row: Row, *, task: str | None = None, budget: int | None = None, **overrides: Any) -> Any:
        from poolrunner import Runtime

        key = (row.id, task, budget, tuple(sorted(overrides.items())))
        if key not in self._runtimes:
            self._runtimes[key] = Runtime(
                str(self.folder(row)), task=task or row.task, dtype="float32", max_num_batched_tokens=budget,
                load_entrypoints=False, **overrides,
            )
        return self._runtimes[key]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread while the module runs: hidden-64 models gain nothing from more, and
    on busy shared cores OpenMP's spinning threads made this module 20x slower (196 s, not 10 s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Matrix:
    return Matrix(tmp_path_factory.mktemp("architectures"))


# --------------------------------------------------------------------------- comparison


@dataclasses.dataclass
class Deviation:
    min_cosine: float = 1.0
    max_abs: float = 0.0
    worst: str = ""

    def add(self, name: str, got: Any, expected: np.ndarray) -> None:
        got = np.asarray(got)
        assert got.dtype == np.float32, f"{name}: dtype {got.dtype}, expected float32"
        assert got.shape == expected.shape, f"{name}: shape {got.shape}, transformers gives {expected.shape}"
        a = np.atleast_2d(got.astype(np.float64))
        b = np.atleast_2d(expected)
        cosine = float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())
        max_abs = float(np.abs(a - b).max())
        if cosine < self.min_cosine or max_abs > self.max_abs:
            self.worst = name
        self.min_cosine = min(self.min_cosine, cosine)
        self.max_abs = max(self.max_abs, max_abs)

    def __str__(self) -> str:
        return f"min cosine {self.min_cosine:.9f}, max abs {self.max_abs:.2e} (worst: {self.worst})"


def _encode(rt: Any, row: Row, batch: list[tuple[int, ...]], **options: Any) -> list[np.ndarray]:
    if row.head != "model":
        options.setdefault("use_activation", False)
    out = rt.encode([list(ids) for ids in batch], **options)
    assert len(out) == len(batch)
    return out


# --------------------------------------------------------------------------- the table itself


def test_table_lists_every_head_transformers_has():
    """Heads a family lacks are absent by construction; a head transformers gains shows up here."""
    import transformers

    assert len({f.id for f in FAMILIES}) == len(FAMILIES) and len({f.label for f in FAMILIES}) == len(FAMILIES)
    for family in FAMILIES:
        present = tuple(h for h in HEADS if hasattr(transformers, family.architecture(h)))
        assert family.heads == present, family.id
        assert set(family.status.values()) <= {EXACT, REFUSED, TEXT_IMAGE, PAGE_RETRIEVAL}, family.id


def test_readme_support_table_matches_the_matrix():
    """README's ``## Supported architectures`` table is :func:`support_table` verbatim
    (regenerate it with ``python -m tests.models.architectures``)."""
    readme = README.read_text(encoding="utf-8")
    assert "\n## Supported architectures\n" in readme, "README lacks the '## Supported architectures' section"
    section = readme.split("\n## Supported architectures\n", 1)[1].split("\n## ", 1)[0]
    assert support_table() in section, (
        "README's support table differs from tests/models/architectures.py; paste the output of "
        "`python -m tests.models.architectures`:\n" + support_table()
    )


# --------------------------------------------------------------------------- load


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_load(row, matrix):
    """``exact`` rows load as their own class; ``refused`` rows fail at load naming it."""
    from poolrunner import ModelLoadError, Runtime
    from poolrunner.core.testing.steps import record_steps

    if row.status == REFUSED:
        with pytest.raises(ModelLoadError) as info:
            Runtime(str(matrix.folder(row)), task=row.task, dtype="float32", load_entrypoints=False)
        assert row.architecture in str(info.value), str(info.value)
        return
    if row.status == TEXT_IMAGE:
        _check_text_image(row, matrix.folder(row), matrix.inputs(row).mixed[2])
        return
    if row.status == PAGE_RETRIEVAL:
        _check_page_retrieval(row, matrix.folder(row))
        return
    rt = matrix.runtime(row)
    assert rt.model_config.architecture == row.architecture
    assert rt.task == row.task
    # Prompts run in chunks exactly where every layer is causal (the load probe's verdict): a
    # prompt over the token budget runs in pieces, or else whole in a step of its own.
    budgeted = matrix.runtime(row, budget=BUDGET)
    prompt = max(matrix.inputs(row).all, key=len)
    assert len(prompt) > BUDGET
    with record_steps(budgeted) as log:
        _encode(budgeted, row, [prompt])
    assert (len(log.chunks(log.admitted[0])) > 1) is row.family.causal


def _check_text_image(row: Row, folder: Path, ids: tuple[int, ...]) -> None:
    """Both towers of a text-image row, against the family's own features (normalized)."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from poolrunner import Runtime

    rt = Runtime(str(folder), dtype="float32", load_entrypoints=False)
    assert (rt.model_config.architecture, rt.task) == (row.architecture, "embed")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8))
    model = load_reference(row, folder)
    pixels = AutoImageProcessor.from_pretrained(folder, backend="pil")(images=image, return_tensors="pt")
    text_inputs = {"input_ids": torch.tensor([ids])}
    if row.family.id.startswith("siglip"):  # the pipeline's padding="max_length" to the tower's length
        tokenizer = AutoTokenizer.from_pretrained(folder)
        padded = tokenizer.pad({"input_ids": [list(ids)]}, padding="max_length",
                               max_length=model.config.text_config.max_position_embeddings, return_tensors="pt")
        text_inputs = {key: padded[key] for key in tokenizer.model_input_names}
    with torch.inference_mode():
        text = model.get_text_features(**text_inputs).pooler_output
        picture = model.get_image_features(**pixels).pooler_output
    want = torch.nn.functional.normalize(torch.cat([text, picture]), dim=-1).double().numpy()
    deviation = Deviation()
    deviation.add("a text and an image", rt.embed([list(ids), image]), want)
    print(f"deviation {row.id}/text-image: {deviation}")
    assert deviation.min_cosine >= MIN_COSINE and deviation.max_abs <= ATOL, f"{row.architecture}: {deviation}"


def _check_page_retrieval(row: Row, folder: Path) -> None:
    """A query and a page of a page-retrieval row, against the model's ``embeddings`` of its
    processor's ``process_queries`` / ``process_images``."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    from poolrunner import Runtime

    rt = Runtime(str(folder), dtype="float32", load_entrypoints=False)
    assert (rt.model_config.architecture, rt.task) == (row.architecture, "token_embed")
    page = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8))
    model = load_reference(row, folder)
    processor = AutoProcessor.from_pretrained(folder)
    deviation = Deviation()
    for name, item, batch in (("a query", "w1 w2 w3", processor.process_queries(["w1 w2 w3"])),
                              ("a page", page, processor.process_images([page]))):
        with torch.inference_mode():
            want = model(**batch).embeddings[0].double().numpy()
        deviation.add(name, rt.encode(item)[0], want)
    print(f"deviation {row.id}/queries-pages: {deviation}")
    assert deviation.min_cosine >= MIN_COSINE and deviation.max_abs <= ATOL, f"{row.architecture}: {deviation}"


@pytest.mark.parametrize("variant", VARIANTS, ids=[variant.id for variant in VARIANTS])
def test_refused_folder(variant, matrix, tmp_path):
    """Each variant fails at load with its one-line reason; no folder code runs."""
    import re
    import shutil

    import transformers

    from poolrunner import ModelLoadError, Runtime

    row = next(row for row in ROWS if row.id == variant.row)
    folder = tmp_path / variant.id
    shutil.copytree(matrix.folder(row), folder)
    variant.edit(folder)
    with pytest.raises(ModelLoadError) as info:
        Runtime(str(folder), dtype="float32", load_entrypoints=False)
    message = str(info.value)
    assert variant.message in message and "\n" not in message, message
    assert not (folder / REMOTE_CODE_MARKER).exists()
    named = set(re.findall(r"\b[A-Z]\w*(?:Model|For\w+)\b", message))
    assert {name for name in named if not hasattr(transformers, name)} <= {"Qwen2ForRewardModel",
                                                                            "Qwen2ForProcessRewardModel"}, message


# --------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize(("row", "mode"), CASES)
def test_matches_transformers(row, mode, matrix):
    inputs = matrix.inputs(row)
    deviation = Deviation()
    if mode == "alone":
        rt = matrix.runtime(row)
        for i, ids in enumerate(inputs.all):
            deviation.add(f"input {i} ({len(ids)} tokens)", _encode(rt, row, [ids])[0], matrix.expected(row, ids))
    elif mode == "embed-mean":
        rt = matrix.runtime(row, task="embed", pooling_type="MEAN")
        batch = list(inputs.mixed + inputs.equal)
        for i, (ids, got) in enumerate(zip(batch, _encode(rt, row, batch, normalize=False), strict=True)):
            deviation.add(f"input {i} ({len(ids)} tokens)", got, matrix.expected(row, ids).mean(0))
    else:
        batch = list({"mixed": inputs.mixed, "equal": inputs.equal, "eos": inputs.eos, "budget8": inputs.all}[mode])
        rt = matrix.runtime(row, budget=BUDGET if mode == "budget8" else None)
        for i, (ids, got) in enumerate(zip(batch, _encode(rt, row, batch), strict=True)):
            deviation.add(f"input {i} ({len(ids)} tokens)", got, matrix.expected(row, ids))
    print(f"deviation {row.id}/{mode}: {deviation}")
    if row.head == "model":
        assert deviation.min_cosine >= MIN_COSINE, f"{row.architecture} {mode}: {deviation}"
    assert deviation.max_abs <= ATOL, f"{row.architecture} {mode}: {deviation}"


# --------------------------------------------------------------------------- LoRA column


LORA_ROWS = [pytest.param(row, id=row.id) for row in ROWS if row.head == "model" and lora_status(row.family) != "—"]


# PEFT 0.21 reads transformers' deprecated is_gradient_checkpointing: the reference's warning, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False but the target module is `Conv1D`:UserWarning")
@pytest.mark.parametrize("row", LORA_ROWS)
def test_lora_with_peft_default_targets_matches_peft(row, matrix, tmp_path):
    """README's LoRA column: an adapter on PEFT's default ``target_modules`` for the family
    (``LoraConfig`` naming none; GPT-2's Conv1D: PEFT sets ``fan_in_fan_out``), every input of
    a mixed-length call against ``PeftModel``'s forward of it alone; or refused naming the layer."""
    import transformers
    from peft import LoraConfig, PeftModel

    from poolrunner import ModelLoadError, Runtime
    from tests.test_lora import make_adapter

    folder = matrix.folder(row)
    adapter = make_adapter(folder, tmp_path / "adapter", LoraConfig(r=4, lora_alpha=8),
                           auto=getattr(transformers, row.architecture))
    if lora_status(row.family) == REFUSED:
        with pytest.raises(ModelLoadError, match=f"{LORA_REFUSED[row.family.id]}'.* also runs this layer on its "
                                                 "relative position embeddings"):
            Runtime(str(folder), task=row.task, dtype="float32", load_entrypoints=False,
                    lora_modules={"a": str(adapter)})
        return
    reference = PeftModel.from_pretrained(load_reference(row, folder), adapter).eval()
    rt = Runtime(str(folder), task=row.task, dtype="float32", load_entrypoints=False,
                 lora_modules={"a": str(adapter)})
    inputs = matrix.inputs(row).mixed
    deviation = Deviation()
    for i, (ids, got) in enumerate(zip(inputs, _encode(rt, row, list(inputs), lora="a"), strict=True)):
        deviation.add(f"input {i} ({len(ids)} tokens)", got, reference_output(reference, ids))
    print(f"deviation {row.id}/lora: {deviation}")
    assert deviation.min_cosine >= MIN_COSINE and deviation.max_abs <= ATOL, str(deviation)
    assert not np.allclose(_encode(rt, row, [inputs[-1]])[0], reference_output(reference, inputs[-1]), atol=1e-3)
