"""sentence-transformers folder layouts: poolrunner reads them as sentence-transformers runs them.

Folders are built in tmp from the MiniLM files with one variation each; the reference is
``SentenceTransformer(folder).encode`` on the same folder (loaded offline), or transformers
for a plain Hugging Face folder (which sentence-transformers would pool differently).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

import poolrunner
from poolrunner import InvalidRequestError, ModelLoadError
from tests.helpers import MIN_COSINE, cosine_rows

TRANSFORMER = ("Transformer", "")
POOLING = ("Pooling", "1_Pooling")
MEAN = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}
SBERT_256 = {"max_seq_length": 256, "do_lower_case": False}


def load_st(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def texts(lee_docs) -> list[str]:
    return [lee_docs[2], "Short text.", lee_docs[17], "What is the capital of Australia?"]


def assert_matches_st(folder, texts, *, exact: bool = False, **embed_kwargs):
    rt = poolrunner.Runtime(folder, dtype="float32")
    st = load_st(folder)
    vectors = rt.embed(texts, **embed_kwargs)
    reference = st.encode(texts, convert_to_numpy=True)
    assert vectors.shape == reference.shape
    assert cosine_rows(vectors, reference).min() >= MIN_COSINE
    if exact:
        np.testing.assert_allclose(vectors, reference, rtol=1e-4, atol=1e-5)
    return rt, vectors


# --------------------------------------------------------------------------- plain HF folder


def test_plain_hf_folder_defaults_to_cls_normalized(make_minilm_folder, hf_tokenizer, hf_hidden, texts,
                                                     text_with_tokens):
    folder = make_minilm_folder("plain")
    rt = poolrunner.Runtime(folder, dtype="float32")
    config = rt.model_config
    assert (config.pooling_type, config.normalize, config.max_model_len) == ("CLS", True, 512)
    assert config.dense_layers == () and config.embedding_size == 384
    long_text = text_with_tokens(400, seed=21)  # beyond the default model's 256, within 512
    batch = [*texts, long_text]
    ids = [list(row) for row in hf_tokenizer(batch)["input_ids"]]
    states, _ = hf_hidden(ids)
    reference = states[:, 0].double().numpy()
    vectors = rt.embed(batch)
    assert cosine_rows(vectors, reference).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    with pytest.raises(InvalidRequestError, match=r"^input 0 has 513 tokens, more than the maximum of 512 "):
        rt.embed(text_with_tokens(513, seed=22))
    assert cosine_rows(rt.embed(texts[:1]), reference[:1])[0] >= MIN_COSINE


# --------------------------------------------------------------------------- pooling modes


def test_cls_pooling_module(make_minilm_folder, texts):
    folder = make_minilm_folder("cls", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize")],
                                pooling={"pooling_mode": "cls"}, sbert_config=SBERT_256)
    rt, vectors = assert_matches_st(folder, texts)
    assert (rt.model_config.pooling_type, rt.model_config.normalize) == ("CLS", True)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_lasttoken_pooling_module(make_minilm_folder, texts):
    folder = make_minilm_folder("lasttoken", modules=[TRANSFORMER, POOLING],
                                pooling={"pooling_mode_lasttoken": True}, sbert_config=SBERT_256)
    rt, _ = assert_matches_st(folder, texts, exact=True)
    assert (rt.model_config.pooling_type, rt.model_config.normalize) == ("LAST", False)


def test_include_prompt_false_is_refused(make_minilm_folder):
    folder = make_minilm_folder("noprompt", modules=[TRANSFORMER, POOLING],
                                pooling={"pooling_mode": "mean", "include_prompt": False})
    with pytest.raises(ModelLoadError, match=r"1_Pooling/config\.json: include_prompt=false is not supported$"):
        poolrunner.Runtime(folder, dtype="float32")


def test_unsupported_module_type(make_minilm_folder):
    folder = make_minilm_folder("layernorm", modules=[TRANSFORMER, POOLING, ("LayerNorm", "2_LayerNorm")],
                                pooling=MEAN)
    with pytest.raises(ModelLoadError,
                       match=r"sentence-transformers module 'sentence_transformers\.models\.LayerNorm' is not "
                             r"supported \(supported: Transformer, Pooling, Dense, Normalize\)$"):
        poolrunner.Runtime(folder, dtype="float32")


# --------------------------------------------------------------------------- Dense and Normalize


def test_dense_then_normalize(make_minilm_folder, texts):
    folder = make_minilm_folder(
        "dense_norm", modules=[TRANSFORMER, POOLING, ("Dense", "2_Dense"), ("Normalize", "3_Normalize")],
        pooling=MEAN, dense={"out_features": 128, "seed": 1}, sbert_config=SBERT_256,
    )
    rt, vectors = assert_matches_st(folder, texts, exact=True)
    config = rt.model_config
    assert (config.embedding_size, config.hidden_size, config.normalize) == (128, 384, True)
    assert [(d.in_features, d.out_features, d.activation) for d in config.dense_layers] == [(384, 128, "Tanh")]
    assert vectors.shape == (len(texts), 128)


def test_dense_without_normalize(make_minilm_folder, texts):
    folder = make_minilm_folder(
        "dense_raw", modules=[TRANSFORMER, POOLING, ("Dense", "2_Dense")], pooling=MEAN,
        dense={"out_features": 96, "seed": 2, "activation": "torch.nn.modules.linear.Identity", "bias": False},
        sbert_config=SBERT_256,
    )
    rt, vectors = assert_matches_st(folder, texts, exact=True)
    assert rt.model_config.normalize is False
    assert not np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    # Matryoshka slicing applies after the Dense projection.
    sliced = poolrunner.Runtime(folder, is_matryoshka=True, dtype="float32").embed(texts, dimensions=32, normalize=True)
    np.testing.assert_allclose(sliced, vectors[:, :32] / np.linalg.norm(vectors[:, :32], axis=1, keepdims=True),
                               atol=1e-5)


def test_normalize_module_decides_the_default(make_minilm_folder, texts, st_model):
    without = make_minilm_folder("mean_raw", modules=[TRANSFORMER, POOLING], pooling=MEAN, sbert_config=SBERT_256)
    rt, raw = assert_matches_st(without, texts, exact=True)
    assert rt.model_config.normalize is False
    norms = np.linalg.norm(raw, axis=1)
    assert norms.min() > 1.5  # clearly unnormalized MiniLM means
    # The per-request switch gives the normalized pipeline's output.
    normed = rt.embed(texts, normalize=True)
    np.testing.assert_allclose(normed, st_model.encode(texts), atol=2e-5)
    # And the override at load time flips the default.
    assert poolrunner.Runtime(without, normalize=True, dtype="float32").model_config.normalize is True


@pytest.mark.parametrize("activation", ["os.system", "builtins.eval", "mypackage.nn.Tanh"])
def test_untrusted_activation_path(make_minilm_folder, activation):
    folder = make_minilm_folder("evil", modules=[TRANSFORMER, POOLING, ("Dense", "2_Dense")], pooling=MEAN,
                                dense={"out_features": 16, "activation": activation})
    with pytest.raises(ModelLoadError,
                       match=rf"2_Dense: Dense activation '{activation}' is not a torch\.nn class; "
                             r"refusing to load it$"):
        poolrunner.Runtime(folder, dtype="float32")


def test_activation_that_is_not_a_module_class(make_minilm_folder):
    folder = make_minilm_folder("fn_act", modules=[TRANSFORMER, POOLING, ("Dense", "2_Dense")], pooling=MEAN,
                                dense={"out_features": 16, "activation": "torch.nn.functional.relu"})
    with pytest.raises(ModelLoadError, match=r"2_Dense: activation 'relu' is not a torch\.nn module$"):
        poolrunner.Runtime(folder, dtype="float32")


def test_dense_after_normalize_is_refused(make_minilm_folder):
    # sentence-transformers would project the normalized vector; poolrunner normalizes last.
    folder = make_minilm_folder(
        "norm_dense", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize"), ("Dense", "3_Dense")],
        pooling=MEAN, dense={"out_features": 64, "path": "3_Dense"},
    )
    with pytest.raises(ModelLoadError, match=r"a Dense module after Normalize is not supported"):
        poolrunner.Runtime(folder, dtype="float32")


# --------------------------------------------------------------------------- lengths and prompts


def test_max_seq_length_caps_max_model_len(make_minilm_folder, lee_long_docs, text_with_tokens):
    folder = make_minilm_folder("len128", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize")],
                                pooling=MEAN, sbert_config={"max_seq_length": 128})
    rt = poolrunner.Runtime(folder, dtype="float32")
    assert rt.model_config.max_model_len == 128
    with pytest.raises(InvalidRequestError, match=r"^input 0 has 129 tokens, more than the maximum of 128 "):
        rt.embed(text_with_tokens(129, seed=31))
    st = load_st(folder)
    assert st.max_seq_length == 128
    texts = [lee_long_docs[1], "short"]
    vectors = rt.embed(texts, truncate_prompt_tokens=-1)
    assert cosine_rows(vectors, st.encode(texts)).min() >= MIN_COSINE


def test_prompts_from_the_config(make_minilm_folder, texts):
    folder = make_minilm_folder(
        "prompts", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize")], pooling=MEAN,
        sbert_config=SBERT_256,
        st_config={"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"},
    )
    rt = poolrunner.Runtime(folder, dtype="float32")
    assert dict(rt.model_config.prompts) == {"query": "query: ", "passage": "passage: "}
    assert rt.model_config.default_prompt_name == "query"
    st = load_st(folder)
    default = rt.embed(texts)
    assert cosine_rows(default, st.encode(texts)).min() >= MIN_COSINE
    assert cosine_rows(default, st.encode(texts, prompt_name="query")).min() >= MIN_COSINE
    passage = rt.embed(texts, prompt_name="passage")
    assert cosine_rows(passage, st.encode(texts, prompt_name="passage")).min() >= MIN_COSINE
    literal = rt.embed(texts, prompt="custom: ")
    assert cosine_rows(literal, st.encode(texts, prompt="custom: ")).min() >= MIN_COSINE
    assert cosine_rows(passage, default).max() < 0.9999  # the prompts really differ
    with pytest.raises(InvalidRequestError,
                       match=r"^prompt_name 'doc' is not defined by model .*; defined: \['passage', 'query'\]$"):
        rt.embed(texts, prompt_name="doc")
    assert cosine_rows(rt.embed(texts), default).min() >= MIN_COSINE


def test_unknown_default_prompt_name_is_refused_at_load(make_minilm_folder):
    folder = make_minilm_folder("bad_default", modules=[TRANSFORMER, POOLING], pooling=MEAN,
                                st_config={"prompts": {"query": "q: "}, "default_prompt_name": "passage"})
    with pytest.raises(ModelLoadError, match=r"default_prompt_name 'passage'.*\['query'\]"):
        poolrunner.Runtime(folder, dtype="float32")


# --------------------------------------------------------------------------- saved by sentence-transformers


def test_folder_saved_by_sentence_transformers(st_model, tmp_path, texts):
    # The installed sentence-transformers writes its current module paths into modules.json
    # (e.g. sentence_transformers.base.modules.dense.Dense), not sentence_transformers.models.*.
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize

    torch.manual_seed(5)
    dense = Dense(384, 48, activation_function=torch.nn.Tanh())
    built = SentenceTransformer(modules=[st_model[0], st_model[1], dense, Normalize()], device="cpu")
    built.save(str(tmp_path / "saved"))
    rt, vectors = assert_matches_st(tmp_path / "saved", texts, exact=True)
    assert rt.model_config.embedding_size == 48 and rt.model_config.max_model_len == 256
    assert vectors.shape == (len(texts), 48)


# --------------------------------------------------------------------------- do_lower_case


def make_cased(folder: Path) -> Path:
    """Turn the folder's (uncased) MiniLM tokenizer into a cased one: its normalizer keeps case,
    so "Hello" is not "hello" (it becomes [UNK]) unless sentence-transformers' do_lower_case acts."""
    for name, edit in (("tokenizer.json", lambda data: data["normalizer"].update(lowercase=False)),
                       ("tokenizer_config.json", lambda data: data.update(do_lower_case=False))):
        data = json.loads((folder / name).read_text(encoding="utf-8"))
        edit(data)
        (folder / name).write_text(json.dumps(data), encoding="utf-8")
    return folder


