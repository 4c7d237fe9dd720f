"""LLM rerankers and classifiers from token logits (``hf_overrides`` ``classifier_from_token``,
``method``, ``is_original_qwen3_reranker``) and score templates.

The reference is transformers' own causal LM on the formatted prompt: its logits at the last
token, ``sigmoid(l_yes - l_no)`` for the two-way method, ``sigmoid(l_token)`` for one token
(vLLM's cross-encoder activation of a one-label head). Prompts are rendered here from the
Qwen3-Reranker model card's strings, not by poolrunner. The tiny folder is a seeded
``Qwen3ForCausalLM`` with its own byte-level BPE, in which ``yes``, ``no`` and ``Yes`` are
single tokens; SmolLM2 (real weights) is the smoke test.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from poolrunner.core import InvalidRequestError, ModelLoadError, Runtime
from poolrunner.core.cli.main import main
from poolrunner.core.testing.server import ServerThread
from poolrunner.core.testing.tiny_models import qwen2_style_bpe, widen_weights

VOCAB_SIZE = 1200
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                   "is_original_qwen3_reranker": True}
ATOL = 1e-5

# The Qwen3-Reranker model card's prompt (huggingface.co/Qwen/Qwen3-Reranker-0.6B): prefix,
# format_instruction with the default instruction, suffix.
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
BGE_PROMPT = ("Given a query A and a passage B, determine whether the passage contains an answer to the query by "
              "providing a prediction of either 'Yes' or 'No'.")

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Cats sleep a lot.",
             "The Eiffel Tower stands in Paris, the largest city and the capital of France, on the Seine.",
             "No."]
QUERIES = ["Who wrote Hamlet?", "Explain gravity", "What is the capital of France?", "yes or no"]


def qwen3_prompt(query: str, document: str) -> str:
    return f"{QWEN3_PREFIX}<Instruct>: {QWEN3_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}{QWEN3_SUFFIX}"


def bge_prompt(query: str, document: str) -> str:
    return f"A: {query}\nB: {document}\n{BGE_PROMPT}"


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


# --------------------------------------------------------------------------- folders


def _tokenizer():
    """A byte-level BPE with Qwen2's pre-tokenization (transformers rebuilds a ``qwen3`` folder's
    tokenizer as ``Qwen2Tokenizer`` from the vocabulary and merges), trained on the prompts."""
    from transformers import PreTrainedTokenizerFast

    corpus = [qwen3_prompt(q, d) + bge_prompt(q, d) for q in QUERIES for d in DOCUMENTS]
    backend = qwen2_style_bpe(corpus + ["yes\nno\nYes\nNo\n"] * 20, VOCAB_SIZE, SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _save_qwen3(folder: Path, architecture: str, tokenizer, *, tied: bool, seed: int, **config) -> Path:
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    settings = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
                "tie_word_embeddings": tied, "pad_token_id": tokenizer.pad_token_id,
                "eos_token_id": tokenizer.eos_token_id, "architectures": [architecture], **config}
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(transformers.Qwen3Config(**settings)).eval()
    widen_weights(model)  # the default init leaves every prompt scoring about alike
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """``untied``: a Qwen3ForCausalLM with its own LM head; ``tied``: one sharing the embeddings
    (as Qwen3-Reranker-0.6B does); ``converted``: a Qwen3ForSequenceClassification (no LM head)."""
    tokenizer = _tokenizer()
    root = tmp_path_factory.mktemp("llm_reranker")
    return {
        "untied": _save_qwen3(root / "untied", "Qwen3ForCausalLM", tokenizer, tied=False, seed=0),
        "tied": _save_qwen3(root / "tied", "Qwen3ForCausalLM", tokenizer, tied=True, seed=1),
        "converted": _save_qwen3(root / "converted", "Qwen3ForSequenceClassification", tokenizer, tied=False,
                                 seed=2, num_labels=1),
    }


@pytest.fixture(scope="module")
def hf_tokenizer(folders):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folders["untied"], local_files_only=True)
    vocabulary = tokenizer.get_vocab()
    assert all(token in vocabulary for token in ("yes", "no", "Yes")), "the tiny tokenizer must hold them whole"
    return tokenizer


LastLogits = Callable[[Path, Sequence[str]], np.ndarray]


@pytest.fixture(scope="module")
def last_logits(hf_tokenizer) -> LastLogits:
    """``last_logits(folder, prompts)``: transformers' causal LM logits at each prompt's last token
    (each prompt alone, no padding), float64 ``[num_prompts, vocab]``."""
    from transformers import AutoModelForCausalLM

    models: dict[Path, object] = {}

    def compute(folder: Path, prompts: Sequence[str]) -> np.ndarray:
        if folder not in models:
            models[folder] = AutoModelForCausalLM.from_pretrained(
                folder, attn_implementation="eager", dtype=torch.float32, local_files_only=True).eval()
        rows = []
        for prompt in prompts:
            ids = hf_tokenizer(prompt)["input_ids"]
            with torch.inference_mode():
                rows.append(models[folder](input_ids=torch.tensor([ids])).logits[0, -1].double().numpy())
        return np.stack(rows)

    return compute


def token_id(tokenizer, token: str) -> int:
    return tokenizer.convert_tokens_to_ids(token)


def two_way(logits: np.ndarray, tokenizer) -> np.ndarray:
    """``l_yes - l_no`` per row."""
    return logits[:, token_id(tokenizer, "yes")] - logits[:, token_id(tokenizer, "no")]


@pytest.fixture(scope="module")
def qwen3_runtime(folders) -> Runtime:
    """The untied folder with the Qwen3-Reranker overrides; the template is the one the overrides ask for."""
    return Runtime(folders["untied"], dtype="float32", hf_overrides=QWEN3_OVERRIDES, load_entrypoints=False)


def _report(name: str, difference: float) -> None:
    print(f"\n[llm-reranker] {name}: max |poolrunner - transformers| = {difference:.2e}")


# --------------------------------------------------------------------------- the two-way reranker


def test_loaded_as_a_one_label_classifier(qwen3_runtime, hf_tokenizer):
    config = qwen3_runtime.model_config
    assert config.architecture == "Qwen3ForSequenceClassification"
    assert qwen3_runtime.supported_tasks == {"classify"} and qwen3_runtime.task == "classify"
    assert config.labels == ("yes",)
    assert config.token_logits.method == "from_2_way_softmax"
    assert config.token_logits.token_ids == (token_id(hf_tokenizer, "no"), token_id(hf_tokenizer, "yes"))
    assert qwen3_runtime.frontend.score_template.name == "qwen3_reranker"


def test_score_equals_transformers_alone_and_batched(qwen3_runtime, folders, hf_tokenizer, last_logits):
    expected = sigmoid(two_way(last_logits(folders["untied"], [qwen3_prompt(QUERY, d) for d in DOCUMENTS]),
                               hf_tokenizer))
    assert np.diff(np.sort(expected)).min() > 1e-3, expected  # distinct scores: an order float noise cannot flip
    lengths = {len(hf_tokenizer(qwen3_prompt(QUERY, d))["input_ids"]) for d in DOCUMENTS}
    assert len(lengths) == len(DOCUMENTS)  # a batch of different lengths
    batched = qwen3_runtime.score(QUERY, DOCUMENTS)
    alone = np.array([qwen3_runtime.score(QUERY, document) for document in DOCUMENTS])
    np.testing.assert_allclose(batched, expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(alone, expected, atol=ATOL, rtol=0)
    _report("two-way score, batched and alone", float(max(np.abs(batched - expected).max(),
                                                          np.abs(alone - expected).max())))

    pairs = list(zip(QUERIES, DOCUMENTS, strict=True))
    expected_pairs = sigmoid(two_way(last_logits(folders["untied"], [qwen3_prompt(q, d) for q, d in pairs]),
                                     hf_tokenizer))
    np.testing.assert_allclose(qwen3_runtime.score(QUERIES, DOCUMENTS), expected_pairs, atol=ATOL, rtol=0)


def test_raw_logit_and_classify(qwen3_runtime, folders, hf_tokenizer, last_logits):
    prompts = [qwen3_prompt(QUERY, d) for d in DOCUMENTS]
    difference = two_way(last_logits(folders["untied"], prompts), hf_tokenizer)
    np.testing.assert_allclose(qwen3_runtime.score(QUERY, DOCUMENTS, use_activation=False), difference,
                               atol=ATOL, rtol=0)
    # classify takes the prompt itself (no template: that is for pairs)
    results = qwen3_runtime.classify(prompts)
    assert [result.labels for result in results] == [("yes",)] * len(prompts)
    np.testing.assert_allclose([result.probs[0] for result in results], sigmoid(difference), atol=ATOL, rtol=0)


def test_rerank_order(qwen3_runtime, folders, hf_tokenizer, last_logits):
    expected = sigmoid(two_way(last_logits(folders["untied"], [qwen3_prompt(QUERY, d) for d in DOCUMENTS]),
                               hf_tokenizer))
    ranked = qwen3_runtime.rerank(QUERY, DOCUMENTS, top_n=3, return_documents=True)
    order = list(np.argsort(-expected, kind="stable"))[:3]
    assert [hit.index for hit in ranked] == order
    assert [hit.document for hit in ranked] == [DOCUMENTS[i] for i in order]
    np.testing.assert_allclose([hit.score for hit in ranked], expected[order], atol=ATOL, rtol=0)


def test_chunked_prefill_reads_the_last_token(folders, hf_tokenizer, last_logits):
    runtime = Runtime(folders["tied"], dtype="float32", hf_overrides=QWEN3_OVERRIDES, max_num_batched_tokens=24,
                      load_entrypoints=False)
    expected = sigmoid(two_way(last_logits(folders["tied"], [qwen3_prompt(QUERY, d) for d in DOCUMENTS]),
                               hf_tokenizer))
    np.testing.assert_allclose(runtime.score(QUERY, DOCUMENTS), expected, atol=ATOL, rtol=0)


def test_method_defaults_to_two_way_for_two_tokens(folders, hf_tokenizer, last_logits):
    runtime = Runtime(folders["tied"], dtype="float32", hf_overrides={"classifier_from_token": ["no", "yes"]},
                      score_template="qwen3_reranker", load_entrypoints=False)
    assert runtime.model_config.architecture == "Qwen3ForSequenceClassification"
    expected = sigmoid(two_way(last_logits(folders["tied"], [qwen3_prompt(QUERY, d) for d in DOCUMENTS]),
                               hf_tokenizer))
    np.testing.assert_allclose(runtime.score(QUERY, DOCUMENTS), expected, atol=ATOL, rtol=0)


def test_token_logits_without_a_template_score_the_bare_pair_and_say_so(folders, hf_tokenizer, last_logits, caplog):
    """vLLM warns too: an LLM reranker reads the answer its prompt asks for."""
    with caplog.at_level(logging.WARNING, logger="poolrunner.core.inputs.score_template"):
        runtime = Runtime(folders["tied"], dtype="float32", hf_overrides={"classifier_from_token": ["no", "yes"]},
                          load_entrypoints=False)
    assert [r.getMessage() for r in caplog.records if r.name == "poolrunner.core.inputs.score_template"] == [
        f"{runtime.model_config.name} scores from the logits of 2 vocabulary tokens (hf_overrides' "
        "classifier_from_token) with no score template, so each (query, document) pair is tokenized as a bare text "
        "pair; LLM rerankers read their prompt's answer: give --score-template (score_template=) the prompt the "
        "model card gives, or is_original_qwen3_reranker for Qwen3-Reranker"]
    bare = hf_tokenizer.decode(hf_tokenizer(QUERY, DOCUMENTS[0])["input_ids"])
    expected = sigmoid(two_way(last_logits(folders["tied"], [bare]), hf_tokenizer))
    np.testing.assert_allclose(runtime.score(QUERY, DOCUMENTS[0]), expected[0], atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- one token, several tokens


def test_one_token_scores_its_logit(folders, hf_tokenizer, last_logits):
    """bge-reranker-v2-gemma's form: one token, ``no_post_processing``: the score is the sigmoid of
    the token's logit (vLLM's one-label activation), the raw score the logit itself."""
    runtime = Runtime(folders["untied"], dtype="float32", score_template="bge_reranker_v2_gemma",
                      hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                    "classifier_from_token": ["Yes"], "method": "no_post_processing"},
                      load_entrypoints=False)
    assert runtime.model_config.labels == ("Yes",)
    logits = last_logits(folders["untied"], [bge_prompt(QUERY, d) for d in DOCUMENTS])[:, token_id(hf_tokenizer, "Yes")]
    np.testing.assert_allclose(runtime.score(QUERY, DOCUMENTS), sigmoid(logits), atol=ATOL, rtol=0)
    raw = runtime.score(QUERY, DOCUMENTS, use_activation=False)
    np.testing.assert_allclose(raw, logits, atol=ATOL, rtol=0)
    _report("one-token logit", float(np.abs(raw - logits).max()))


def test_several_tokens_are_labels(folders, hf_tokenizer, last_logits):
    tokens = ["no", "yes", "Yes"]
    runtime = Runtime(folders["tied"], dtype="float32", hf_overrides={"classifier_from_token": tokens},
                      load_entrypoints=False)
    assert runtime.model_config.labels == tuple(tokens)
    prompts = [bge_prompt(QUERY, d) for d in DOCUMENTS]
    logits = last_logits(folders["tied"], prompts)[:, [token_id(hf_tokenizer, t) for t in tokens]]
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    np.testing.assert_allclose([r.probs for r in runtime.classify(prompts)], probabilities, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- templates


def test_custom_template_with_vllm_messages(folders, hf_tokenizer, last_logits):
    """A vLLM score template (it reads ``messages`` by role) works unchanged."""
    template = ('A: {{ (messages | selectattr("role", "eq", "query") | first).content }}\n'
                'B: {{ (messages | selectattr("role", "eq", "document") | first).content }}\n' + BGE_PROMPT + "\n")
    runtime = Runtime(folders["untied"], dtype="float32", hf_overrides=QWEN3_OVERRIDES, score_template=template,
                      load_entrypoints=False)
    assert runtime.frontend.score_template.name == "custom"
    expected = sigmoid(two_way(last_logits(folders["untied"], [bge_prompt(QUERY, d) for d in DOCUMENTS]),
                               hf_tokenizer))  # Jinja drops the template's final newline, as transformers does
    np.testing.assert_allclose(runtime.score(QUERY, DOCUMENTS), expected, atol=ATOL, rtol=0)


def test_a_template_error_fails_the_request_only(folders, hf_tokenizer, last_logits):
    template = "{{ raise_exception('an empty query') if not query else query }}\n{{ document }}"
    runtime = Runtime(folders["tied"], dtype="float32", hf_overrides=QWEN3_OVERRIDES, score_template=template,
                      load_entrypoints=False)
    with pytest.raises(InvalidRequestError) as raised:
        runtime.score("", DOCUMENTS)
    assert str(raised.value) == "the score template failed on a (query, document) pair: an empty query"
    expected = sigmoid(two_way(last_logits(folders["tied"], [f"{QUERY}\n{DOCUMENTS[0]}"]), hf_tokenizer))
    np.testing.assert_allclose(runtime.score(QUERY, [DOCUMENTS[0]]), expected, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- refused at load


def _refused(folder: Path, message: str, **options) -> None:
    with pytest.raises(ModelLoadError) as raised:
        Runtime(folder, dtype="float32", load_entrypoints=False, **options)
    assert str(raised.value) == message


def test_refused_at_load_then_a_runtime_loads(folders, hf_tokenizer, last_logits):
    folder = folders["untied"]
    pieces = hf_tokenizer.convert_ids_to_tokens(hf_tokenizer.encode("yes please", add_special_tokens=False))
    assert len(pieces) > 1
    _refused(folder, f"classifier_from_token 'yes please' is not one token of the vocabulary of {folder} "
                     f"(it tokenizes as {pieces!r}); name vocabulary entries exactly",
             hf_overrides={"classifier_from_token": ["no", "yes please"]})
    _refused(folder, "unknown classifier method 'softmax'; known: from_2_way_softmax, no_post_processing",
             hf_overrides={"classifier_from_token": ["no", "yes"], "method": "softmax"})
    _refused(folder, "method 'from_2_way_softmax' takes two classifier_from_token entries, [negative, positive] "
                     '(e.g. ["no", "yes"]), got 3',
             hf_overrides={"classifier_from_token": ["no", "yes", "Yes"], "method": "from_2_way_softmax"})
    _refused(folder, "method 'from_2_way_softmax' (is_original_qwen3_reranker) takes two classifier_from_token "
                     'entries, [negative, positive] (e.g. ["no", "yes"]), got 1',
             hf_overrides={"classifier_from_token": ["yes"], "is_original_qwen3_reranker": True})
    _refused(folder, "is_original_qwen3_reranker means method 'from_2_way_softmax', not 'no_post_processing'; "
                     "drop one of them", hf_overrides={**QWEN3_OVERRIDES, "method": "no_post_processing"})
    _refused(folder, f"{folder}: classifier_from_token must be a non-empty list of vocabulary tokens "
                     "(e.g. [\"no\", \"yes\"]), got None", hf_overrides={"is_original_qwen3_reranker": True})
    _refused(folder, f"{folder} is a causal LM (Qwen3ForCausalLM); hf_overrides make it "
                     "Qwen3ForSequenceClassification without classifier_from_token, so its score head would be "
                     'random. Name the tokens whose logits score, e.g. {"classifier_from_token": ["no", "yes"]}',
             hf_overrides={"architectures": ["Qwen3ForSequenceClassification"]})
    _refused(folders["converted"], f"{folders['converted']}: classifier_from_token reads rows of the causal LM's "
                                   "head, but the weights lack lm_head.weight; a folder already converted to a "
                                   "sequence classifier has no LM head: load it without classifier_from_token",
             hf_overrides={"classifier_from_token": ["no", "yes"]})
    _refused(folder, f"score_template formats (query, document) pairs for a cross-encoder (task 'classify' with "
                     f"one label); model {str(folder)!r} serves 'embed' with 0 labels",
             score_template="qwen3_reranker")
    _refused(folder, "score template 'custom' reads neither {{ query }} and {{ document }} nor messages, so every "
                     "pair would get the same prompt", hf_overrides=QWEN3_OVERRIDES, score_template="{{ bos_token }}")
    _refused(folder, "score template 'custom' is not valid Jinja (line 1): unexpected 'end of print statement'",
             hf_overrides=QWEN3_OVERRIDES, score_template="{{ query + }} {{ document }}")
    with pytest.raises(InvalidRequestError, match=r"^score_template must be a built-in template name \(qwen3_reranker, "
                       r"bge_reranker_v2_gemma\) or Jinja text that uses \{\{ query \}\} and \{\{ document \}\}, "
                       r"got 'qwen3'$"):
        Runtime(folder, score_template="qwen3")
    with pytest.raises(InvalidRequestError, match=r"^hf_overrides must be a JSON object \(a dict with string keys\), "
                       r"got \['no', 'yes'\]$"):
        Runtime(folder, hf_overrides=["no", "yes"])

    runtime = Runtime(folder, dtype="float32", hf_overrides=QWEN3_OVERRIDES, load_entrypoints=False)
    expected = sigmoid(two_way(last_logits(folder, [qwen3_prompt(QUERY, DOCUMENTS[0])]), hf_tokenizer))
    np.testing.assert_allclose(runtime.score(QUERY, [DOCUMENTS[0]]), expected, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- command line and HTTP


def test_cli_rerank_with_overrides_and_template_file(capsys, tmp_path, folders, hf_tokenizer, last_logits):
    template = tmp_path / "bge.jinja"
    template.write_text("A: {{ query }}\nB: {{ document }}\n" + BGE_PROMPT + "\n", encoding="utf-8")
    code = main(["rerank", "--dtype", "float32", "--no-entrypoints", "--model", str(folders["untied"]),
                 "--hf-overrides", json.dumps(QWEN3_OVERRIDES), "--score-template", str(template),
                 "--query", QUERY, *DOCUMENTS])
    out, err = capsys.readouterr()
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    expected = sigmoid(two_way(last_logits(folders["untied"], [bge_prompt(QUERY, d) for d in DOCUMENTS]),
                               hf_tokenizer))
    assert [r["index"] for r in records] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([r["score"] for r in records], np.sort(expected)[::-1], atol=ATOL, rtol=0)

    code = main(["rerank", "--model", str(folders["untied"]), "--hf-overrides", "[1]", "--query", QUERY, "d"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "argument --hf-overrides: expected a JSON object ({...}), got '[1]'" in err


def test_max_tokens_per_doc_keeps_the_template_whole_on_every_surface(capsys, qwen3_runtime, folders, hf_tokenizer,
                                                                      last_logits):
    """A pair past max_model_len is refused advising max_tokens_per_doc (truncate_prompt_tokens would
    cut the template's end, where the answer is read); the command line takes it, and an empty
    document stays empty."""
    from poolrunner.core import PromptTooLongError

    long_document = "word " * qwen3_runtime.model_config.max_model_len
    with pytest.raises(PromptTooLongError) as caught:
        qwen3_runtime.score(QUERY, long_document)
    assert str(caught.value).endswith("; shorten it, or pass max_tokens_per_doc to cut each document to its first "
                                      "tokens")
    with pytest.raises(PromptTooLongError) as caught:  # the query is what is long
        qwen3_runtime.score(long_document, "Paris.", max_tokens_per_doc=5)
    assert str(caught.value).endswith("; shorten the query, or lower max_tokens_per_doc (now 5)")
    documents = [long_document, "", "Paris."]
    cut = [hf_tokenizer.decode(hf_tokenizer(d, add_special_tokens=False)["input_ids"][:5]) for d in documents]
    assert cut[1:] == documents[1:]
    expected = sigmoid(two_way(last_logits(folders["untied"], [qwen3_prompt(QUERY, d) for d in cut]), hf_tokenizer))
    np.testing.assert_allclose(qwen3_runtime.score(QUERY, documents, max_tokens_per_doc=5), expected, atol=ATOL,
                               rtol=0)
    code = main(["score", "--dtype", "float32", "--no-entrypoints", "--model", str(folders["untied"]), "--hf-overrides",
                 json.dumps(QWEN3_OVERRIDES), "--max-tokens-per-doc", "5", "--query", QUERY, *documents])
    out, err = capsys.readouterr()
    assert code == 0, err
    np.testing.assert_allclose([json.loads(line)["score"] for line in out.splitlines()], expected, atol=ATOL, rtol=0)


def test_flags_and_serve_variables_build_the_config(monkeypatch, tmp_path):
    from poolrunner.core.cli.common import runtime_options
    from poolrunner.core.cli.main import build_parser

    template = tmp_path / "t.jinja"
    template.write_text("Q: {{ query }} D: {{ document }}\n", encoding="utf-8")
    args = build_parser().parse_args(["rerank", "--model", "m", "--hf-overrides", json.dumps(QWEN3_OVERRIDES),
                                      "--score-template", str(template), "--query", "q", "d"])
    options = runtime_options(args)
    assert options["hf_overrides"] == QWEN3_OVERRIDES
    assert options["score_template"] == "Q: {{ query }} D: {{ document }}\n"  # the file's text
    monkeypatch.setenv("POOLRUNNER_HF_OVERRIDES", json.dumps(QWEN3_OVERRIDES))
    monkeypatch.setenv("POOLRUNNER_SCORE_TEMPLATE", "qwen3_reranker")
    options = runtime_options(build_parser().parse_args(["serve", "--model", "m"]))
    assert (options["hf_overrides"], options["score_template"]) == (QWEN3_OVERRIDES, "qwen3_reranker")


def test_http_rerank_applies_the_template(qwen3_runtime, folders, hf_tokenizer, last_logits):
    expected = sigmoid(two_way(last_logits(folders["untied"], [qwen3_prompt(QUERY, d) for d in DOCUMENTS]),
                               hf_tokenizer))
    with ServerThread(qwen3_runtime) as server:
        answer = httpx.post(f"{server.url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60)
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        score = httpx.post(f"{server.url}/score", json={"queries": QUERY, "documents": DOCUMENTS}, timeout=60)
        assert score.status_code == 200, score.text
    assert [item["index"] for item in results] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([item["relevance_score"] for item in results], np.sort(expected)[::-1],
                               atol=ATOL, rtol=0)
    np.testing.assert_allclose([item["score"] for item in score.json()["data"]], expected, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- real weights


@pytest.mark.slow
def test_smollm2_as_a_reranker():
    """SmolLM2-135M-Instruct (a LlamaForCausalLM, tied embeddings) as a yes/no reranker with the
    Qwen3-Reranker prompt: poolrunner's scores equal transformers' last-token logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.models.smollm2 import smollm2_folder

    folder = smollm2_folder()
    runtime = Runtime(folder, dtype="float32", hf_overrides={"classifier_from_token": ["no", "yes"]},
                      score_template="qwen3_reranker", load_entrypoints=False)
    assert runtime.model_config.architecture == "LlamaForSequenceClassification"
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    expected = []
    for document in DOCUMENTS:
        ids = tokenizer(qwen3_prompt(QUERY, document))["input_ids"]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
        expected.append(float(logits[yes] - logits[no]))
    expected = sigmoid(np.array(expected))
    scores = runtime.score(QUERY, DOCUMENTS)
    _report("SmolLM2 two-way score", float(np.abs(scores - expected).max()))
    np.testing.assert_allclose(scores, expected, atol=ATOL, rtol=0)
    assert runtime.rerank(QUERY, DOCUMENTS)[0].index == int(np.argmax(expected))
