"""Chunked prefill: a decoder prompt longer than what is left of the step budget
(``max_num_batched_tokens``) runs over several steps, keeping a per-request KV cache between them.

Every result must equal the unchunked run (a large budget) and transformers' own model on the
same weights, in float32, for every pooling: LAST (``embed``), ALL (``token_embed``,
``token_classify``), STEP, MEAN and CLS forced on a decoder, and ``classify`` (LAST + score
head). A request yields nothing until its last chunk has run. One caller's requests are scheduled
first come, first served: a partially prefilled request continues before a new one starts, so the
schedule of requests that arrive together is their token stream cut into budget-size windows.
Encoder (bidirectional) models are never chunked: an over-budget prompt runs alone in one step.
Aborted, abandoned or failed requests leave nothing behind: no request, no queue entry, no
per-request cache, and a later request under the same id sees no stale keys and values.

Models: the tiny seeded Llama, Qwen3 and GPT-2 folders of ``make_decoder_folder`` /
``make_classifier_folder`` (hidden 64, 2 layers, vocab 1000, pad == eos == 2), the real
SmolLM2-135M-Instruct (one ~200-token Lee text; Lee sentences cut to 55, 56 and 57 tokens) and the
default all-MiniLM-L6-v2.
Prompts of the tiny models are token ids in ``3..999`` (no pad/eos/bos id).
"""

from __future__ import annotations

import math
import random
import re
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import poolrunner
from poolrunner.core import InvalidRequestError, PluginHookError, PoolingParams, PoolingRequest, RequestState, hookimpl
from poolrunner.core.testing.steps import record_steps
from tests.helpers import MIN_COSINE, cosine_rows
from tests.models.smollm2 import SMOLLM2_HIDDEN_SIZE, SMOLLM2_PAD_ID, smollm2_folder

FAMILIES = ("llama", "qwen3", "gpt2")
HIDDEN = 64
ATOL = 1e-5  # fp32 on both sides
REFERENCE_LENGTHS = (55, 56, 57)  # REFERENCE.md: prompts of 55, 56 and 57 tokens...
REFERENCE_BUDGET = 10  # ...with a 10-token budget equal the unchunked result per token
LARGE_BUDGET = 8192  # nothing here is chunked
STEP_TAG = 10
TASKS = r"(embed|classify|token_embed|token_classify|embed&token_classify)"


# --------------------------------------------------------------------------- helpers


def make_prompt(n: int, seed: int, tags: Sequence[int] = ()) -> list[int]:
    """``n`` token ids in ``3..999`` other than :data:`STEP_TAG`, with the tag at ``tags``."""
    rng = random.Random(seed)
    ids = [rng.choice([t for t in range(3, 1000) if t != STEP_TAG]) for _ in range(n)]
    for i in tags:
        ids[i] = STEP_TAG
    return ids


def softmax(x: Any) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def max_dev(got: Any, expected: Any) -> float:
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max()) if got.size else 0.0


def assert_close(got: Any, expected: Any, *, vectors: bool = True, what: str = "") -> None:
    """Within :data:`ATOL`; rows of hidden states (``vectors``) also at cosine >= 0.9999 each."""
    dev = max_dev(got, expected)
    assert dev <= ATOL, f"{what}: max abs deviation {dev:.3g}"
    if vectors:
        cos = cosine_rows(got, expected).min()
        assert cos >= MIN_COSINE, f"{what}: min cosine {cos:.8f}"


def expected_schedule(lengths: Sequence[int], budget: int) -> list[list[tuple[int, int]]]:
    """FCFS chunked prefill of requests that arrive together: their concatenated token stream cut
    into ``budget``-token steps, as ``[(request index, tokens), ...]`` per step."""
    steps: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    room = budget
    for index, remaining in enumerate(lengths):
        while remaining:
            take = min(remaining, room)
            current.append((index, take))
            remaining -= take
            room -= take
            if room == 0:
                steps.append(current)
                current, room = [], budget
    if current:
        steps.append(current)
    return steps


def finish_steps(lengths: Sequence[int], budget: int) -> list[int]:
    """The number of finished requests per step for :func:`expected_schedule`."""
    counts = [0] * math.ceil(sum(lengths) / budget)
    total = 0
    for n in lengths:
        total += n
        counts[math.ceil(total / budget) - 1] += 1
    return counts


