"""``truncate_prompt_tokens`` below the special tokens the tokenizer adds (issue 13).

transformers cannot truncate a text below its special tokens (BERT's ``[CLS] ... [SEP]``: 2,
a BERT pair ``[CLS] A [SEP] B [SEP]``: 3): with ``truncation=True, max_length=1`` it logs a
warning and returns the whole input. poolrunner refuses such a value with a 400-class error
naming the minimum, and checks every truncated prompt's length itself. References: transformers'
own tokenizer and forward pass on the same folder.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

import poolrunner
from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.server import ServerSettings
from poolrunner.core.testing.server import ServerThread
from tests.helpers import MIN_COSINE, cosine_rows, normalized

pytestmark = pytest.mark.slow

LONG = "Pooling turns the hidden states of every token into a single vector for the whole text. " * 3


def _below(k: int, minimum: int, name: str, every: str = "input") -> str:
    return (f"truncate_prompt_tokens={k} is below the {minimum} special tokens model {name} adds to every "
            f"{every}; use at least {minimum} (or -1 for the model maximum)")


class _IgnoresTruncation:
    """A tokenizer that, like transformers below the special tokens, returns untruncated ids."""

    def __init__(self, tokenizer: object) -> None:
        self.__dict__["_tokenizer"] = tokenizer

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._tokenizer(*args, **{**kwargs, "truncation": False, "max_length": None})

    def __getattr__(self, name: str) -> object:
        return getattr(self._tokenizer, name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._tokenizer, name, value)


# --------------------------------------------------------------------------- Python API, single texts


def test_transformers_ignores_a_limit_below_the_special_tokens(hf_tokenizer):
    """The behaviour this guards against (if transformers starts refusing, the check stays right)."""
    assert hf_tokenizer.num_special_tokens_to_add(pair=False) == 2
    full = hf_tokenizer(LONG)["input_ids"]
    assert hf_tokenizer(LONG, truncation=True, max_length=1, verbose=False)["input_ids"] == full


def test_one_token_is_refused_and_the_runtime_still_serves(runtime, assert_serves):
    assert runtime.inputs.num_special_tokens == {False: 2, True: 3}
    with pytest.raises(InvalidRequestError) as excinfo:
        runtime.embed([LONG, "short"], truncate_prompt_tokens=1)
    assert str(excinfo.value) == _below(1, 2, runtime.model_config.name)
    assert_serves(runtime)
    with pytest.raises(InvalidRequestError, match=r"^truncate_prompt_tokens=1 is below the 2 special tokens "):
        runtime.embed("x", truncate_prompt_tokens=1, truncation_side="left")
    assert_serves(runtime)


@pytest.mark.parametrize("side", ["right", "left"])
def test_two_tokens_keep_only_the_special_tokens(runtime, hf_tokenizer, hf_mean, assert_serves, side):
    special = [hf_tokenizer.cls_token_id, hf_tokenizer.sep_token_id]
    assert runtime.inputs.encode([LONG, "a"], truncate_prompt_tokens=2, truncation_side=side) == [tuple(special)] * 2
    vectors = runtime.embed([LONG, "a", "another text"], truncate_prompt_tokens=2, truncation_side=side)
    reference = normalized(hf_mean([special]))[0]  # BertModel's forward, mean over [CLS] [SEP]
    assert (cosine_rows(vectors, np.stack([reference] * 3)) >= MIN_COSINE).all()
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    assert_serves(runtime)


def test_token_ids_have_no_minimum(runtime, hf_tokenizer, hf_mean):
    """Token ids already hold their special tokens: truncation slices them, to any k >= 1."""
    ids = hf_tokenizer(LONG)["input_ids"]
    assert runtime.inputs.encode([ids], truncate_prompt_tokens=1) == [(ids[0],)]
    vector = runtime.embed([ids], truncate_prompt_tokens=1, truncation_side="left")
    assert cosine_rows(vector, hf_mean([ids[-1:]]))[0] >= MIN_COSINE
    # ... but not when a text in the same call must be truncated too.
    with pytest.raises(InvalidRequestError, match=r"^truncate_prompt_tokens=1 is below the 2 special tokens"):
        runtime.embed([ids, "a text"], truncate_prompt_tokens=1)


def test_a_truncated_prompt_is_checked_not_trusted(runtime, monkeypatch, assert_serves):
    """A tokenizer that does not truncate is caught, without telling the user to pass the option
    they passed."""
    monkeypatch.setattr(runtime.inputs, "tokenizer", _IgnoresTruncation(runtime.inputs.tokenizer))
    full = len(runtime.inputs.encode([LONG])[0])
    with pytest.raises(InvalidRequestError) as excinfo:
        runtime.embed(["short", LONG], truncate_prompt_tokens=10)
    assert str(excinfo.value) == (
        f"input 1 still has {full} tokens after truncation to 10 (the tokenizer of {runtime.model_config.name} "
        "did not truncate it); shorten it"
    )
    with pytest.raises(InvalidRequestError, match=r"^input 0 still has \d+ tokens after truncation to 5 "):
        runtime.inputs.encode_pairs([(LONG, LONG)], truncate_prompt_tokens=5)
    monkeypatch.undo()
    assert_serves(runtime)


def test_minus_one_below_the_special_tokens(hf_tokenizer):
    small = poolrunner.Runtime(max_model_len=1, dtype="float32")
    with pytest.raises(InvalidRequestError) as excinfo:
        small.embed("a", truncate_prompt_tokens=-1)
    assert str(excinfo.value) == (
        f"truncate_prompt_tokens=-1 keeps max_model_len=1 tokens, below the 2 special tokens model "
        f"{small.model_config.name} adds to every input; load it with max_model_len of at least 2"
    )
    ids = hf_tokenizer("a")["input_ids"]
    assert small.embed([ids], truncate_prompt_tokens=-1).shape == (1, 384)  # token ids: sliced to 1


def test_bi_encoder_score_truncates_single_texts(runtime, assert_serves):
    with pytest.raises(InvalidRequestError) as excinfo:
        runtime.score("a query", [LONG], truncate_prompt_tokens=1)
    assert str(excinfo.value) == _below(1, 2, runtime.model_config.name)
    assert_serves(runtime)
    scores = runtime.score("a query", [LONG, "other"], truncate_prompt_tokens=2)
    np.testing.assert_allclose(scores, 1.0, atol=1e-5)  # every text is [CLS] [SEP]


# --------------------------------------------------------------------------- pairs (cross-encoders)


@pytest.mark.parametrize(("family", "minimum"), [("bert", 3), ("roberta", 4)])
def test_pair_minimum(family, minimum, make_classifier_folder, classifier_runtime, classifier_reference,
                      word_texts):
    folder = make_classifier_folder(family, "single")
    rt, reference = classifier_runtime(folder), classifier_reference(folder)
    assert rt.inputs.num_special_tokens[True] == minimum
    assert reference.tokenizer.num_special_tokens_to_add(pair=True) == minimum
    name = rt.model_config.name
    pairs = list(zip(word_texts(3, 31, lo=5, hi=20), word_texts(3, 32, lo=20, hi=40), strict=True))
    below = minimum - 1
    for call in (lambda: rt.classify(pairs, truncate_prompt_tokens=below),
                 lambda: rt.score(pairs[0][0], [d for _, d in pairs], truncate_prompt_tokens=below),
                 lambda: rt.rerank(pairs[0][0], [d for _, d in pairs], truncate_prompt_tokens=below)):
        with pytest.raises(InvalidRequestError) as excinfo:
            call()
        assert str(excinfo.value) == _below(below, minimum, name, "(text, text_pair) pair")
    # Single texts need only their own special tokens, in the same call as pairs they do not.
    singles = [text for text, _ in pairs]
    rt.classify(singles, truncate_prompt_tokens=2)
    with pytest.raises(InvalidRequestError, match=rf"^truncate_prompt_tokens=2 is below the {minimum} special"):
        rt.classify([singles[0], pairs[0]], truncate_prompt_tokens=2)
    # At the minimum: only the special tokens, as transformers tokenizes and scores them.
    encoded = rt.inputs.encode_pairs(pairs, truncate_prompt_tokens=minimum)
    assert {len(ids) for ids, _ in encoded} == {minimum}
    got = np.stack([result.probs for result in rt.classify(pairs, truncate_prompt_tokens=minimum)])
    np.testing.assert_allclose(got, reference.scores(pairs, max_length=minimum), rtol=1e-5, atol=1e-6)
    # And the runtime still serves full pairs.
    np.testing.assert_allclose(rt.score(pairs[0][0], [pairs[0][1]]), reference.scores(pairs[:1])[:, 0],
                               rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def server(runtime):
    with ServerThread(runtime) as running:
        yield running


def _error(answer: httpx.Response) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    return error["message"]


def test_http_one_token_is_a_400_then_the_server_serves(server, runtime, poolrunner_step_recorder):
    steps = poolrunner_step_recorder(runtime)
    message = _error(httpx.post(f"{server.url}/v1/embeddings", json={"input": [LONG], "truncate_prompt_tokens": 1}))
    assert message == _below(1, 2, "all-MiniLM-L6-v2")  # over HTTP the served name, never the folder's path
    assert server.serving.pending == 0 and not steps.in_flight
    for path, payload in (("/pooling", {"input": LONG, "truncate_prompt_tokens": 1}),
                          ("/score", {"text_1": "q", "text_2": [LONG], "truncate_prompt_tokens": 1})):
        assert _error(httpx.post(f"{server.url}{path}", json=payload)) == _below(1, 2, "all-MiniLM-L6-v2")
    answer = httpx.post(f"{server.url}/v1/embeddings", json={"input": [LONG, "a"], "truncate_prompt_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 4
    np.testing.assert_allclose([item["embedding"] for item in answer.json()["data"]],
                               runtime.embed([LONG, "a"], truncate_prompt_tokens=2), atol=2e-6)
    plain = httpx.post(f"{server.url}/v1/embeddings", json={"input": "A normal request."})
    np.testing.assert_allclose(plain.json()["data"][0]["embedding"], runtime.embed("A normal request."), atol=2e-6)


def test_http_too_long_without_truncation_suggests_the_option(server):
    message = _error(httpx.post(f"{server.url}/v1/embeddings", json={"input": "word " * 400}))
    assert message.endswith("shorten it or pass truncate_prompt_tokens (-1 keeps the maximum), or ask the operator "
                            "for --truncate-prompt-tokens (the default of clients that cannot send it)")


def test_the_servers_truncate_prompt_tokens_is_the_default_of_bodies_that_set_none(runtime):
    """``--truncate-prompt-tokens -1``: clients that cannot send the field (Chroma's, Haystack's
    OpenAI embedders) get the model maximum; a body's own value still wins; TEI's routes follow
    ``--auto-truncate``, not this setting."""
    long = "word " * 400
    with ServerThread(runtime, ServerSettings(truncate_prompt_tokens=-1, auto_truncate=False)) as running:
        answer = httpx.post(f"{running.url}/v1/embeddings", json={"input": [long, "a"]})
        np.testing.assert_allclose([item["embedding"] for item in answer.json()["data"]],
                                   runtime.embed([long, "a"], truncate_prompt_tokens=-1), atol=2e-6)
        own = httpx.post(f"{running.url}/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 5})
        np.testing.assert_allclose(own.json()["data"][0]["embedding"],
                                   runtime.embed(long, truncate_prompt_tokens=5), atol=2e-6)
        tei = httpx.post(f"{running.url}/embed", json={"inputs": long})
        assert tei.status_code == 422 and tei.json()["error_type"] == "Validation"
    with pytest.raises(ValueError, match="^truncate_prompt_tokens must be -1 \\(the model maximum\\) or a positive "
                                         "number of tokens, got 0$"):
        ServerSettings(truncate_prompt_tokens=0)


def test_http_pairs(make_classifier_folder, classifier_runtime, classifier_reference, word_texts):
    folder = make_classifier_folder("bert", "single")
    rt, reference = classifier_runtime(folder), classifier_reference(folder)
    query, documents = "w1 w2 w3", word_texts(2, 41, lo=10, hi=30)
    with ServerThread(rt) as running:
        for path, payload in (("/score", {"text_1": query, "text_2": documents, "truncate_prompt_tokens": 2}),
                              ("/rerank", {"query": query, "documents": documents, "truncate_prompt_tokens": 2})):
            message = _error(httpx.post(f"{running.url}{path}", json=payload))
            assert message == _below(2, 3, Path(folder).name, "(text, text_pair) pair")  # the served name
        answer = httpx.post(f"{running.url}/score", json={"text_1": query, "text_2": documents,
                                                          "truncate_prompt_tokens": 3})
        assert answer.status_code == 200, answer.text
        got = [item["score"] for item in answer.json()["data"]]
        pairs = [(query, document) for document in documents]
        np.testing.assert_allclose(got, reference.scores(pairs, max_length=3)[:, 0], rtol=1e-5, atol=1e-6)
