"""Input validation, truncation and scheduling limits.

Every rejected input is checked for its exact error (type, and a message naming the value and
the limit), and the same runtime must then still embed a normal text correctly. Accepted edge
cases are compared with sentence-transformers or transformers on the same weights.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import pytest
import torch

import poolrunner
from poolrunner import InvalidRequestError, ModelLoadError, PoolingParams, PoolingRequest, UnsupportedTaskError
from poolrunner.core.testing.steps import StepLog
from tests.helpers import MIN_COSINE, cosine_rows, run_requests

HANG_TIMEOUT_S = 60


def call_with_timeout(fn, seconds: float = HANG_TIMEOUT_S) -> Any:
    """Run ``fn`` in a daemon thread and fail, instead of hanging, if it does not finish."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not finish within {seconds} s: the request hangs"
    if "error" in box:
        raise box["error"]
    return box["value"]


# --------------------------------------------------------------------------- lengths and truncation


def test_over_long_input_without_truncation(runtime, text_with_tokens, assert_serves):
    long_text = text_with_tokens(300, seed=1)
    with pytest.raises(InvalidRequestError,
                       match=r"^input 1 has 300 tokens, more than the maximum of 256 \(max_model_len of .*\).*"
                             r"truncate_prompt_tokens"):
        runtime.embed(["fine", long_text, "also fine"])
    assert_serves(runtime)


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncate_to_k_tokens(runtime, st_model, hf_tokenizer, hf_mean, lee_docs, side):
    text, k = lee_docs[9], 20
    kept = runtime.inputs.encode([text], truncate_prompt_tokens=k, truncation_side=side)[0]
    # (transformers ignores a truncation_side call argument: set the attribute, then restore it.)
    saved_side = hf_tokenizer.truncation_side
    try:
        hf_tokenizer.truncation_side = side
        expected_ids = hf_tokenizer(text, truncation=True, max_length=k)["input_ids"]
    finally:
        hf_tokenizer.truncation_side = saved_side
    full_ids = hf_tokenizer(text)["input_ids"]
    body = full_ids[1 : k - 1] if side == "right" else full_ids[-(k - 1) : -1]
    assert expected_ids == [full_ids[0], *body, full_ids[-1]]
    assert list(kept) == expected_ids and len(kept) == k
    assert kept[0] == hf_tokenizer.cls_token_id and kept[-1] == hf_tokenizer.sep_token_id
    vector = runtime.embed(text, truncate_prompt_tokens=k, truncation_side=side)
    # transformers on the truncated ids ...
    assert cosine_rows(vector, hf_mean([expected_ids]))[0] >= MIN_COSINE
    # ... and sentence-transformers with the same limit and side.
    saved = st_model.max_seq_length, st_model.tokenizer.truncation_side
    try:
        st_model.max_seq_length = k
        st_model.tokenizer.truncation_side = side
        reference = st_model.encode(text)
    finally:
        st_model.max_seq_length, st_model.tokenizer.truncation_side = saved
    assert cosine_rows(vector, reference)[0] >= MIN_COSINE
    # The two sides really keep different tokens.
    other = runtime.embed(text, truncate_prompt_tokens=k, truncation_side="left" if side == "right" else "right")
    assert cosine_rows(vector, other)[0] < 0.99


def test_truncate_token_id_inputs(runtime, hf_mean, hf_tokenizer, lee_docs):
    ids = hf_tokenizer(lee_docs[9])["input_ids"]
    left = runtime.embed([ids], truncate_prompt_tokens=30, truncation_side="left")
    right = runtime.embed([ids], truncate_prompt_tokens=30)
    assert cosine_rows(left, hf_mean([ids[-30:]]))[0] >= MIN_COSINE
    assert cosine_rows(right, hf_mean([ids[:30]]))[0] >= MIN_COSINE


def test_truncate_minus_one_keeps_max_model_len(runtime, st_model, hf_tokenizer, hf_mean, lee_long_docs):
    text = lee_long_docs[0]
    ids = hf_tokenizer(text)["input_ids"]
    assert len(ids) > 256 and runtime.model_config.max_model_len == 256
    kept = runtime.inputs.encode([text], truncate_prompt_tokens=-1)[0]
    assert len(kept) == 256
    vector = runtime.embed(text, truncate_prompt_tokens=-1)
    assert cosine_rows(vector, st_model.encode(text))[0] >= MIN_COSINE
    truncated = hf_tokenizer(text, truncation=True, max_length=256)["input_ids"]
    assert cosine_rows(vector, hf_mean([truncated]))[0] >= MIN_COSINE


