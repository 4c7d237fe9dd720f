"""The request objects (``poolrunner.core.frontend.requests``): each field checked once, with one
message on every road to it, and the runtime answering a request object as it answers the
method that builds it."""

from __future__ import annotations

import numpy as np
import pytest

from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.frontend.requests import (
    REQUEST_FIELDS,
    ClassifyRequest,
    EncodeRequest,
    RerankRequest,
    ScoreRequest,
    Tokenization,
    TokenizeRequest,
)
from poolrunner.core.plugin_api.options import RequestOption


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Tokenization(truncation_side="middle"), "truncation_side must be 'left' or 'right', got 'middle'"),
    (lambda: Tokenization(truncate_prompt_tokens=2.5), "truncate_prompt_tokens must be an integer, got 2.5"),
    (lambda: Tokenization(truncate_prompt_tokens=True), "truncate_prompt_tokens must be an integer, got True"),
    (lambda: Tokenization(prompt="q: ", prompt_name="query"), "pass either prompt or prompt_name, not both"),
    (lambda: Tokenization(add_special_tokens="no"), "add_special_tokens must be true or false, got 'no'"),
    (lambda: RerankRequest(query="q", documents=["d"], top_n=0), "top_n must be a positive integer, got 0"),
    (lambda: RerankRequest(query="q", documents="d"), "documents must be a list of strings, not one string"),
    (lambda: RerankRequest(query=3, documents=["d"]), "query must be a string, got 3"),
    (lambda: ScoreRequest(queries="q", documents="d", max_tokens_per_doc=0),
     "max_tokens_per_doc must be a positive integer, got 0"),
    (lambda: EncodeRequest(inputs=["a"], precision="int4"), "precision must be one of "),
    (lambda: EncodeRequest(inputs=["a"], ranges=[[0.0], [1.0]]), "ranges applies to precision int8 or uint8"),
    (lambda: ClassifyRequest.of(inputs=["a"], top_k=3), "unknown request field 'top_k'"),
])
def test_a_field_is_checked_where_it_is_defined(make, message):
    with pytest.raises(InvalidRequestError) as caught:
        make()
    assert str(caught.value).startswith(message)


def test_of_sorts_flat_keywords_into_fields_tokenization_and_plugin_options():
    request = EncodeRequest.of(inputs="one text", task="sparse_embed", top_k=5, truncate_prompt_tokens=8,
                               prompt_name="query")
    assert request.inputs == ("one text",)  # one input is one input, not its characters
    assert request.options == {"top_k": 5}
    assert request.tokenization == Tokenization(truncate_prompt_tokens=8, prompt_name="query")
    assert EncodeRequest.of(inputs=[("a", "b")]).inputs == (("a", "b"),)
    assert "inputs" not in EncodeRequest.field_names() and "truncate_prompt_tokens" in EncodeRequest.field_names()


def test_a_changed_request_keeps_its_inputs():
    """``attrs.evolve`` (a server's ``model: ADAPTER`` sets ``tokenization.lora`` so) converts the
    inputs again: two texts must stay two inputs, not become one (text, text_pair)."""
    import attrs

    two = EncodeRequest.of(inputs=["a", "b"], task="embed")
    changed = attrs.evolve(two, tokenization=attrs.evolve(two.tokenization, lora="x"))
    assert list(changed.inputs) == ["a", "b"]
    assert EncodeRequest.of(inputs=("a", "b")).inputs == (("a", "b"),)  # a tuple given is still one pair


def test_no_plugin_option_may_take_a_request_fields_name():
    assert {"top_n", "max_tokens_per_doc", "truncate_prompt_tokens", "precision", "queries"} <= REQUEST_FIELDS
    for name in ("top_n", "max_tokens_per_doc", "with_tokens"):
        with pytest.raises(ValueError, match=f"request option '{name}' would shadow a core request field"):
            RequestOption(name=name, type=int, tasks={"embed"}, help="h")


def test_the_runtime_answers_a_request_object_as_the_method_that_builds_it(runtime, assert_serves):
    texts = ["A cat sat on the mat.", "A dog ran in the park."]
    np.testing.assert_array_equal(np.stack(runtime.execute(EncodeRequest(inputs=texts, task="embed"))),
                                  runtime.embed(texts))
    ranked = runtime.execute(RerankRequest(query="a cat", documents=texts, top_n=1))
    assert ranked == runtime.rerank("a cat", texts, top_n=1)
    assert runtime.execute(TokenizeRequest(texts=texts)) == runtime.tokenize(texts)
    with pytest.raises(InvalidRequestError, match="^unknown option 'top_k' for task 'embed'"):
        runtime.execute(EncodeRequest.of(inputs=texts, top_k=3))
    with pytest.raises(InvalidRequestError, match="^precision=binary applies to task 'embed', not 'token_embed'$"):
        runtime.execute(EncodeRequest(inputs=texts, task="token_embed", precision="binary"))
    assert_serves(runtime)


def test_max_tokens_per_doc_on_the_api_scores_the_documents_first_tokens(runtime, hf_tokenizer):
    documents = ["The quick brown fox jumps over the lazy dog near the river bank.", "Cats sleep."]
    cut = [hf_tokenizer.decode(hf_tokenizer(d, add_special_tokens=False)["input_ids"][:3]) for d in documents]
    np.testing.assert_allclose(runtime.score("a fox", documents, max_tokens_per_doc=3),
                               runtime.score("a fox", cut), atol=1e-6)
    ranked = runtime.rerank("a fox", documents, max_tokens_per_doc=3, return_documents=True)
    assert sorted(result.document for result in ranked) == sorted(documents)  # whole documents come back
