"""Token-level tasks against transformers: ``token_embed``, ``token_classify`` (ALL and STEP
pooling) and ``embed&token_classify`` (BGE-M3 style).

Models: real all-MiniLM-L6-v2 weights (the default model; as ``BertForTokenClassification`` with a
seeded head; as a plain BERT folder with a seeded ``sparse_linear.pt``) and the tiny seeded Llama
folders of ``make_decoder_folder``. Outputs are ragged: one array per input, never stacked.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from poolrunner.core import InvalidRequestError, PoolingParams, PoolingRequest
from poolrunner.core.testing.steps import record_steps
from tests.helpers import cosine_rows, run_requests

ATOL = 1e-5
MINILM_TEXTS = [
    "A man is playing a guitar.",
    "Token level outputs are ragged: one array per input, each as long as its prompt.",
    "Short one.",
    "The weather in Paris was sunny and warm for most of the week, unlike the forecast said.",
]
# STEP pooling: a process-reward prompt where token 10 tags the end of each step.
STEP_PROMPT = [99, 10, 99, 10]
STEP_TAG = 10


def softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def unit(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def max_dev(got, expected) -> float:
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max()) if got.size else 0.0


def assert_still_serves(rt, log, inputs, expected, **options) -> None:
    """After a rejected request: nothing is left in the engine (``log``: ``rt``'s step recorder,
    started before the request) and the next request is right."""
    assert not log.in_flight
    for got, want in zip(rt.encode(inputs, **options), expected, strict=True):
        assert max_dev(got, want) <= ATOL


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def minilm_token_folder(tmp_path_factory, model_path):
    """all-MiniLM-L6-v2 as ``BertForTokenClassification`` with a seeded random 5-label head."""
    from transformers import BertForTokenClassification

    folder = tmp_path_factory.mktemp("minilm_token_cls")
    labels = {i: name for i, name in enumerate(["O", "B-ORG", "I-ORG", "B-MISC", "I-MISC"])}
    model = BertForTokenClassification.from_pretrained(model_path, local_files_only=True, id2label=labels).eval()
    generator = torch.Generator().manual_seed(21)
    with torch.no_grad():
        model.classifier.weight.copy_(torch.randn(model.classifier.weight.shape, generator=generator) * 0.3)
        model.classifier.bias.copy_(torch.randn(model.classifier.bias.shape, generator=generator) * 0.1)
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copyfile(model_path / file, folder / file)
    return folder


@pytest.fixture(scope="session")
def bge_m3_folder(make_minilm_folder):
    """MiniLM files without modules.json / 1_Pooling (no sentence-transformers pipeline) plus a
    seeded BGE-M3 style ``sparse_linear.pt``: ``Linear(384, 1)``."""
    folder = make_minilm_folder("bge_m3_like")
    assert not (folder / "modules.json").exists() and not (folder / "1_Pooling").exists()
    torch.manual_seed(5)
    torch.save(torch.nn.Linear(384, 1).state_dict(), folder / "sparse_linear.pt")
    return folder


@pytest.fixture(scope="session", params=["llama", "minilm"])
def token_classifier(request, make_decoder_folder, minilm_token_folder):
    """A ``*ForTokenClassification`` folder with 5 labels: the tiny Llama, or MiniLM (BERT)."""
    return make_decoder_folder("llama", "token") if request.param == "llama" else minilm_token_folder


# --------------------------------------------------------------------------- token_classify (ALL)


def test_minilm_token_classification(minilm_token_folder, task_runtime, token_reference):
    rt = task_runtime(minilm_token_folder)
    assert (rt.task, rt.model_config.architecture) == ("token_classify", "BertForTokenClassification")
    ref = token_reference(minilm_token_folder, "AutoModelForTokenClassification")
    assert rt.model_config.labels == ("O", "B-ORG", "I-ORG", "B-MISC", "I-MISC")
    ids = ref.token_ids(MINILM_TEXTS)
    logits = ref.rows(ids)

    probs = rt.encode(MINILM_TEXTS)
    assert [p.shape for p in probs] == [(len(row), 5) for row in ids]
    for got, want in zip(probs, logits, strict=True):
        assert max_dev(got, softmax(want)) <= 3e-2
        assert max_dev(got, softmax(want)) <= 1e-5
    raw = rt.encode(MINILM_TEXTS, use_activation=False)
    for got, want in zip(raw, logits, strict=True):
        assert max_dev(got, want) <= 1e-4  # logits of magnitude ~5


# --------------------------------------------------------------------------- token_embed


def test_default_model_token_embed_is_last_hidden_state(task_runtime, hf_tokenizer, hf_hidden):
    rt = task_runtime(None, "token_embed")
    assert rt.model_config.architecture == "BertModel" and rt.task == "token_embed"
    ids = [hf_tokenizer(text)["input_ids"] for text in MINILM_TEXTS]
    states, mask = hf_hidden(ids)

    out = rt.encode(MINILM_TEXTS)
    assert [rows.shape for rows in out] == [(len(row), 384) for row in ids]
    for i, rows in enumerate(out):
        want = states[i, : len(ids[i])].double().numpy()
        assert max_dev(rows, want) <= ATOL
        assert cosine_rows(rows, want).min() >= 0.9999
    # Raw hidden states (normalize is off by default per token), not the model's MEAN embedding.
    assert abs(np.linalg.norm(out[0], axis=1) - 1).max() > 0.1


def test_token_embed_normalize_per_token(make_decoder_folder, task_runtime, word_texts):
    rt = task_runtime(make_decoder_folder("llama", "model"), "token_embed")
    texts = word_texts(3, 4, 2, 20)
    raw = rt.encode(texts)
    normalized = rt.encode(texts, normalize=True)
    for r, n in zip(raw, normalized, strict=True):
        assert n.shape == r.shape
        np.testing.assert_allclose(np.linalg.norm(n, axis=1), 1.0, atol=1e-5)
        assert max_dev(n, unit(r)) <= 1e-6
        assert abs(np.linalg.norm(r, axis=1) - 1).max() > 0.1  # raw really is unnormalized
    assert all(max_dev(r, o) == 0 for r, o in zip(raw, rt.encode(texts, normalize=False), strict=True))
    # vLLM's use_activation asks for the same; an explicit normalize wins
    for got, want in ((rt.encode(texts, use_activation=True), normalized),
                      (rt.encode(texts, use_activation=True, normalize=False), raw)):
        assert all(max_dev(g, w) == 0 for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("d", [1, 16, 64])
def test_token_embed_matryoshka_dimensions(d, make_decoder_folder, task_runtime, word_texts):
    folder = make_decoder_folder("llama", "model")
    rt = task_runtime(folder, "token_embed", is_matryoshka=True)
    texts = word_texts(3, 5, 2, 20)
    full = task_runtime(folder, "token_embed").encode(texts)
    for normalize in (None, False, True):
        sliced = rt.encode(texts, dimensions=d, normalize=normalize)
        for got, rows in zip(sliced, full, strict=True):
            assert got.shape == (rows.shape[0], d)
            want = unit(rows[:, :d]) if normalize else rows[:, :d]  # slice first, then normalize
            assert max_dev(got, want) <= 1e-6


def test_token_embed_dimension_errors(make_decoder_folder, task_runtime, poolrunner_step_recorder):
    folder = make_decoder_folder("llama", "model")
    plain = task_runtime(folder, "token_embed")
    plain_log = poolrunner_step_recorder(plain)
    prompt = [[1, 5, 6, 7]]
    expected = plain.encode(prompt)
    size = plain.model_config.hidden_size
    message = (f"model {folder} does not support Matryoshka dimensions (got dimensions=8): it answers all {size} "
               "dimensions; its config declares neither is_matryoshka nor matryoshka_dimensions; load it with "
               f"is_matryoshka=True (--is-matryoshka on the command line and the server) to allow 1..{size}")
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        plain.encode(prompt, dimensions=8)
    assert_still_serves(plain, plain_log, prompt, expected)

    matryoshka = task_runtime(folder, "token_embed", is_matryoshka=True)
    matryoshka_log = poolrunner_step_recorder(matryoshka)
    message = f"dimensions=65 is out of range for model {folder}: 1..64"
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        matryoshka.encode(prompt, dimensions=65)
    assert_still_serves(matryoshka, matryoshka_log, prompt, expected)
    for option, value in (("step_tag_id", 10), ("returned_token_ids", [0])):
        with pytest.raises(InvalidRequestError,
                           match=f"^{option} does not apply to task 'token_embed' {re.escape(f'(got {value})')}$"):
            plain.encode(prompt, **{option: value})
        assert_still_serves(plain, plain_log, prompt, expected)


# --------------------------------------------------------------------------- STEP pooling


@pytest.fixture(scope="session")
def step_logits(token_classifier, token_reference) -> np.ndarray:
    """transformers' logits ``[4, 5]`` of :data:`STEP_PROMPT` (no special tokens added)."""
    return token_reference(token_classifier, "AutoModelForTokenClassification").alone(STEP_PROMPT)