@pytest.mark.parametrize("value", [0, -2, 257])
def test_truncate_out_of_range(runtime, assert_serves, value):
    with pytest.raises(InvalidRequestError,
                       match=rf"^truncate_prompt_tokens={value} is out of range: use -1 \(the model maximum\) "
                             r"or 2\.\.256 \(max_model_len of .*\)$"):
        runtime.embed(["hello"], truncate_prompt_tokens=value)
    assert_serves(runtime)


@pytest.mark.parametrize("value", [True, 2.5, "10"])
def test_truncate_not_an_integer(runtime, assert_serves, value):
    with pytest.raises(InvalidRequestError, match=r"^truncate_prompt_tokens must be an integer, got "):
        runtime.embed(["hello"], truncate_prompt_tokens=value)
    assert_serves(runtime)


def test_bad_truncation_side(runtime, assert_serves):
    with pytest.raises(InvalidRequestError, match=r"^truncation_side must be 'left' or 'right', got 'middle'$"):
        runtime.embed(["hello"], truncate_prompt_tokens=5, truncation_side="middle")
    assert_serves(runtime)


def test_input_exactly_at_max_model_len(runtime, st_model, text_with_tokens):
    text = text_with_tokens(256, seed=2)
    vector = call_with_timeout(lambda: runtime.embed(text))
    assert cosine_rows(vector, st_model.encode(text))[0] >= MIN_COSINE


# --------------------------------------------------------------------------- token budget


@pytest.fixture(scope="module")
def budget_runtime():
    return poolrunner.Runtime(max_num_batched_tokens=64, max_num_seqs=8, dtype="float32")


@pytest.fixture
def recorded_steps(budget_runtime, poolrunner_step_recorder) -> StepLog:
    return poolrunner_step_recorder(budget_runtime)


def test_input_exactly_at_the_token_budget(budget_runtime, st_model, text_with_tokens, recorded_steps):
    text = text_with_tokens(64, seed=3)
    vector = call_with_timeout(lambda: budget_runtime.embed([text]))
    assert [step.num_scheduled_tokens for step in recorded_steps.steps] == [(64,)]
    assert cosine_rows(vector, st_model.encode([text]))[0] >= MIN_COSINE


def test_input_over_the_budget_runs_alone(budget_runtime, st_model, text_with_tokens, recorded_steps,
                                          assert_serves):
    texts = [text_with_tokens(10, seed=4), text_with_tokens(200, seed=5), text_with_tokens(64, seed=6),
             text_with_tokens(20, seed=7), text_with_tokens(30, seed=8)]
    vectors = call_with_timeout(lambda: budget_runtime.embed(texts))
    assert [step.num_scheduled_tokens for step in recorded_steps.steps] == [(10,), (200,), (64,), (20, 30)]
    assert cosine_rows(vectors, st_model.encode(texts)).min() >= MIN_COSINE
    assert_serves(budget_runtime)


def test_many_over_budget_inputs_never_hang(budget_runtime, st_model, text_with_tokens, recorded_steps):
    texts = [text_with_tokens(n, seed=n) for n in (256, 65, 130, 256)]
    vectors = call_with_timeout(lambda: budget_runtime.embed(texts))
    assert [step.num_scheduled_tokens for step in recorded_steps.steps] == [(256,), (65,), (130,), (256,)]
    assert cosine_rows(vectors, st_model.encode(texts)).min() >= MIN_COSINE


# --------------------------------------------------------------------------- token-id inputs


@pytest.mark.parametrize("bad_id", [30522, 99999, -1])
def test_token_id_out_of_vocabulary(runtime, assert_serves, bad_id):
    with pytest.raises(InvalidRequestError,
                       match=rf"^input 1: token id {bad_id} is outside the vocabulary \[0, 30522\)$"):
        runtime.embed([[101, 2000, 102], [101, bad_id, 102]])
    assert_serves(runtime)


@pytest.mark.parametrize(("bad_token", "shown"), [(1.0, "1.0"), (True, "True"), (None, "None")])
def test_non_int_token(runtime, assert_serves, bad_token, shown):
    message = f"input 1: the token id at position 1 is {shown}, not an integer"
    for inputs in ([[101, 102], [101, bad_token, 102]], ["a", (101, bad_token, 102)]):
        with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$") as caught:
            runtime.embed(inputs)
        assert caught.value.param == "input"
    assert_serves(runtime)