def test_do_lower_case_lowercases_text_and_prompt(make_minilm_folder, texts):
    from transformers import AutoTokenizer

    folder = make_cased(make_minilm_folder(
        "lower_case", modules=[TRANSFORMER, POOLING, ("Normalize", "2_Normalize")], pooling=MEAN,
        sbert_config={"max_seq_length": 256, "do_lower_case": True},
    ))
    cased = AutoTokenizer.from_pretrained(folder)
    assert cased("Hello World")["input_ids"] != cased("hello world")["input_ids"]  # the tokenizer keeps case
    rt = poolrunner.Runtime(folder, dtype="float32")
    assert rt.model_config.lowercase is True
    st = load_st(folder)
    batch = ["Hello World", *texts]
    assert cosine_rows(rt.embed(batch), st.encode(batch)).min() >= MIN_COSINE
    # The prompt is lowercased with the text, as sentence-transformers tokenizes prompt + text.
    assert cosine_rows(rt.embed(batch, prompt="Query: "), st.encode(batch, prompt="Query: ")).min() >= MIN_COSINE
    # Token ids are taken as given.
    ids = cased("Hello World")["input_ids"]
    assert rt.inputs.encode([ids, "Hello World"]) == [tuple(ids), tuple(cased("hello world")["input_ids"])]


