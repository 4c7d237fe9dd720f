"""sentence-transformers' conveniences on a Runtime: ``similarity`` (each function),
``similarity_pairwise``, ``encode_query`` / ``encode_document`` with the model's prompts, and
``score``'s shapes, a flat token-id list as one input. References: sentence-transformers on the
same folders."""

from __future__ import annotations

import numpy as np
import pytest

import poolrunner
from poolrunner import InvalidRequestError, ModelLoadError
from tests.helpers import MIN_COSINE, cosine_rows
from tests.test_st_metadata import MEAN, POOLING, SBERT_256, TRANSFORMER, load_st

QUERIES = ["Where do cats sleep?", "How hot is the sun?"]
DOCUMENTS = ["Cats sleep in warm, quiet places.", "The sun's surface is about 5,500 degrees Celsius.",
             "Guitars have six strings."]


@pytest.mark.parametrize("fn", ["cosine", "dot", "euclidean", "manhattan"])
def test_similarity_matches_sentence_transformers(runtime, st_model, fn, monkeypatch):
    monkeypatch.setattr(st_model, "similarity_fn_name", fn)  # the session's model: restored afterwards
    left, right = runtime.embed(QUERIES), runtime.embed(DOCUMENTS)
    expected = st_model.similarity(left, right).numpy()
    got = runtime.similarity(left, right, similarity_fn_name=fn)
    assert got.shape == (2, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    pairwise = runtime.similarity_pairwise(left, right[:2], similarity_fn_name=fn)
    np.testing.assert_allclose(pairwise, st_model.similarity_pairwise(left, right[:2]).numpy(), rtol=1e-5, atol=1e-6)


def test_similarity_uses_the_model_function_and_refuses_bad_input(runtime):
    vectors = runtime.embed(QUERIES)
    assert runtime.model_config.similarity_fn_name == "cosine"
    np.testing.assert_allclose(runtime.similarity(vectors[0], vectors), [runtime.similarity(vectors, vectors)[0]])
    with pytest.raises(InvalidRequestError) as caught:
        runtime.similarity(vectors, vectors, similarity_fn_name="jaccard")
    assert str(caught.value) == "similarity_fn_name must be one of ['cosine', 'dot', 'euclidean', 'manhattan'], " \
                                "got 'jaccard'"
    with pytest.raises(InvalidRequestError) as caught:
        runtime.similarity(vectors, vectors[:, :10])
    assert str(caught.value) == ("similarity needs [n, d] and [m, d] embeddings of one width, got shapes "
                                 "[2, 384] and [2, 10]")
    with pytest.raises(InvalidRequestError) as caught:
        runtime.similarity_pairwise(vectors, vectors[:1])
    assert str(caught.value) == "pairwise similarity needs as many rows on each side, got 2 and 1"


def test_score_shapes(runtime, st_model):
    single = runtime.score(QUERIES[0], DOCUMENTS[0])
    assert isinstance(single, np.float32)
    expected = st_model.similarity(st_model.encode([QUERIES[0]]), st_model.encode([DOCUMENTS[0]])).item()
    assert single == pytest.approx(expected, abs=1e-5)
    assert runtime.score(QUERIES[0], DOCUMENTS[:1]).shape == (1,)
    empty = runtime.score([], [])
    assert empty.shape == (0,) and empty.dtype == np.float32
    with pytest.raises(InvalidRequestError, match=r"^documents is empty: scoring needs at least one of each$"):
        runtime.score(QUERIES, [])
    assert runtime.score(QUERIES[0], DOCUMENTS[0]) == single  # still serves


@pytest.fixture(scope="module")
def prompted(make_minilm_folder):
    def make(name: str, st_config: dict) -> str:
        return make_minilm_folder(name, modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize")], pooling=MEAN,
                                  sbert_config=SBERT_256, st_config=st_config)

    return make


@pytest.mark.parametrize("config", [
    {"prompts": {"query": "query: ", "passage": "passage: "}},
    {"prompts": {"query": "q: ", "document": "d: ", "passage": "p: "}},
    {"prompts": {"corpus": "c: ", "passage": "p: "}, "default_prompt_name": "passage"},
    {},
])
def test_encode_query_and_document_use_the_model_prompts(prompted, config):
    folder = prompted(f"prompts-{'-'.join(config.get('prompts', {})) or 'none'}", config)
    runtime, st = poolrunner.Runtime(folder, dtype="float32"), load_st(folder)
    queries, documents = runtime.encode_query(QUERIES), runtime.encode_document(DOCUMENTS)
    assert cosine_rows(queries, st.encode_query(QUERIES)).min() >= MIN_COSINE
    assert cosine_rows(documents, st.encode_document(DOCUMENTS)).min() >= MIN_COSINE
    # A prompt the caller names wins, as in sentence-transformers.
    literal = runtime.encode_query(QUERIES, prompt="custom: ")
    assert cosine_rows(literal, st.encode_query(QUERIES, prompt="custom: ")).min() >= MIN_COSINE


def test_a_folder_with_an_unknown_similarity_function_is_refused(prompted):
    folder = prompted("bad-similarity", {"similarity_fn_name": "jaccard"})
    with pytest.raises(ModelLoadError, match=r"similarity_fn_name 'jaccard' is not one of \['cosine', 'dot', "):
        poolrunner.Runtime(folder, dtype="float32")


def test_a_folder_similarity_function_is_the_default(prompted):
    folder = prompted("dot-similarity", {"similarity_fn_name": "dot"})
    runtime, st = poolrunner.Runtime(folder, dtype="float32"), load_st(folder)
    assert runtime.model_config.similarity_fn_name == "dot"
    vectors = runtime.embed(QUERIES)
    np.testing.assert_allclose(runtime.similarity(vectors, vectors), st.similarity(vectors, vectors).numpy(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", ["dot", "manhattan"])
def test_score_and_rerank_use_the_folder_similarity_function(make_minilm_folder, fn):
    """A bi-encoder scores pairs as sentence-transformers' ``model.similarity`` does, with the
    folder's function; without a Normalize module dot products and distances are not the cosine,
    and rank documents otherwise."""
    folder = make_minilm_folder(f"unnormalized-{fn}", modules=[TRANSFORMER, POOLING], pooling=MEAN,
                                sbert_config=SBERT_256, st_config={"similarity_fn_name": fn})
    runtime, st = poolrunner.Runtime(folder, dtype="float32"), load_st(folder)
    queries, documents = st.encode([QUERIES[0]] * len(DOCUMENTS)), st.encode(DOCUMENTS)
    expected = st.similarity_pairwise(queries, documents).numpy()
    np.testing.assert_allclose(runtime.score(QUERIES[0], DOCUMENTS), expected, rtol=1e-4, atol=1e-4)
    ranked = runtime.rerank(QUERIES[0], DOCUMENTS)
    assert [result.index for result in ranked] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([result.score for result in ranked], np.sort(expected)[::-1], rtol=1e-4, atol=1e-4)


def test_a_flat_token_id_list_is_one_input(runtime, st_model):
    """As the HTTP routes read it (and vLLM's prompt_token_ids): one input, not one input per id."""
    ids = list(runtime.inputs.encode([QUERIES[0]])[0])
    vector = runtime.embed(ids)
    assert vector.shape == (384,)
    assert cosine_rows(vector[None], st_model.encode([QUERIES[0]])).min() >= MIN_COSINE
    assert len(runtime.encode(ids)) == 1 and runtime.embed([ids, ids]).shape == (2, 384)
    assert runtime.embed(tuple(np.array(ids))).shape == (384,)  # numpy integers too


def test_encode_query_on_a_cross_encoder_is_refused_as_embed_is(minilm_classifier_folder, classifier_runtime):
    """A cross-encoder embeds nothing (sentence-transformers' CrossEncoder has no encode_query):
    refused with embed's error, not answered with one text's score."""
    runtime = classifier_runtime(minilm_classifier_folder(1))
    for call in (runtime.encode_query, runtime.encode_document):
        with pytest.raises(InvalidRequestError) as by_role:
            call(["a query"])
        with pytest.raises(InvalidRequestError) as plain:
            runtime.embed(["a query"])
        assert str(by_role.value) == str(plain.value)
    assert runtime.score("a query", ["a document"]).shape == (1,)