def test_a_flat_list_of_numbers_is_one_token_id_list_and_its_bad_id_is_named(runtime, assert_serves):
    """Not three inputs, the first of them ``101``."""
    with pytest.raises(InvalidRequestError, match=r"^input 0: the token id at position 1 is 1\.5, not an integer$"):
        runtime.embed([101, 1.5, 102])
    assert_serves(runtime)


def test_a_token_id_too_long_to_write_is_named_by_its_size(runtime, assert_serves):
    """Python refuses to write an integer of more than 4,300 digits; the error must not need to."""
    for inputs in ([10**5000], [[101, 10**5000, 102]]):
        with pytest.raises(InvalidRequestError, match=r"^input 0: token id <an integer of about 5,001 digits> is "
                                                      r"outside the vocabulary \[0, 30522\)$"):
            runtime.embed(inputs)
    with pytest.raises(InvalidRequestError, match=r"^documents\[0\] must be a string, got <an integer of about "
                                                  r"5,001 digits>$"):
        runtime.score("q", [10**5000])
    assert_serves(runtime)


@pytest.mark.parametrize(("bad", "message"), [
    ([101, "a", 102], "expected a text, a list of token ids or a (text, text_pair) pair, got [101, 'a', 102]"),
    ([[[[[[1]]]]]], "expected a text, a list of token ids or a (text, text_pair) pair, got [[[[...]]]]"),
    (["only one"], "['only one'] is a list of texts, not one input: send texts as one flat list (a (text, "
                   "text_pair) pair is a tuple in Python, a two-text list where the route reads pairs: /classify, "
                   "/pooling)"),
    (["x" * 1000], "['xxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxx'] is a list of texts, not one input: send texts as one "
                   "flat list"),
])
def test_an_item_of_another_shape_is_named_and_shown_short(runtime, assert_serves, bad, message):
    with pytest.raises(InvalidRequestError, match=f"^{re.escape('input 1: ' + message)}"):
        runtime.embed(["a", bad])
    assert_serves(runtime)


def test_numpy_token_ids_are_accepted(runtime, hf_model):
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    with torch.inference_mode():
        hidden = hf_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    reference = torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()
    for given in (np.array(ids, dtype=np.int64), [np.int32(i) for i in ids]):
        vector = runtime.embed([given])[0]
        assert float(vector @ reference) >= 0.9999


def test_non_sequence_input(runtime, assert_serves):
    with pytest.raises(InvalidRequestError, match=(
            r"^input 2: expected a text, a list of token ids or a \(text, text_pair\) pair, got 42$")):
        runtime.embed(["a", "b", 42])
    for value, shown in ((123, "123 (int)"), (None, "None (NoneType)"), ({"a": 1}, "{'a': 1} (dict)"),
                         (float("nan"), "nan (float)")):
        with pytest.raises(InvalidRequestError) as caught:
            runtime.embed(value)
        assert str(caught.value) == ("input must be a text, a token-id list, a (text, text_pair) pair, an image, "
                                     f"or a list of them; got {shown}")
        assert caught.value.param == "input"
    assert_serves(runtime)


def test_empty_token_list(runtime, assert_serves):
    with pytest.raises(InvalidRequestError, match=r"^input 1 is empty: it has no tokens to pool$"):
        runtime.embed(["fine", []])
    assert_serves(runtime)


def test_over_long_token_ids(runtime, assert_serves):
    with pytest.raises(InvalidRequestError, match=r"^input 0 has 300 tokens, more than the maximum of 256 "):
        runtime.embed([[1000] * 300])
    assert_serves(runtime)


# --------------------------------------------------------------------------- prompts


def test_prompt_with_token_ids(runtime, assert_serves):
    with pytest.raises(InvalidRequestError, match=r"^input 1: a prompt applies to text, not to token ids$"):
        runtime.embed(["text", [101, 2000, 102]], prompt="query: ")
    assert_serves(runtime)


def test_prompt_and_prompt_name(runtime, assert_serves):
    with pytest.raises(InvalidRequestError, match=r"^pass either prompt or prompt_name, not both$"):
        runtime.embed(["text"], prompt="query: ", prompt_name="query")
    assert_serves(runtime)


def test_unknown_prompt_name(runtime, assert_serves):
    with pytest.raises(InvalidRequestError,
                       match=r"^prompt_name 'nope' is not defined by model .*; defined: \[\]$"):
        runtime.embed(["text"], prompt_name="nope")
    assert_serves(runtime)


