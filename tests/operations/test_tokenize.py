"""``tokenize`` (and its inverse) on every surface, same texts, same token ids, each equal to
transformers' own tokenizer of the folder: ``Runtime.tokenize``, ``poolrunner tokenize``, vLLM's
``/tokenize`` and ``/detokenize``, TEI's ``/tokenize`` and ``/decode``; and the Python API embeds
the ids ``/tokenize`` answers exactly as it embeds the text.

The model is the kit's tiny BERT with all-MiniLM-L6-v2's WordPiece tokenizer, so words split
into pieces, text is lowercased and accents stripped, and spans still point into the raw text.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from poolrunner.core import InvalidRequestError
from poolrunner.core.testing.server import ServerThread
from tests.operations.surfaces import assert_close, cli_records, post

TEXTS = ["A cat sat on the mat.", "Unbelievably, naïve café-goers tokenize ☕ too!"]


@pytest.fixture(scope="module")
def folder(poolrunner_tiny_model):
    return poolrunner_tiny_model()


@pytest.fixture(scope="module")
def runtime(task_runtime, folder):
    return task_runtime(folder)


@pytest.fixture(scope="module")
def reference(folder):
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def server(runtime):
    with ServerThread(runtime) as running:
        yield running


@pytest.mark.parametrize("special", [True, False])
def test_the_api_the_cli_and_http_answer_the_reference_ids(server, runtime, folder, reference, tmp_path, special):
    want = [reference(text, add_special_tokens=special)["input_ids"] for text in TEXTS]
    assert runtime.tokenize(TEXTS, add_special_tokens=special) == want
    assert runtime.tokenize(TEXTS[0], add_special_tokens=special) == want[:1]
    flags = [] if special else ["--no-special-tokens"]
    records = cli_records(["tokenize", "--model", str(folder), *flags, *TEXTS], tmp_path / "ids.jsonl")
    assert records == [{"index": i, "token_ids": ids} for i, ids in enumerate(want)]
    http = [post(server.url, "/tokenize", {"prompt": text, "add_special_tokens": special})["tokens"] for text in TEXTS]
    assert http == want


@pytest.mark.parametrize("text", TEXTS)
def test_vllm_tokenize_answers_the_reference_ids(server, runtime, reference, text):
    ids = reference(text)["input_ids"]
    answer = post(server.url, "/tokenize", {"prompt": text})
    assert answer == {"count": len(ids), "max_model_len": runtime.model_config.max_model_len, "tokens": ids,
                      "token_strs": None}  # vLLM's null unless asked
    plain = post(server.url, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    plain_ids = reference(text, add_special_tokens=False)["input_ids"]
    assert (plain["tokens"], plain["token_strs"]) == (plain_ids, reference.convert_ids_to_tokens(plain_ids))


@pytest.mark.parametrize("text", ["", " "])
def test_a_text_of_no_tokens_is_tokenized_to_none(server, runtime, reference, text):
    """Without special tokens, "" and " " have no tokens: tokenizing answers [] as the tokenizer
    does (only a request to pool refuses an input of no tokens)."""
    assert reference(text, add_special_tokens=False)["input_ids"] == []
    assert runtime.tokenize([text, "a"], add_special_tokens=False) == [[], reference("a", add_special_tokens=False)
                                                                           ["input_ids"]]
    answer = post(server.url, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert (answer["count"], answer["tokens"]) == (0, [])


def test_tei_tokenize_answers_the_same_ids_with_their_spans(server, reference):
    answer = post(server.url, "/tokenize", {"inputs": TEXTS})
    for text, tokens in zip(TEXTS, answer, strict=True):
        encoded = reference(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        assert [token["id"] for token in tokens] == encoded["input_ids"]
        assert [token["special"] for token in tokens] == [bool(s) for s in encoded["special_tokens_mask"]]
        raw = text.encode()
        for token, (start, stop) in zip(tokens, encoded["offset_mapping"], strict=True):
            if token["special"]:
                assert (token["start"], token["stop"]) == (None, None)
            else:  # UTF-8 byte offsets into the raw text, and that text
                assert raw[token["start"] : token["stop"]].decode() == token["text"] == text[start:stop]


def test_detokenize_and_decode_invert_tokenize(server, reference):
    for text in TEXTS:
        ids = post(server.url, "/tokenize", {"prompt": text})["tokens"]
        assert post(server.url, "/detokenize", {"tokens": ids}) == {"prompt": reference.decode(ids)}
        assert post(server.url, "/decode", {"ids": ids}) == [reference.decode(ids, skip_special_tokens=True)]


def test_the_api_embeds_tokenized_ids_as_it_embeds_the_text(server, runtime):
    ids = [post(server.url, "/tokenize", {"prompt": text})["tokens"] for text in TEXTS]
    assert_close(runtime.embed(ids), runtime.embed(TEXTS))
    vectors = post(server.url, "/v1/embeddings", {"input": ids})["data"]
    assert_close([item["embedding"] for item in vectors], runtime.embed(TEXTS))


def test_a_text_past_max_model_len_is_counted_whole_on_every_surface(server, runtime, folder, reference, tmp_path):
    """vLLM's ``/tokenize`` counts a prompt of any length (``count`` beside ``max_model_len``):
    so do the API, the command line and both ``/tokenize`` bodies; ``truncate_prompt_tokens``
    (the request object's) still cuts, with or without special tokens."""
    from poolrunner.core.frontend.requests import TokenizeRequest

    limit = runtime.model_config.max_model_len
    text = "cat " * (limit + 20)
    want = reference(text)["input_ids"]
    assert len(want) == limit + 22
    assert runtime.tokenize(text) == [want]
    assert cli_records(["tokenize", "--model", str(folder), text], tmp_path / "ids.jsonl") == [
        {"index": 0, "token_ids": want}]
    assert post(server.url, "/tokenize", {"prompt": text}) == {"count": len(want), "max_model_len": limit,
                                                               "tokens": want, "token_strs": None}
    assert [token["id"] for token in post(server.url, "/tokenize", {"inputs": text})[0]] == want
    for special in (True, False):
        cut = runtime.execute(TokenizeRequest.of(texts=[text], truncate_prompt_tokens=5, add_special_tokens=special))
        assert cut == [reference(text, add_special_tokens=special, truncation=True, max_length=5)["input_ids"]]
    with pytest.raises(InvalidRequestError, match="^truncate_prompt_tokens applies to token ids, not to "
                                                  "with_tokens' token strings and spans$"):
        runtime.execute(TokenizeRequest.of(texts=[text], truncate_prompt_tokens=5, with_tokens=True))
    assert runtime.tokenize(TEXTS[0]) == [reference(TEXTS[0])["input_ids"]]  # serving on