def test_do_lower_case_applies_to_both_texts_of_a_cross_encoder_pair(minilm_classifier_folder, tmp_path):
    from sentence_transformers import CrossEncoder

    folder = tmp_path / "cross_encoder"
    CrossEncoder(str(minilm_classifier_folder(1)), device="cpu").save_pretrained(str(folder))
    config_file = folder / "sentence_bert_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "do_lower_case": True}))
    make_cased(folder)
    queries = ["Who Wrote Hamlet?", "What is the Capital of France?"]
    documents = ["Hamlet was written by William Shakespeare.", "Paris Is The Capital."]
    reference = CrossEncoder(str(folder), device="cpu").predict(list(zip(queries, documents, strict=True)))
    np.testing.assert_allclose(poolrunner.Runtime(folder, dtype="float32").score(queries, documents), reference,
                               rtol=1e-4)


# --------------------------------------------------------------------------- every key sentence-transformers reads

TANH = "torch.nn.modules.activation.Tanh"
DENSE_64 = {"in_features": 384, "out_features": 64, "bias": True, "activation_function": TANH}
FEATURES = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}


def entries(*modules: tuple[str, str]) -> list[dict]:
    return [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
            for i, (kind, path) in enumerate(modules)]


PIPELINE = entries(TRANSFORMER, POOLING, ("Dense", "2_Dense"), ("Normalize", "3_Normalize"))