class StepLog:
    """Wraps ``engine.step`` (ids it finished, per call) and ``engine.scheduler.schedule``
    (``(request id, tokens)`` per non-empty step); undone by ``monkeypatch`` after the test."""

    def __init__(self, rt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.finished: list[list[str]] = []
        self.scheduled: list[list[tuple[str, int]]] = []
        engine = rt._engine
        step, schedule = engine.step, engine.scheduler.schedule

        def counting_step() -> Any:
            out = step()
            self.finished.append([request_id for request_id, _ in out])
            return out

        def recording_schedule() -> Any:
            out = schedule()
            if out.requests:
                self.scheduled.append([(state.request_id, int(n))
                                       for state, n in zip(out.requests, out.num_scheduled_tokens, strict=True)])
            return out

        monkeypatch.setattr(engine, "step", counting_step)
        monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)

    @property
    def steps(self) -> int:
        return len(self.finished)

    def reset(self) -> None:
        self.finished.clear()
        self.scheduled.clear()

    def by_index(self, ids: Sequence[str]) -> list[list[tuple[int, int]]]:
        """:attr:`scheduled` with request ids replaced by their index in ``ids``."""
        position = {request_id: i for i, request_id in enumerate(ids)}
        return [[(position[request_id], n) for request_id, n in step] for step in self.scheduled]


def _request_like(key: Any) -> bool:
    if isinstance(key, RequestState):
        return True
    return isinstance(key, str) and (key.startswith("cp-") or re.fullmatch(f"{TASKS}-\\d+", key) is not None)


def _plain_poolrunner_object(value: Any) -> bool:
    """An engine or attention helper object (a cache holder, say): not a module, tensor or hooks."""
    return (hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
            and type(value).__module__.startswith(
                ("poolrunner.core.engine", "poolrunner.core.kernels", "poolrunner.core.model")))


def leftover_request_state(rt: Any) -> list[str]:
    """Everything per-request still held by the engine: entries of ``engine.requests``, queued
    requests of the scheduler, and -- whatever the runner names its KV cache -- entries keyed by
    a request (id or state) in any dict attribute of the runner, or of plain poolrunner objects
    the runner holds (one level down)."""
    engine = rt._engine
    found = [f"engine.requests[{request_id!r}]" for request_id in engine.requests]
    for name, value in vars(engine.scheduler).items():
        if isinstance(value, (list, tuple, deque, set, dict)) and value:
            found.append(f"scheduler.{name} holds {len(value)} request(s)")

    def scan(obj: Any, path: str, depth: int) -> None:
        for name, value in vars(obj).items():
            if isinstance(value, dict):
                keys = [key for key in value if _request_like(key)]
                found.extend(f"{path}.{name}[{key!r}]" for key in keys)
            elif isinstance(value, (list, tuple, set, deque)):
                found.extend(f"{path}.{name} holds {item.request_id!r}" for item in value
                             if isinstance(item, RequestState))
            elif depth and _plain_poolrunner_object(value):
                scan(value, f"{path}.{name}", depth - 1)

    scan(engine.runner, "runner", 1)
    return found


def assert_clean(rt: Any) -> None:
    leftovers = leftover_request_state(rt)
    assert not leftovers, f"per-request state left in the engine: {leftovers}"


def requests_of(prompts: Sequence[Sequence[int]], task: str, prefix: str = "cp", **params: Any) -> list[PoolingRequest]:
    return [PoolingRequest(request_id=f"{prefix}-{i}", prompt_token_ids=list(p),
                           params=PoolingParams(task=task, **params)) for i, p in enumerate(prompts)]


# --------------------------------------------------------------------------- 1. the REFERENCE check