def test_literal_prompt_matches_sentence_transformers(runtime, st_model, lee_docs):
    texts = [lee_docs[4], "who won the match?"]
    vectors = runtime.embed(texts, prompt="query: ")
    assert cosine_rows(vectors, st_model.encode(texts, prompt="query: ")).min() >= MIN_COSINE
    assert cosine_rows(vectors, st_model.encode(texts)).max() < 0.9999  # the prompt changed them


# --------------------------------------------------------------------------- empty text


@pytest.mark.parametrize("text", ["", "   ", "\n\t "])
def test_empty_and_whitespace_text(runtime, st_model, hf_tokenizer, text):
    # Documented: embedded as the tokenizer encodes it, [CLS] [SEP] for BERT.
    assert runtime.inputs.encode([text])[0] == (hf_tokenizer.cls_token_id, hf_tokenizer.sep_token_id)
    vector = runtime.embed(text)
    assert vector.shape == (384,)
    assert cosine_rows(vector, st_model.encode(text))[0] >= MIN_COSINE
    assert cosine_rows(vector, st_model.encode(""))[0] >= MIN_COSINE


def test_empty_list_of_inputs(runtime):
    out = runtime.embed([])
    assert out.shape == (0, 384) and out.dtype == np.float32


# --------------------------------------------------------------------------- engine-level checks


def test_engine_rejects_too_long_and_duplicate_requests(runtime, assert_serves):
    params = PoolingParams(task="embed")
    ok = PoolingRequest(request_id="r-ok", prompt_token_ids=[101, 2000, 102], params=params)
    long = PoolingRequest(request_id="r-long", prompt_token_ids=[1000] * 257, params=params)
    with pytest.raises(InvalidRequestError,
                       match=r"^request 'r-long' has 257 tokens, more than the maximum of 256 \(max_model_len of"):
        run_requests(runtime, [ok, long])
    assert_serves(runtime)
    with pytest.raises(InvalidRequestError, match=r"^request id 'r-ok' is already in flight$"):
        run_requests(runtime, [ok, ok])
    assert_serves(runtime)


def test_engine_rejects_another_task(runtime, assert_serves):
    request = PoolingRequest(request_id="r-cls", prompt_token_ids=[101, 102], params=PoolingParams(task="classify"))
    with pytest.raises(InvalidRequestError,
                       match=r"asks for task 'classify', but this runtime serves \['embed', 'token_embed'\]"):
        run_requests(runtime, [request])
    assert_serves(runtime)


# --------------------------------------------------------------------------- value objects


def test_pooling_params_validators():
    with pytest.raises(ValueError) as excinfo:
        PoolingParams(task="Bogus task")
    assert str(excinfo.value) == (
        "task must be one of ['embed', 'classify', 'token_embed', 'token_classify', 'embed&token_classify'] "
        "or a plugin's task name (lowercase letters, digits and '_', at most 64 characters), got 'Bogus task'"
    )
    with pytest.raises(ValueError, match=r"^dimensions must be a positive integer, got 0$"):
        PoolingParams(task="embed", dimensions=0)
    with pytest.raises(ValueError, match=r"^dimensions must be a positive integer, got '64'$"):
        PoolingParams(task="embed", dimensions="64")
    with pytest.raises(ValueError, match=r"^normalize must be true, false or None, got 'yes'$"):
        PoolingParams(task="embed", normalize="yes")
    params = PoolingParams(task="embed", dimensions=64, normalize=False)
    assert (params.task, params.dimensions, params.normalize) == ("embed", 64, False)


def test_pooling_request_validators():
    params = PoolingParams(task="embed")
    with pytest.raises(ValueError, match=r"^request 'r1': token_type_ids has 2 entries but prompt_token_ids has 3$"):
        PoolingRequest(request_id="r1", prompt_token_ids=[1, 2, 3], token_type_ids=[0, 1], params=params)
    with pytest.raises(ValueError, match=r"^Length of 'prompt_token_ids' must be >= 1: 0$"):
        PoolingRequest(request_id="r2", prompt_token_ids=[], params=params)
    with pytest.raises(ValueError, match=r"^Length of 'request_id' must be >= 1: 0$"):
        PoolingRequest(request_id="", prompt_token_ids=[1], params=params)
    with pytest.raises(TypeError, match=r"'params' must be <class .*PoolingParams'>"):
        PoolingRequest(request_id="r3", prompt_token_ids=[1], params={"task": "embed"})
    request = PoolingRequest(request_id="r4", prompt_token_ids=[101, 7592, 102], token_type_ids=[0, 0, 1],
                             params=params)
    assert request.prompt_token_ids == (101, 7592, 102) and request.num_tokens == 3