def test_step_keeps_the_tagged_rows(token_classifier, task_runtime, step_logits):
    rt = task_runtime(token_classifier)
    full = rt.encode([STEP_PROMPT])[0]
    assert full.shape == (4, 5)
    assert max_dev(full, softmax(step_logits)) <= 1e-5

    (step,) = rt.encode([STEP_PROMPT], step_tag_id=STEP_TAG)
    assert step.shape == (2, 5)
    np.testing.assert_array_equal(step, full[[1, 3]])
    assert max_dev(step, softmax(step_logits[[1, 3]])) <= 1e-5

    (raw,) = rt.encode([STEP_PROMPT], step_tag_id=STEP_TAG, use_activation=False)
    assert max_dev(raw, step_logits[[1, 3]]) <= 1e-4


@pytest.mark.parametrize("columns", [[0, 2], [4], [3, 1, 0]])
def test_step_returned_token_ids_select_columns(columns, token_classifier, task_runtime, step_logits):
    """The activation runs over the selected columns only (plugins/token_pooling/poolers.py):
    with two or more columns each row is a distribution over them."""
    rt = task_runtime(token_classifier)
    (got,) = rt.encode([STEP_PROMPT], step_tag_id=STEP_TAG, returned_token_ids=columns)
    want = softmax(step_logits[[1, 3]][:, columns])
    assert got.shape == (2, len(columns))
    assert max_dev(got, want) <= 1e-5
    np.testing.assert_allclose(got.sum(1), 1.0, atol=1e-6)
    if len(columns) > 1:  # renormalized: not a plain slice of the full distribution
        assert max_dev(got, softmax(step_logits[[1, 3]])[:, columns]) > 1e-3

    (raw,) = rt.encode([STEP_PROMPT], step_tag_id=STEP_TAG, returned_token_ids=columns, use_activation=False)
    assert max_dev(raw, step_logits[[1, 3]][:, columns]) <= 1e-4
    # Without a step tag the columns are selected on every token.
    (every,) = rt.encode([STEP_PROMPT], returned_token_ids=columns)
    assert max_dev(every, softmax(step_logits[:, columns])) <= 1e-5