# How each case builds its folder, runs poolrunner and computes the transformers reference.
CASES = {
    # case: (head of make_decoder_folder, or "sequence" for make_classifier_folder; runtime task;
    #        transformers class; hidden-state rows?)
    "token_embed": ("model", "token_embed", "AutoModel", True),
    "embed": ("model", "embed", "AutoModel", True),
    "token_classify": ("token", "token_classify", "AutoModelForTokenClassification", False),
    "step": ("token", "token_classify", "AutoModelForTokenClassification", False),
    "classify": ("sequence", "classify", "AutoModelForSequenceClassification", False),
}
# STEP tags on both sides of the first chunk boundary (positions 9 | 10), mid-prompt and last.
STEP_POSITIONS = (9, 10, 19, 33, -1)


def _folder(case: str, family: str, make_decoder_folder: Any, make_classifier_folder: Any) -> Any:
    head = CASES[case][0]
    return make_classifier_folder(family, "multiclass") if head == "sequence" else make_decoder_folder(family, head)


def _run_case(case: str, rt: Any, prompts: list[list[int]]) -> list[np.ndarray]:
    if case == "embed":
        return list(rt.embed(prompts, normalize=False))
    if case == "classify":
        return [result.probs for result in rt.classify(prompts)]
    if case == "step":
        return rt.encode(prompts, step_tag_id=STEP_TAG)
    return rt.encode(prompts)


def _expected_case(case: str, ref: Any, prompt: list[int]) -> np.ndarray:
    out = ref.alone(prompt)  # last_hidden_state [n, h] / token logits [n, 5] / sequence logits [3]
    if case == "embed":
        return out[-1]
    if case == "step":
        return softmax(out[[i for i, token in enumerate(prompt) if token == STEP_TAG]])
    if case in ("token_classify", "classify"):
        return softmax(out)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_55_56_57_tokens_with_budget_10_equal_the_unchunked_run(
    family, case, make_decoder_folder, make_classifier_folder, task_runtime, token_reference, monkeypatch
):
    folder = _folder(case, family, make_decoder_folder, make_classifier_folder)
    _, task, model_class, vectors = CASES[case]
    chunked = task_runtime(folder, task, max_num_batched_tokens=REFERENCE_BUDGET)
    whole = task_runtime(folder, task)
    assert chunked.model_config.is_causal and chunked.task == task
    tags = STEP_POSITIONS if case == "step" else ()
    prompts = [make_prompt(n, seed=n, tags=tags) for n in REFERENCE_LENGTHS]
    ref = token_reference(folder, model_class)
    expected = [_expected_case(case, ref, prompt) for prompt in prompts]
    if case == "step":
        assert [e.shape for e in expected] == [(len(STEP_POSITIONS), 5)] * 3

    log = StepLog(chunked, monkeypatch)
    got = _run_case(case, chunked, prompts)
    # 168 tokens in 10-token steps: every step is full (a prompt that does not fit what is left
    # is split), and each request comes back only in the step that runs its last chunk.
    assert log.steps == math.ceil(sum(REFERENCE_LENGTHS) / REFERENCE_BUDGET) == 17
    assert [len(ids) for ids in log.finished] == finish_steps(REFERENCE_LENGTHS, REFERENCE_BUDGET)
    assert all(sum(n for _, n in step) <= REFERENCE_BUDGET for step in log.scheduled)
    unchunked = _run_case(case, whole, prompts)
    for i, (rows, base, want) in enumerate(zip(got, unchunked, expected, strict=True)):
        assert np.asarray(rows).dtype == np.float32
        assert_close(rows, base, vectors=vectors, what=f"{family}/{case} prompt {i} vs unchunked")
        assert_close(rows, want, vectors=vectors, what=f"{family}/{case} prompt {i} vs transformers")
    assert_clean(chunked)


# --------------------------------------------------------------------------- 2. mixed batches, joining