def sweep_folder(make_minilm_folder, files: dict[str, object]) -> Path:
    """MiniLM with Transformer, mean Pooling, a seeded Dense (384 -> 64) and Normalize, the
    sentence_bert_config.json of the default model, then ``files`` (path -> JSON) written over."""
    folder = make_minilm_folder("sweep", modules=[TRANSFORMER, POOLING, ("Dense", "2_Dense"),
                                                  ("Normalize", "3_Normalize")],
                                pooling=MEAN, dense={"out_features": 64, "seed": 3}, sbert_config=SBERT_256)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(data), encoding="utf-8")
    return folder


def test_max_seq_length_replaces_the_tokenizer_limit(make_minilm_folder, text_with_tokens):
    # sentence-transformers hands max_seq_length to the tokenizer as its model_max_length, over the
    # tokenizer's own (128 here): inputs up to 300 tokens are read whole.
    folder = make_minilm_folder("len300", modules=[TRANSFORMER, POOLING], pooling=MEAN,
                                sbert_config={"max_seq_length": 300})
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "model_max_length": 128}))
    # A legacy name of the file is read when sentence_bert_config.json holds no setting.
    legacy = make_minilm_folder("legacy_name", modules=[TRANSFORMER, POOLING], pooling=MEAN, sbert_config={})
    (legacy / "sentence_roberta_config.json").write_text(json.dumps({"max_seq_length": 100}))
    rt = poolrunner.Runtime(folder, dtype="float32")
    st = load_st(folder)
    assert rt.model_config.max_model_len == st.max_seq_length == 300
    text = text_with_tokens(290, seed=41)
    assert cosine_rows(rt.embed([text]), st.encode([text])).min() >= MIN_COSINE
    assert poolrunner.Runtime(legacy, dtype="float32").model_config.max_model_len == load_st(legacy).max_seq_length