def test_step_without_a_tag_is_empty(token_classifier, task_runtime, token_reference):
    rt = task_runtime(token_classifier)
    ref = token_reference(token_classifier, "AutoModelForTokenClassification")
    prompts = [STEP_PROMPT, [99, 11, 99], [10], [5, 6, 10, 7]]
    results = rt.encode(prompts, step_tag_id=STEP_TAG)
    assert [r.shape for r in results] == [(2, 5), (0, 5), (1, 5), (1, 5)]
    assert all(r.dtype == np.float32 for r in results)
    for result, prompt in zip(results, prompts, strict=True):
        tagged = [i for i, token in enumerate(prompt) if token == STEP_TAG]
        assert max_dev(result, softmax(ref.alone(prompt)[tagged])) <= 1e-5
    (empty,) = rt.encode([[99, 11, 99]], step_tag_id=STEP_TAG, returned_token_ids=[0, 2])
    assert empty.shape == (0, 2)


def test_step_option_errors_keep_serving(token_classifier, make_decoder_folder, task_runtime, step_logits,
                                        poolrunner_step_recorder):
    rt = task_runtime(token_classifier)
    log = poolrunner_step_recorder(rt)
    expected = [softmax(step_logits[[1, 3]])]
    message = f"returned_token_ids [5, 7] are out of range for model {token_classifier}: it has 5 labels (0..4)"
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        rt.encode([STEP_PROMPT], step_tag_id=STEP_TAG, returned_token_ids=[1, 5, 7])
    assert_still_serves(rt, log, [STEP_PROMPT], expected, step_tag_id=STEP_TAG)
    with pytest.raises(InvalidRequestError, match=r"^step_tag_id must be a non-negative integer, got -1$"):
        rt.encode([STEP_PROMPT], step_tag_id=-1)
    assert_still_serves(rt, log, [STEP_PROMPT], expected, step_tag_id=STEP_TAG)
    for option in ("normalize", "dimensions"):
        with pytest.raises(InvalidRequestError, match=f"^{option} does not apply to task 'token_classify'"):
            rt.encode([STEP_PROMPT], **{option: True if option == "normalize" else 2})
        assert_still_serves(rt, log, [STEP_PROMPT], expected, step_tag_id=STEP_TAG)

    # STEP options on an embed runtime.
    embed_rt = task_runtime(make_decoder_folder("llama", "model"))
    embed_log = poolrunner_step_recorder(embed_rt)
    assert embed_rt.task == "embed"
    embed_expected = embed_rt.embed([STEP_PROMPT])
    with pytest.raises(InvalidRequestError, match=r"^step_tag_id does not apply to task 'embed' \(got 10\)$"):
        embed_rt.encode([STEP_PROMPT], step_tag_id=STEP_TAG)
    assert_still_serves(embed_rt, embed_log, [STEP_PROMPT], embed_expected)
    with pytest.raises(InvalidRequestError, match=r"^returned_token_ids does not apply to task 'embed'"):
        embed_rt.encode([STEP_PROMPT], returned_token_ids=[0])
    assert_still_serves(embed_rt, embed_log, [STEP_PROMPT], embed_expected)