MIXED_LENGTHS = (5, 57, 12, 3, 16, 9)  # short, long, short...: the long one is chunked among them
MIXED_BUDGET = 16


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_long_prompt_among_short_ones(family, make_decoder_folder, task_runtime, token_reference, monkeypatch):
    folder = make_decoder_folder(family, "model")
    chunked = task_runtime(folder, "token_embed", max_num_batched_tokens=MIXED_BUDGET)
    whole = task_runtime(folder, "token_embed")
    ref = token_reference(folder)
    prompts = [make_prompt(n, seed=100 + i) for i, n in enumerate(MIXED_LENGTHS)]
    requests = requests_of(prompts, "token_embed")
    ids = [request.request_id for request in requests]

    log = StepLog(chunked, monkeypatch)
    got = dict(chunked._engine.run(requests))
    assert sorted(got) == sorted(ids)
    # FCFS with no starvation: the tokens are scheduled in arrival order, every step full.
    assert log.by_index(ids) == expected_schedule(MIXED_LENGTHS, MIXED_BUDGET)
    assert log.steps == math.ceil(sum(MIXED_LENGTHS) / MIXED_BUDGET) == 7
    assert [len(f) for f in log.finished] == finish_steps(MIXED_LENGTHS, MIXED_BUDGET)
    assert_clean(chunked)

    whole_log = StepLog(whole, monkeypatch)
    unchunked = dict(whole._engine.run(requests))
    assert whole_log.steps == 1 < log.steps
    for i, (request_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
        rows = got[request_id].numpy()
        assert rows.shape == (len(prompt), HIDDEN)
        assert_close(rows, unchunked[request_id].numpy(), what=f"prompt {i} vs unchunked")
        assert_close(rows, ref.alone(prompt), what=f"prompt {i} vs transformers")

    # The 57-token prompt alone with a 10-token budget: ceil(57 / 10) = 6 steps, output in the last.
    alone_rt = task_runtime(folder, "token_embed", max_num_batched_tokens=10)
    alone_log = StepLog(alone_rt, monkeypatch)
    (rows,) = alone_rt.encode([prompts[1]])
    assert alone_log.steps == 6
    assert [len(f) for f in alone_log.finished] == [0, 0, 0, 0, 0, 1]
    assert [[n for _, n in step] for step in alone_log.scheduled] == [[10]] * 5 + [[7]]
    assert_close(rows, ref.alone(prompts[1]), what="57 tokens alone, budget 10")
    assert_clean(alone_rt)


def test_requests_join_and_leave_between_steps(make_decoder_folder, task_runtime, token_reference, monkeypatch):
    """Driving the engine by hand: requests admitted while another is mid-prefill wait for it to
    continue first, then fill what is left of the budget (and are chunked themselves)."""
    folder = make_decoder_folder("llama", "model")
    rt = task_runtime(folder, "token_embed", max_num_batched_tokens=16)
    ref = token_reference(folder)
    engine = rt._engine
    log = StepLog(rt, monkeypatch)
    prompts = {"cp-a": make_prompt(57, 201), "cp-b": make_prompt(5, 202), "cp-c": make_prompt(20, 203),
               "cp-d": make_prompt(3, 204)}
    request = {rid: PoolingRequest(request_id=rid, prompt_token_ids=p, params=PoolingParams(task="token_embed"))
               for rid, p in prompts.items()}
    results: dict[str, Any] = {}

    def step() -> list[str]:
        out = engine.step()
        results.update(out)
        return [rid for rid, _ in out]

    engine.add_request(request["cp-a"])
    assert step() == []
    engine.add_request(request["cp-b"])
    engine.add_request(request["cp-c"])
    assert step() == [] and step() == []  # a continues first: b and c wait although they arrived
    assert sorted(step()) == ["cp-a", "cp-b"]
    engine.add_request(request["cp-d"])
    assert step() == []  # c (18 tokens left) continues before d starts
    assert sorted(step()) == ["cp-c", "cp-d"]
    assert not engine.has_unfinished_requests()
    assert log.scheduled == [
        [("cp-a", 16)], [("cp-a", 16)], [("cp-a", 16)], [("cp-a", 9), ("cp-b", 5), ("cp-c", 2)],
        [("cp-c", 16)], [("cp-c", 2), ("cp-d", 3)],
    ]
    for rid, prompt in prompts.items():
        assert_close(results[rid].numpy(), ref.alone(prompt), what=rid)
    assert_clean(rt)


# --------------------------------------------------------------------------- 3. the budget boundary


@pytest.mark.parametrize("family", FAMILIES)
def test_budget_boundary(family, make_decoder_folder, task_runtime, token_reference, monkeypatch):
    """Exactly the budget: one step. One token more: two steps, the second runs one token."""
    budget = 16
    folder = make_decoder_folder(family, "model")
    ref = token_reference(folder)
    at, over = make_prompt(budget, 301), make_prompt(budget + 1, 302)
    for task in ("token_embed", "embed"):
        rt = task_runtime(folder, task, max_num_batched_tokens=budget)
        log = StepLog(rt, monkeypatch)
        for prompt, steps in ((at, [[budget]]), (over, [[budget], [1]])):
            log.reset()
            if task == "embed":
                (got,) = rt.embed([prompt], normalize=False)
                want = ref.alone(prompt)[-1]
            else:
                (got,) = rt.encode([prompt])
                want = ref.alone(prompt)
            assert [[n for _, n in step] for step in log.scheduled] == steps, (task, len(prompt))
            assert [len(f) for f in log.finished] == [0] * (len(steps) - 1) + [1]
            assert_close(got, want, what=f"{task} with {len(prompt)} tokens, budget {budget}")
        assert_clean(rt)
    # Two prompts that fill the budget exactly share one step.
    rt = task_runtime(folder, "token_embed", max_num_batched_tokens=budget)
    log = StepLog(rt, monkeypatch)
    halves = [make_prompt(8, 303), make_prompt(8, 304)]
    got = rt.encode(halves)
    assert log.steps == 1 and [len(f) for f in log.finished] == [2]
    for rows, prompt in zip(got, halves, strict=True):
        assert_close(rows, ref.alone(prompt), what="8 + 8 tokens")


# --------------------------------------------------------------------------- 4. MEAN and CLS across chunks


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mean_and_cls_pool_across_chunks(family, pooling, make_decoder_folder, task_runtime, token_reference,
                                         monkeypatch):
    folder = make_decoder_folder(family, "model")
    chunked = task_runtime(folder, "embed", pooling_type=pooling, max_num_batched_tokens=REFERENCE_BUDGET)
    whole = task_runtime(folder, "embed", pooling_type=pooling)
    assert chunked.model_config.pooling_type == pooling and chunked.model_config.is_causal
    ref = token_reference(folder)
    prompts = [make_prompt(n, seed=400 + n) for n in REFERENCE_LENGTHS]
    states = [ref.alone(prompt) for prompt in prompts]
    expected = np.stack([s.mean(0) if pooling == "MEAN" else s[0] for s in states])
    # Meaningful: neither the first row, nor the mean, nor the last row of a chunk would pass.
    wrong = np.stack([s[50:].mean(0) if pooling == "MEAN" else s[50] for s in states])
    assert cosine_rows(expected, wrong).max() < 0.99

    log = StepLog(chunked, monkeypatch)
    got = chunked.embed(prompts, normalize=False)
    assert log.steps == 17 and [len(f) for f in log.finished] == finish_steps(REFERENCE_LENGTHS, REFERENCE_BUDGET)
    assert got.shape == (3, HIDDEN) and got.dtype == np.float32
    assert_close(got, whole.embed(prompts, normalize=False), what=f"{pooling} vs unchunked")
    assert_close(got, expected, what=f"{pooling} vs transformers")
    normalized = chunked.embed(prompts)  # the default normalizes the pooled vector
    assert_close(normalized, expected / np.linalg.norm(expected, axis=1, keepdims=True), what="normalized")
    assert_clean(chunked)


# --------------------------------------------------------------------------- 5. real SmolLM2


@pytest.mark.slow
def test_smollm2_lee_text_chunked(lee_docs, monkeypatch):
    from transformers import AutoTokenizer

    folder = smollm2_folder()
    text = f"{lee_docs[9]} {lee_docs[10]}"
    ids = AutoTokenizer.from_pretrained(folder, local_files_only=True)(text)["input_ids"]
    assert 180 <= len(ids) <= 230 and SMOLLM2_PAD_ID not in ids, len(ids)
    budget = 64

    whole = poolrunner.Runtime(folder, task="token_embed", dtype="float32")
    (base,) = whole.encode([text])
    assert base.shape == (len(ids), SMOLLM2_HIDDEN_SIZE)
    del whole
    chunked = poolrunner.Runtime(folder, task="token_embed", dtype="float32", max_num_batched_tokens=budget)
    log = StepLog(chunked, monkeypatch)
    (rows,) = chunked.encode([text])
    assert log.steps == math.ceil(len(ids) / budget) == 4
    assert [[n for _, n in step] for step in log.scheduled] == [[64], [64], [64], [len(ids) - 192]]
    per_token = cosine_rows(rows, base)
    print(f"\n[smollm2 chunked] {len(ids)} tokens, budget {budget}: token_embed min cosine "
          f"{per_token.min():.8f}, max abs dev {max_dev(rows, base):.3g}")
    assert per_token.min() >= MIN_COSINE
    assert_clean(chunked)
    del chunked

    embed_rt = poolrunner.Runtime(folder, dtype="float32", max_num_batched_tokens=budget)
    assert embed_rt.task == "embed" and embed_rt.model_config.pooling_type == "LAST"
    log = StepLog(embed_rt, monkeypatch)
    vector = embed_rt.embed(text, normalize=False)
    assert log.steps == 4
    # LAST of the unchunked run: its last token's hidden state.
    cos = float(cosine_rows(vector, base[-1])[0])
    print(f"[smollm2 chunked] embed (LAST) cosine {cos:.8f}")
    assert cos >= MIN_COSINE
    assert_clean(embed_rt)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["token_embed", "embed"])