INERT_FILES = {  # every inert key, and the honoured keys at the values poolrunner runs, in one folder
    "modules.json": [{**entry, "idx": 9 - entry["idx"], "kwargs": ["task"], "comment": "unread"} for entry in PIPELINE],
    "sentence_bert_config.json": {
        **SBERT_256, "transformer_task": "feature-extraction", "modality_config": FEATURES,
        "module_output_name": "token_embeddings", "backend": "onnx", "unpad_inputs": True, "cache_dir": "/nowhere",
        "model_args": {"trust_remote_code": True}, "model_kwargs": {"revision": "v2"},
        "tokenizer_args": {"trust_remote_code": True}, "processor_kwargs": {"cache_dir": "/nowhere"},
        "config_args": {"local_files_only": False}, "config_kwargs": {}, "processing_kwargs": {},
        "query_length": None, "document_length": None, "query_expansion": None, "tokenizer_name_or_path": None,
    },
    "config_sentence_transformers.json": {
        "__version__": {"sentence_transformers": "99.0.0"}, "requirements": {"transformers": ">=4"},
        "model_type": "SentenceTransformer", "keep_in_fp32_modules": [], "truncate_dim": None,
        "similarity_fn_name": "cosine", "unread": 1,
    },
    "2_Dense/config.json": {**DENSE_64, "module_input_name": "sentence_embedding", "module_output_name": None,
                            "use_residual": False, "unread": 1},
    "3_Normalize/config.json": {"module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding",
                                "unread": 1},
}


def test_inert_and_default_keys_match_sentence_transformers(make_minilm_folder, texts):
    assert_matches_st(sweep_folder(make_minilm_folder, INERT_FILES), texts, exact=True)


def st_metadata_of(folder: Path):
    from poolrunner.core.model.st_metadata import read_st_metadata

    metadata = read_st_metadata(folder)
    return attrs.evolve(metadata, dense_layers=[attrs.evolve(d, path="") for d in metadata.dense_layers])


@pytest.fixture(scope="module")
def sweep_metadata(make_minilm_folder):
    return st_metadata_of(sweep_folder(make_minilm_folder, {}))


@pytest.mark.parametrize(("file", "key", "value"), [
    ("modules.json", "idx", None), ("modules.json", "kwargs", ["task"]), ("modules.json", "unknown", 1),
    *[("sentence_bert_config.json", key, value) for key, value in [
        ("backend", "openvino"), ("unpad_inputs", False), ("cache_dir", "/nowhere"),
        ("model_args", {"trust_remote_code": True}), ("model_kwargs", {"token": "x"}),
        ("tokenizer_args", {"subfolder": "x"}), ("processor_kwargs", {"revision": "v2"}),
        ("config_args", {"local_files_only": True}), ("config_kwargs", {"cache_dir": "x"}),
        ("processing_kwargs", None), ("query_length", None), ("document_length", None), ("query_expansion", None),
        ("tokenizer_name_or_path", None),
        ("module_output_name", "ignored"),  # without modality_config sentence-transformers takes the task's own
    ]],
    *[("config_sentence_transformers.json", key, value) for key, value in [
        ("__version__", {"sentence_transformers": "99.0.0"}), ("requirements", {"torch": ">=2"}),
        ("keep_in_fp32_modules", ["classifier"]), ("truncate_dim", None), ("unknown", 1),
    ]],
    ("2_Dense/config.json", "unknown", 1), ("3_Normalize/config.json", "unknown", 1),
])
def test_inert_key_changes_nothing(make_minilm_folder, sweep_metadata, file, key, value):
    folder = sweep_folder(make_minilm_folder, {})
    path = folder / file
    data = json.loads(path.read_text()) if path.is_file() else {}
    if file == "modules.json":
        data = [{**entry, key: value} for entry in data]
    else:
        data[key] = value
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    assert st_metadata_of(folder) == sweep_metadata


FROM_PRETRAINED = ("sentence-transformers passes these to {}.from_pretrained, where they change what it loads; "
                   "poolrunner passes none (only ['cache_dir', 'local_files_only', 'revision', 'subfolder', 'token', "
                   "'trust_remote_code'], which sentence-transformers overrides, may appear)")
QUERY_DOCUMENT = ("it changes only what sentence-transformers' encode_query / encode_document compute, which "
                  "poolrunner does not tell apart from encode")