def test_one_step_mixes_step_and_all_requests(make_decoder_folder, task_runtime, token_reference):
    """Per-request options inside one forward pass: STEP, column selection, raw logits and plain ALL."""
    folder = make_decoder_folder("llama", "token")
    rt = task_runtime(folder)
    ref = token_reference(folder, "AutoModelForTokenClassification")
    prompts = [STEP_PROMPT, [1, 10, 20, 30, 10], [1, 40, 50], STEP_PROMPT, [10, 10]]
    options = [{"step_tag_id": 10}, {"step_tag_id": 10, "returned_token_ids": [1, 2]}, {},
               {"use_activation": False}, {"step_tag_id": 10, "use_activation": False, "returned_token_ids": [4]}]
    requests = [PoolingRequest(request_id=f"mix-{i}", prompt_token_ids=p,
                               params=PoolingParams(task="token_classify", **o))
                for i, (p, o) in enumerate(zip(prompts, options, strict=True))]
    with record_steps(rt) as log:
        results = run_requests(rt, requests)
    assert [step.request_ids for step in log.steps] == [tuple(r.request_id for r in requests)]  # all in one step
    for i, (prompt, option) in enumerate(zip(prompts, options, strict=True)):
        logits = ref.alone(prompt)
        if "step_tag_id" in option:
            logits = logits[[j for j, token in enumerate(prompt) if token == option["step_tag_id"]]]
        if "returned_token_ids" in option:
            logits = logits[:, option["returned_token_ids"]]
        want = logits if option.get("use_activation") is False else softmax(logits)
        assert max_dev(results[f"mix-{i}"].numpy(), want) <= 1e-4
    assert not log.in_flight