def test_smollm2_55_56_57_tokens_with_budget_10_equal_one_pass_and_free_their_caches(smollm2_chunk_prompts, task):
    folder = smollm2_folder()
    whole = poolrunner.Runtime(folder, task=task, dtype="float32", load_entrypoints=False)
    chunked = poolrunner.Runtime(folder, task=task, dtype="float32", load_entrypoints=False,
                                 max_num_batched_tokens=REFERENCE_BUDGET)
    expected = whole.encode(smollm2_chunk_prompts)
    with record_steps(chunked) as log:
        got = chunked.encode(smollm2_chunk_prompts)
    worst = min(float(cosine_rows(one, many).min()) for one, many in zip(expected, got, strict=True))
    assert worst >= MIN_COSINE
    # every step runs a full 10-token budget
    assert len(log.steps) == -(-sum(REFERENCE_LENGTHS) // REFERENCE_BUDGET)
    assert not chunked._engine.runner.kv_caches and not chunked._engine.runner.partial_hidden
    print(f"\n[smollm2] chunked {task}: min_cosine={worst:.10f} (1-cos {1 - worst:.1e}), steps={len(log.steps)}")


# --------------------------------------------------------------------------- 6. encoders are never chunked


def test_encoder_prompts_are_never_chunked(task_runtime, runtime, st_model, text_with_tokens, monkeypatch):
    rt = task_runtime(None, max_num_batched_tokens=16)
    assert not rt.model_config.is_causal and rt.model_config.architecture == "BertModel"
    long_text, short, tiny = text_with_tokens(40, 1), text_with_tokens(10, 2), text_with_tokens(5, 3)
    log = StepLog(rt, monkeypatch)
    vector = rt.embed(long_text)
    assert log.steps == 1 and [[n for _, n in step] for step in log.scheduled] == [[40]]
    assert_close(vector, runtime.embed(long_text), what="40 tokens vs unchunked")
    assert cosine_rows(vector, st_model.encode([long_text], convert_to_numpy=True)[0])[0] >= MIN_COSINE

    # Among others: the over-budget prompt waits for a step of its own and runs whole there.
    log.reset()
    texts = [short, long_text, tiny]
    vectors = rt.embed(texts)
    assert [[n for _, n in step] for step in log.scheduled] == [[10], [40], [5]]
    assert [len(f) for f in log.finished] == [1, 1, 1]
    assert_close(vectors, runtime.embed(texts), what="mixed vs unchunked")
    assert cosine_rows(vectors, st_model.encode(texts, convert_to_numpy=True)).min() >= MIN_COSINE
    assert_clean(rt)


# --------------------------------------------------------------------------- 7. failures and cancellation


class FailingPlugin:
    """Records admissions and removals; raises in ``prepare_inputs`` on step ``fail_at``."""

    def __init__(self) -> None:
        self.fail_at: int | None = None
        self.calls = 0
        self.admitted: list[str] = []
        self.removed: list[str] = []

    @hookimpl
    def add_request(self, state):
        self.admitted.append(state.request_id)

    @hookimpl
    def prepare_inputs(self, batch):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return None

    @hookimpl
    def remove_request(self, state):
        self.removed.append(state.request_id)


def test_failures_and_cancellation_leave_nothing_behind(make_decoder_folder, token_reference):
    folder = make_decoder_folder("qwen3", "model")
    ref = token_reference(folder)
    plugin = FailingPlugin()
    rt = poolrunner.Runtime(folder, task="token_embed", dtype="float32", max_num_batched_tokens=10,
                            plugins=[plugin])
    engine = rt._engine
    prompts = [make_prompt(5, 501), make_prompt(57, 502), make_prompt(55, 503)]
    fresh = [make_prompt(57, 504), make_prompt(6, 505), make_prompt(23, 506)]  # reused ids, new prompts

    def check_serves(requests: list[PoolingRequest], expected_prompts: list[list[int]]) -> None:
        """The same ids run again with other prompts: a stale cache under an id would show."""
        got = dict(engine.run(requests))
        for request, prompt in zip(requests, expected_prompts, strict=True):
            assert_close(got[request.request_id].numpy(), ref.alone(prompt), what=request.request_id)
        assert_clean(rt)

    # (a) Rejected at admission among others (duplicate id after two admitted): nothing runs.
    requests = requests_of(prompts, "token_embed")
    duplicate = PoolingRequest(request_id="cp-1", prompt_token_ids=[5, 6], params=PoolingParams(task="token_embed"))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        list(engine.run([*requests[:2], duplicate, requests[2]]))
    assert plugin.calls == 0 and sorted(plugin.removed) == sorted(plugin.admitted) == ["cp-0", "cp-1"]
    assert_clean(rt)
    with pytest.raises(InvalidRequestError, match="513"):  # over max_model_len (512), among others
        rt.encode([prompts[0], make_prompt(513, 507), prompts[1]])
    assert_clean(rt)
    check_serves(requests_of(fresh, "token_embed"), fresh)

    # (b) A step fails mid-way: step 8, when the 55-token prompt has 8 tokens prefilled (its
    # first chunk ran next to the end of the 57-token prompt, which finished in step 7).
    plugin.__init__()
    plugin.fail_at = 8
    with pytest.raises(PluginHookError, match=r"^plugin FailingPlugin \(programmatic\) raised in its prepare_inputs "
                                              r"hook: RuntimeError: injected failure; "):
        rt.encode(prompts)
    assert plugin.calls == 8
    assert sorted(plugin.removed) == sorted(plugin.admitted) and len(plugin.admitted) == 3  # each once
    assert_clean(rt)
    plugin.fail_at = None
    check_serves(requests_of(fresh, "token_embed"), fresh)

    # (c) A generator closed after its first output: the others are mid-prefill, then abandoned.
    plugin.__init__()
    generator = engine.run(requests_of(prompts, "token_embed"))
    request_id, output = next(generator)
    assert request_id == "cp-0" and plugin.calls == 1  # 5 tokens + the first 5 of the 57-token prompt
    assert_close(output.numpy(), ref.alone(prompts[0]), what="first output")
    assert sorted(engine.requests) == ["cp-1", "cp-2"]
    # The check below is not vacuous: it sees the per-request cache of the partial request now.
    held = leftover_request_state(rt)
    assert any(entry.startswith("runner.") and "'cp-1'" in entry for entry in held), held
    generator.close()
    assert_clean(rt)
    assert sorted(plugin.removed) == sorted(plugin.admitted) == ["cp-0", "cp-1", "cp-2"]
    check_serves(requests_of(fresh, "token_embed"), fresh)

    # (d) abort_request of a request mid-prefill, then the same id with another prompt.
    engine.add_request(requests_of([prompts[1]], "token_embed", prefix="cp-x")[0])
    assert engine.step() == [] and engine.step() == []
    engine.abort_request("cp-x-0")
    engine.abort_request("cp-x-0")  # a second abort is a no-op
    assert_clean(rt)
    check_serves(requests_of([fresh[2]], "token_embed", prefix="cp-x"), [fresh[2]])