SBERT_KEYS = ("['max_seq_length', 'do_lower_case', 'transformer_task', 'modality_config', 'module_output_name', "
              "'backend', 'unpad_inputs', 'cache_dir', 'model_kwargs', 'model_args', 'processor_kwargs', "
              "'tokenizer_args', 'config_kwargs', 'config_args', 'processing_kwargs', 'query_length', "
              "'document_length', 'query_expansion', 'tokenizer_name_or_path']")
MODEL_TYPES = ("poolrunner runs the pipelines of ['SentenceTransformer', 'CrossEncoder'] only; a folder of another "
               "type computes other outputs")
OTHER_FEATURE = "poolrunner applies the module to the pooled 'sentence_embedding' only"
ORDER = ('is not supported: the pipeline must start with its only Transformer module, at path "" (the model '
         "folder itself)")
SBERT = "sentence_bert_config.json"
ST_CONFIG = "config_sentence_transformers.json"
CROSS_ENCODER = {"modules.json": entries(TRANSFORMER), SBERT: {"transformer_task": "sequence-classification"}}


REFUSED = [
    # sentence_bert_config.json
    (SBERT, {SBERT: {"foo": 1}}, "unknown setting(s) foo=1, which sentence-transformers itself refuses; the "
                                 f"settings it reads there: {SBERT_KEYS} (for some, only some values are supported)"),
    (SBERT, {SBERT: {"max_seq_length": "256"}}, 'max_seq_length="256" is not supported: it must be a positive integer'),
    (SBERT, {SBERT: {"max_seq_length": 0}}, "max_seq_length=0 is not supported: it must be a positive integer"),
    (SBERT, {SBERT: {"do_lower_case": "false"}}, 'do_lower_case="false" is not supported: it must be true or false'),
    (SBERT, {SBERT: {"transformer_task": "sequence-classification"}},
     "transformer_task=\"sequence-classification\" is not supported: the Transformer of a SentenceTransformer runs "
     "'feature-extraction'"),
    (SBERT, {SBERT: {"modality_config": {"message": FEATURES["text"]}, "module_output_name": "token_embeddings"}},
     'modality_config={"message": {"method": "forward", "method_output_name": "last_hidden_state"}} is not '
     "supported: poolrunner runs 'feature-extraction' with modality_config={\"text\": {\"method\": \"forward\", "
     '"method_output_name": "last_hidden_state"}} only'),
    (SBERT, {SBERT: {"modality_config": FEATURES, "module_output_name": "sentence_embedding"}},
     'module_output_name="sentence_embedding" is not supported: poolrunner runs \'feature-extraction\' with '
     'module_output_name="token_embeddings" only'),
    (SBERT, {SBERT: {"modality_config": FEATURES}},
     "module_output_name=null is not supported: poolrunner runs 'feature-extraction' with "
     'module_output_name="token_embeddings" only'),
    (SBERT, {SBERT: {"model_args": {"torch_dtype": "float16"}}},
     'model_args={"torch_dtype": "float16"} is not supported: ' + FROM_PRETRAINED.format("AutoModel")),
    (SBERT, {SBERT: {"model_kwargs": {"attn_implementation": "eager"}}},
     'model_kwargs={"attn_implementation": "eager"} is not supported: ' + FROM_PRETRAINED.format("AutoModel")),
    (SBERT, {SBERT: {"tokenizer_args": {"do_lower_case": True}}},
     'tokenizer_args={"do_lower_case": true} is not supported: ' + FROM_PRETRAINED.format("AutoProcessor")),
    (SBERT, {SBERT: {"processor_kwargs": {"model_max_length": 128}}},
     'processor_kwargs={"model_max_length": 128} is not supported: ' + FROM_PRETRAINED.format("AutoProcessor")),
    (SBERT, {SBERT: {"config_args": {"num_hidden_layers": 2}}},
     'config_args={"num_hidden_layers": 2} is not supported: ' + FROM_PRETRAINED.format("AutoConfig")),
    (SBERT, {SBERT: {"config_kwargs": None}},
     "config_kwargs=null is not supported: " + FROM_PRETRAINED.format("AutoConfig")),
    (SBERT, {SBERT: {"processing_kwargs": {"text": {"max_length": 16}}}},
     'processing_kwargs={"text": {"max_length": 16}} is not supported: sentence-transformers passes them to every '
     "tokenizer call; poolrunner calls the tokenizer with its own settings"),
    (SBERT, {SBERT: {"query_length": 32}}, f"query_length=32 is not supported: {QUERY_DOCUMENT}"),
    (SBERT, {SBERT: {"document_length": 180}}, f"document_length=180 is not supported: {QUERY_DOCUMENT}"),
    (SBERT, {SBERT: {"query_expansion": {"strategy": "fixed", "length": 32}}},
     f'query_expansion={{"strategy": "fixed", "length": 32}} is not supported: {QUERY_DOCUMENT}'),
    (SBERT, {SBERT: {"tokenizer_name_or_path": "bert-base-cased"}},
     'tokenizer_name_or_path="bert-base-cased" is not supported: poolrunner loads the tokenizer of the model folder '
     "itself"),
    # the first file with a setting is the Transformer's config, as sentence-transformers picks it
    ("sentence_xlnet_config.json", {SBERT: {}, "sentence_xlnet_config.json": {"do_lower_case": 1}},
     'do_lower_case=1 is not supported: it must be true or false'),
    # config_sentence_transformers.json
    (ST_CONFIG, {ST_CONFIG: {"model_type": "SparseEncoder"}},
     f'model_type="SparseEncoder" is not supported: {MODEL_TYPES}'),
    (ST_CONFIG, {ST_CONFIG: {"model_type": "MultiVectorEncoder"}},
     f'model_type="MultiVectorEncoder" is not supported: {MODEL_TYPES}'),
    (ST_CONFIG, {ST_CONFIG: {"model_type": None}}, f"model_type=null is not supported: {MODEL_TYPES}"),
    (ST_CONFIG, {ST_CONFIG: {"truncate_dim": 32}},
     "truncate_dim=32 is not supported: sentence-transformers cuts every embedding to its first truncate_dim values; "
     "poolrunner returns them whole"),
    (ST_CONFIG, {**CROSS_ENCODER, ST_CONFIG: {"model_type": "CrossEncoder", "prompts": {"query": "Query: "},
                                              "default_prompt_name": "query"}},
     "default_prompt_name=\"query\" is not supported: a CrossEncoder prepends its prompt 'Query: ' to the first text "
     "of every pair; poolrunner scores pairs without prompts"),
    (SBERT, {**CROSS_ENCODER, SBERT: {}, ST_CONFIG: {"model_type": "CrossEncoder"}},
     "transformer_task=\"feature-extraction\" is not supported: the Transformer of a CrossEncoder runs "
     "'sequence-classification'"),
    # modules.json
    ("modules.json", {"modules.json": [PIPELINE[0], {**PIPELINE[1], "path": "../1_Pooling"}]},
     'path="../1_Pooling" is not supported: sentence-transformers loads modules only from relative paths without '
     "'..'"),
    ("modules.json", {"modules.json": [PIPELINE[0], {**PIPELINE[1], "path": "/tmp/1_Pooling"}]},
     'path="/tmp/1_Pooling" is not supported: sentence-transformers loads modules only from relative paths without '
     "'..'"),
    ("modules.json", {"modules.json": [PIPELINE[0], PIPELINE[1], {**PIPELINE[2], "name": "1"}]},
     'name="1" is not supported: two modules have this name; sentence-transformers keeps only one of them'),
    ("modules.json", {"modules.json": [{"name": "0", "type": "sentence_transformers.models.Transformer"}]},
     "module {'name': '0', 'type': 'sentence_transformers.models.Transformer'} has no path"),
    ("modules.json", {"modules.json": entries(POOLING, TRANSFORMER)},
     f"module 0 (type='sentence_transformers.models.Pooling', path=\"1_Pooling\") {ORDER}"),
    ("modules.json", {"modules.json": entries(("Transformer", "0_Transformer"), POOLING)},
     f"module 0 (type='sentence_transformers.models.Transformer', path=\"0_Transformer\") {ORDER}"),
    ("modules.json", {"modules.json": entries(TRANSFORMER, POOLING, TRANSFORMER)},
     f"module 2 (type='sentence_transformers.models.Transformer', path=\"\") {ORDER}"),
    ("", {"modules.json": entries(TRANSFORMER, ("Normalize", "3_Normalize"), POOLING)},
     "a Normalize module before the Pooling module is not supported"),
    ("", {"modules.json": entries(TRANSFORMER, ("Dense", "2_Dense"), POOLING)},
     "a Dense module before the Pooling module is not supported"),
    # Dense and Normalize config.json
    ("2_Dense/config.json", {"2_Dense/config.json": {**DENSE_64, "use_residual": True}},
     "use_residual=true is not supported: poolrunner's Dense layer adds no residual connection"),
    ("2_Dense/config.json", {"2_Dense/config.json": {**DENSE_64, "module_input_name": "token_embeddings"}},
     f'module_input_name="token_embeddings" is not supported: {OTHER_FEATURE}'),
    ("2_Dense/config.json", {"2_Dense/config.json": {**DENSE_64, "module_output_name": "projected"}},
     f'module_output_name="projected" is not supported: {OTHER_FEATURE}'),
    ("2_Dense/config.json", {"2_Dense/config.json": {**DENSE_64, "in_features": "384"}},
     'in_features="384" is not supported: it must be a positive integer'),
    ("2_Dense/config.json", {"2_Dense/config.json": {**DENSE_64, "bias": "false"}},
     'bias="false" is not supported: it must be true or false'),
    ("2_Dense/config.json", {"2_Dense/config.json": {"in_features": 384}},
     "['out_features'] missing; sentence-transformers' Dense needs both sizes"),
    ("3_Normalize/config.json", {"3_Normalize/config.json": {"module_input_name": "token_embeddings"}},
     f'module_input_name="token_embeddings" is not supported: {OTHER_FEATURE}'),
    ("3_Normalize/config.json", {"3_Normalize/config.json": {"module_input_name": None}},
     f"module_input_name=null is not supported: {OTHER_FEATURE}"),
    ("3_Normalize/config.json", {"3_Normalize/config.json": {"module_output_name": "normalized"}},
     f'module_output_name="normalized" is not supported: {OTHER_FEATURE}'),
]