# --------------------------------------------------------------------------- embed&token_classify


def test_bge_m3_style_embedding_and_token_weights(bge_m3_folder, task_runtime, token_reference,
                                                 poolrunner_step_recorder):
    rt = task_runtime(bge_m3_folder)
    log = poolrunner_step_recorder(rt)
    assert rt.task == "embed&token_classify"  # the first choice when the folder has the head
    assert rt.model_config.model_tasks == {"embed", "token_embed", "token_classify", "embed&token_classify"}
    ref = token_reference(bge_m3_folder)
    ids = ref.token_ids(MINILM_TEXTS)
    states = ref.rows(ids)
    linear = torch.nn.Linear(384, 1).double()
    linear.load_state_dict(torch.load(bge_m3_folder / "sparse_linear.pt", weights_only=True))

    out = rt.encode(MINILM_TEXTS)
    raw = rt.encode(MINILM_TEXTS, normalize=False)
    for result, unnormalized, hidden in zip(out, raw, states, strict=True):
        assert set(result) == {"embedding", "token_weights"}
        assert result["embedding"].shape == (384,) and result["token_weights"].shape == (hidden.shape[0],)
        assert max_dev(result["embedding"], unit(hidden[0])) <= 1e-6  # CLS, normalized
        assert max_dev(unnormalized["embedding"], hidden[0]) <= 1e-4  # CLS, raw
        assert cosine_rows(result["embedding"], unit(hidden.mean(0)))[0] < 0.99  # not MEAN (no ST pipeline)
        with torch.no_grad():
            weights = torch.relu(linear(torch.from_numpy(hidden))).squeeze(-1).numpy()
        assert max_dev(result["token_weights"], weights) <= 1e-5
        assert max_dev(unnormalized["token_weights"], weights) <= 1e-5
    all_weights = np.concatenate([r["token_weights"] for r in out])
    assert (all_weights == 0).any() and (all_weights > 0.05).any(), "relu must both clip and pass"
    for result, hidden in zip(rt.encode(MINILM_TEXTS, use_activation=False), states, strict=True):
        with torch.no_grad():  # vLLM's answer to this task: the CLS unnormalized, the weights before the ReLU
            weights = linear(torch.from_numpy(hidden)).squeeze(-1).numpy()
        assert max_dev(result["embedding"], hidden[0]) <= 1e-4 and max_dev(result["token_weights"], weights) <= 1e-5
    [both] = rt.encode(MINILM_TEXTS[:1], use_activation=False, normalize=True)  # an explicit normalize wins
    assert max_dev(both["embedding"], unit(states[0][0])) <= 1e-6 and (both["token_weights"] < 0).any()
    assert not log.in_flight


@pytest.fixture(scope="module")
def bge_m3_ends_folder(bge_m3_folder, tmp_path_factory):
    """``bge_m3_folder`` whose config names [CLS] and [SEP] its BOS and EOS, as XLM-RoBERTa's
    (BGE-M3's backbone) names <s> and </s>."""
    folder = tmp_path_factory.mktemp("bge_m3_ends")
    shutil.copytree(bge_m3_folder, folder, dirs_exist_ok=True, symlinks=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "bos_token_id": 101, "eos_token_id": 102}))
    return folder