# --------------------------------------------------------------------------- runtime arguments


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"max_num_seqs": 0}, ValueError, r"^max_num_seqs must be a positive integer, got 0$"),
    ({"max_num_batched_tokens": -5}, ValueError, r"^max_num_batched_tokens must be a positive integer, got -5$"),
    ({"dtype": "float64"}, ValueError,
     r"^dtype must be one of \['auto', 'float32', 'bfloat16', 'float16', 'bf16-mixed', 'int8'\], got 'float64'$"),
    ({"pooling_type": "MEAN+MAX"}, ValueError,
     r"^pooling_type must be one of \['CLS', 'MEAN', 'LAST', 'MAX', 'WEIGHTEDMEAN', 'MEAN_SQRT_LEN', 'ALL', 'STEP'\], "
     r"got 'MEAN\+MAX'$"),
    ({"task": "classify"}, UnsupportedTaskError,
     r"does not support task 'classify'\. Supported: \['embed', 'token_embed'\]"),
    ({"max_model_len": 600}, ModelLoadError,
     r"^max_model_len=600 exceeds the 512 positions the model .* was built with$"),
    ({"model": "/nonexistent/poolrunner-model"}, ModelLoadError,
     r"^model '/nonexistent/poolrunner-model' is not a local model folder with a config\.json; poolrunner loads "
     r"only local folders and never downloads from a model hub$"),
    ({"model": "sentence-transformers/all-MiniLM-L6-v2"}, ModelLoadError, r"never downloads from a model hub"),
    ({"device": "gpu0"}, InvalidRequestError,
     r"^device 'gpu0' is not a torch device \(try auto, cpu, cuda or cuda:0\)$"),
    ({"device": "meta"}, InvalidRequestError,
     r"^device 'meta' is of type meta; poolrunner runs on cpu or cuda \(auto: CUDA when present, else the CPU\)$"),
])
def test_invalid_runtime_arguments(runtime, assert_serves, kwargs, error, pattern):
    with pytest.raises(error) as excinfo:
        poolrunner.Runtime(**kwargs)
    assert re.search(pattern, str(excinfo.value)), str(excinfo.value)
    assert_serves(runtime)


def test_a_cuda_device_without_cuda_is_refused_before_loading(monkeypatch, assert_serves, runtime):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidRequestError) as caught:
        poolrunner.Runtime(device="cuda:0")
    assert (str(caught.value), caught.value.param) == (
        "device 'cuda:0' asks for CUDA, but no CUDA device is available; use cpu or auto", "device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidRequestError) as caught:
        poolrunner.Runtime(device="cuda:1")
    assert str(caught.value) == "device 'cuda:1' asks for CUDA device 1, but this machine has 1 (cuda:0..cuda:0)"
    assert_serves(runtime)


def test_lower_max_model_len_override(st_model, text_with_tokens, assert_serves):
    rt = poolrunner.Runtime(max_model_len=32, dtype="float32")
    assert rt.model_config.max_model_len == 32
    with pytest.raises(InvalidRequestError, match=r"^input 0 has 33 tokens, more than the maximum of 32 "):
        rt.embed(text_with_tokens(33, seed=9))
    text = text_with_tokens(32, seed=9)
    assert cosine_rows(rt.embed(text), st_model.encode(text))[0] >= MIN_COSINE
    assert_serves(rt)


def test_a_head_the_configured_class_would_drop_is_refused(tmp_path, model_path, runtime, assert_serves):
    """A cross-encoder whose config says BertModel must not silently embed instead of score."""
    import json

    from transformers import AutoTokenizer, BertForSequenceClassification

    BertForSequenceClassification.from_pretrained(model_path, num_labels=1).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as excinfo:
        poolrunner.Runtime(tmp_path, load_entrypoints=False, dtype="float32")
    assert str(excinfo.value) == (
        f"{tmp_path}: the weights hold a head (classifier.bias, classifier.weight) that BertModel does not use; "
        "config.json `architectures` decides the head, so name the class the weights were trained as (for "
        "model_type 'bert': BertModel, BertForSequenceClassification, BertForTokenClassification, BertForMaskedLM, "
        "BertLMHeadModel)"
    )
    assert_serves(runtime)