@pytest.mark.parametrize(("file", "files", "message"), REFUSED, ids=[f"{case[0] or 'pipeline'}-{i}"
                                                                     for i, case in enumerate(REFUSED)])
def test_refused_key(make_minilm_folder, file, files, message):
    folder = sweep_folder(make_minilm_folder, files)
    with pytest.raises(ModelLoadError) as caught:
        poolrunner.Runtime(folder, dtype="float32")
    assert str(caught.value) == f"{folder / file}: {message}"


def test_a_tokenizer_config_that_truncates_on_the_left_is_followed_unless_a_request_names_a_side(
        make_minilm_folder):
    """sentence-transformers (and the tokenizer itself) cut where ``tokenizer_config.json``'s
    ``truncation_side`` says; a request without a side does the same, a side it names wins, and
    TEI's route without ``truncation_direction`` leaves the choice to the folder."""
    from sentence_transformers import SentenceTransformer

    from poolrunner.core.server.tei_protocol import tei_tokenization

    folder = make_minilm_folder("truncate-left", modules=[TRANSFORMER, POOLING], pooling=MEAN,
                                sbert_config={"max_seq_length": 16, "do_lower_case": False})
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "truncation_side": "left"}))
    text = "The start of this text is cut away, while the very end of it, the last words, is kept here."
    model = SentenceTransformer(str(folder), device="cpu")
    assert len(model.tokenize([text])["input_ids"][0]) == 16
    expected = model.encode([text])
    runtime = poolrunner.Runtime(folder, dtype="float32")
    assert runtime.inputs.truncation_side == "left"
    np.testing.assert_allclose(runtime.embed([text], truncate_prompt_tokens=-1), expected, atol=1e-6)
    kept_start = runtime.embed([text], truncate_prompt_tokens=-1, truncation_side="right")
    assert cosine_rows(kept_start, expected).max() < 0.99
    assert tei_tokenization(None, None, auto_truncate=True).truncation_side is None


def test_a_router_folder_is_refused_naming_its_first_module(tmp_path):
    """sentence-transformers' Router (separate query and document modules, as inference-free
    SPLADE folders save them) has no config.json at the folder's root: the refusal says what the
    folder is, not that it is no model folder."""
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.router.Router"}]))
    with pytest.raises(ModelLoadError) as error:
        poolrunner.Runtime(str(tmp_path), load_entrypoints=False)
    assert str(error.value) == (
        f"model {str(tmp_path)!r} has no config.json at its root: it is a sentence-transformers folder whose "
        "modules.json starts with sentence_transformers.base.modules.router.Router, and poolrunner serves the "
        "pipelines whose Transformer is the folder itself (not a Router's separate query and document modules)")