def test_bge_m3_token_weights_leave_out_the_bos_and_eos_as_vllm(bge_m3_ends_folder, task_runtime, token_reference):
    """vLLM's BgeM3EmbeddingModel: ``token_classify`` is relu(sparse_linear(h)) of every token but a
    first BOS and a last EOS (config ids), ``[n]``; ``embed&token_classify`` pairs the same weights
    with the dense vector."""
    rt = task_runtime(bge_m3_ends_folder)
    ref = token_reference(bge_m3_ends_folder)
    linear = torch.nn.Linear(384, 1).double()
    linear.load_state_dict(torch.load(bge_m3_ends_folder / "sparse_linear.pt", weights_only=True))
    ids = ref.token_ids(MINILM_TEXTS) + [[101, 7592, 2088], [7592, 2088, 102], [101, 102], [101]]
    prompts = [*MINILM_TEXTS, *ids[len(MINILM_TEXTS):]]
    with torch.no_grad():
        logits = [linear(torch.from_numpy(hidden)).squeeze(-1).numpy() for hidden in ref.rows(ids)]
    inner = [row[int(t[0] == 101):len(t) - int(len(t) > 1 and t[-1] == 102)]
             for row, t in zip(logits, ids, strict=True)]
    assert [len(row) for row in inner[-4:]] == [2, 2, 0, 0]
    for got, want in zip(rt.encode(prompts, task="token_classify"), inner, strict=True):
        assert got.shape == want.shape and max_dev(got, np.maximum(want, 0)) <= 1e-5
    for got, want in zip(rt.encode(prompts, task="token_classify", use_activation=False), inner, strict=True):
        assert max_dev(got, want) <= 1e-5  # no ReLU
    for got, want in zip(rt.encode(prompts, task="embed&token_classify"), inner, strict=True):
        assert max_dev(got["token_weights"], np.maximum(want, 0)) <= 1e-5


# --------------------------------------------------------------------------- ragged, batch-independent


@pytest.fixture(scope="module")
def token_runtimes(task_runtime, make_decoder_folder, minilm_token_folder, bge_m3_folder):
    return {
        "token_embed": task_runtime(None, "token_embed"),
        "token_classify_llama": task_runtime(make_decoder_folder("llama", "token")),
        "token_classify_minilm": task_runtime(minilm_token_folder),
        "embed&token_classify": task_runtime(bge_m3_folder),
    }


def _as_arrays(result) -> list[np.ndarray]:
    return [result["embedding"], result["token_weights"]] if isinstance(result, dict) else [result]


@pytest.mark.parametrize("name", ["token_embed", "token_classify_llama", "token_classify_minilm",
                                  "embed&token_classify"])
def test_outputs_are_ragged_and_independent_of_the_batch(name, token_runtimes, hf_tokenizer, text_with_tokens,
                                                        word_texts):
    rt = token_runtimes[name]
    if name == "token_classify_llama":
        target = "w7 w300 w12 w48 w901 w5 w66"
        others = word_texts(4, 9, 1, 25)
        same_length = [" ".join(f"w{(i * 37 + k) % 990}" for k in range(7)) for i in range(1, 4)]
    else:
        target = MINILM_TEXTS[1]
        others = [MINILM_TEXTS[0], MINILM_TEXTS[2], MINILM_TEXTS[3], "x"]
        same_length = [text_with_tokens(len(hf_tokenizer(target)["input_ids"]), seed) for seed in range(3)]
    (alone,) = rt.encode([target])
    alone_arrays = _as_arrays(alone)
    for batch in ([target, target], others[:2] + [target] + others[2:], same_length + [target] + same_length,
                  [*others, *same_length, target][::-1]):
        results = rt.encode(batch)
        assert isinstance(results, list) and len(results) == len(batch)
        for i in [i for i, text in enumerate(batch) if text == target]:
            for got, want in zip(_as_arrays(results[i]), alone_arrays, strict=True):
                assert max_dev(got, want) <= ATOL
    # The premise of the equal-length batch: every member has the target's token count.
    assert {_as_arrays(r)[-1].shape[0] for r in rt.encode(same_length)} == {alone_arrays[-1].shape[0]}
    mixed = rt.encode(others)
    lengths = [_as_arrays(r)[-1].shape[0] for r in mixed]
    assert len(set(lengths)) == len(others), "different lengths give different first dimensions"
