"""The architecture matrix: every model family poolrunner is checked on, every head it has.

One :class:`Family` per configuration layout a user can bring (a family with a layout that
changes attention, such as Qwen3 with ``use_sliding_window``, is its own entry); each family
lists the heads transformers has for it, and each ``(family, head)`` :class:`Row` states what
poolrunner must do with such a folder:

* ``exact``: serve it, with transformers' own result (eager attention, fp32, each input run
  alone) in every batching mode (``tests/test_architecture_matrix.py``);
* ``refused``: refuse it at load with a :class:`poolrunner.ModelLoadError` naming the architecture;
* ``exact (text, image)``: a text-image model (CLIP, SigLIP, SigLIP2) served with both towers:
  ``embed`` of a text equals ``get_text_features`` (SigLIP's of the prompt padded as its tokenizer
  pads to the text tower's length) and of an image ``get_image_features``, normalized (the matrix
  checks one of each; ``tests/test_clip.py`` and ``tests/test_siglip.py`` hold each family's full
  parity and image inputs);
* ``exact (queries, pages)``: a page-retrieval model (ColPali, ColQwen2): ``token_embed`` of a
  query and of a page (an image) equals the model's ``embeddings`` of its processor's
  ``process_queries`` / ``process_images`` (``tests/test_colpali.py`` holds the rest). Their
  folders are :mod:`poolrunner.core.testing.tiny_models`' own (the processor included).

Heads a family does not have in transformers (Gemma3 has no ``*ForTokenClassification``) are
simply absent from its ``heads``; ``tests/test_architecture_matrix.py`` checks that the table
lists exactly the classes transformers has.

:func:`build_folder` saves a seeded tiny model (hidden 64, 2-3 layers, 4 heads, vocab 512,
matrices widened to std 0.2 so that a wrong row, position or mask visibly changes results) with
a small byte-level BPE tokenizer. Special ids are the same in every folder:
``<s>`` 0 (BOS / CLS), ``<pad>`` 1, ``</s>`` 2 (EOS / SEP), ``<unk>`` 3, ``<mask>`` 4; decoders
use ``pad_token_id == eos_token_id == 2`` (most decoders' layout, and the rerankers' whose
tokenizer appends EOS).

:func:`support_table` renders the README's ``## Supported architectures`` table from
:data:`FAMILIES`; print it with ``python -m tests.models.architectures``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from poolrunner.core.testing.tiny_models import widen_weights

EXACT = "exact"
REFUSED = "refused"
TEXT_IMAGE = "exact (text, image)"
PAGE_RETRIEVAL = "exact (queries, pages)"

# Heads, as the suffix of the transformers class (``BertForTokenClassification``).
HEADS = ("model", "sequence", "token")
HEAD_SUFFIX = {"model": "Model", "sequence": "ForSequenceClassification", "token": "ForTokenClassification"}
# The tasks poolrunner serves for each head (the README table's columns).
HEAD_TASKS = {"model": ("embed", "token_embed"), "sequence": ("classify",), "token": ("token_classify",)}

VOCAB_SIZE = 512
BOS_ID, PAD_ID, EOS_ID = 0, 1, 2  # <s>, <pad>, </s>; decoders set pad_token_id = EOS_ID
FIRST_WORD_ID = 5  # ids below are special tokens; inputs draw their words from FIRST_WORD_ID..
SEQUENCE_LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TOKEN_LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
INIT_STD = 0.2
MAX_POSITIONS = 128

_ENCODER = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": MAX_POSITIONS, "pad_token_id": PAD_ID,
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
# RoBERTa-style positions start after the padding index: 130 positions hold 128 tokens.
_ROBERTA = {**_ENCODER, "max_position_embeddings": MAX_POSITIONS + 2, "type_vocab_size": 1}
_DECODER = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": MAX_POSITIONS,
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "tie_word_embeddings": False}
_GEMMA = {**_DECODER, "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 16}


@dataclass(frozen=True)
class Family:
    """One configuration layout of one transformers model family.

    :ivar id: Test id (``qwen3-sliding``).
    :ivar label: The README row (markdown).
    :ivar prefix: Class prefix: ``prefix + HEAD_SUFFIX[head]`` is the architecture.
    :ivar config_class: The transformers config class.
    :ivar config: Arguments of ``config_class`` (``architectures`` and labels are added per head).
    :ivar decoder: A decoder (LAST pooling, sequence head reads the last non-pad token).
    :ivar causal: Causal in every layer (poolrunner may then run prompts in chunks with a KV cache).
    :ivar status: Expected status per head; its keys are the heads transformers has.
    :ivar classes: A head's class when it is not ``prefix + HEAD_SUFFIX[head]``
        (``CLIPTextModelWithProjection``).
    """

    id: str
    label: str
    prefix: str
    config_class: str
    config: Mapping[str, Any]
    decoder: bool = False
    causal: bool = False
    status: Mapping[str, str] = field(default_factory=lambda: dict.fromkeys(HEADS, EXACT))
    classes: Mapping[str, str] = field(default_factory=dict)

    def architecture(self, head: str) -> str:
        return self.classes.get(head) or self.prefix + HEAD_SUFFIX[head]

    @property
    def heads(self) -> tuple[str, ...]:
        return tuple(head for head in HEADS if head in self.status)


@dataclass(frozen=True)
class Row:
    """One ``(family, head)`` of the matrix."""

    family: Family
    head: str

    @property
    def id(self) -> str:
        return f"{self.family.id}/{self.head}"

    @property
    def architecture(self) -> str:
        return self.family.architecture(self.head)

    @property
    def status(self) -> str:
        return self.family.status[self.head]

    @property
    def task(self) -> str:
        """The task the matrix runs the row with (``model`` rows also run ``embed``)."""
        return {"model": "token_embed", "sequence": "classify", "token": "token_classify"}[self.head]


def _exact(*heads: str) -> dict[str, str]:
    return dict.fromkeys(heads, EXACT)


# Text towers alone: refused (their embedding is the whole model's pooled output: CLIP's EOS row and
# projection, SigLIP's head); never embedded another way.
_CLIP_TEXT = {**_ENCODER, "projection_dim": 32}
_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "image_size": 32, "patch_size": 8}
# SigLIP's text tower takes 64 positions, as every published checkpoint's; its head projects to the
# vision tower's hidden size (64). SigLIP2's images are up to 16 patches of 8 pixels (NaFlex).
_SIGLIP_TEXT = {**_ENCODER, "max_position_embeddings": 64}
_SIGLIP2_VISION = {**{k: v for k, v in _VISION.items() if k != "image_size"}, "num_patches": 16}
_REFUSED_MODEL = {"model": REFUSED}


FAMILIES: tuple[Family, ...] = (
    Family("bert", "BERT", "Bert", "BertConfig", {**_ENCODER, "type_vocab_size": 2}),
    Family("roberta", "RoBERTa", "Roberta", "RobertaConfig", _ROBERTA),
    Family("xlm-roberta", "XLM-RoBERTa", "XLMRoberta", "XLMRobertaConfig", _ROBERTA),
    Family("distilbert", "DistilBERT", "DistilBert", "DistilBertConfig", {
        "vocab_size": VOCAB_SIZE, "dim": 64, "hidden_dim": 128, "n_layers": 2, "n_heads": 4,
        "max_position_embeddings": MAX_POSITIONS, "pad_token_id": PAD_ID}),
    # embedding_size < hidden_size: the embeddings go through ELECTRA's projection.
    Family("electra", "ELECTRA", "Electra", "ElectraConfig", {**_ENCODER, "embedding_size": 32, "type_vocab_size": 2}),
    # DeBERTa-v3's layout: relative attention only (no absolute positions), log buckets.
    Family("deberta-v2", "DeBERTa-v2 / v3", "DebertaV2", "DebertaV2Config", {
        **_ENCODER, "type_vocab_size": 0, "relative_attention": True, "position_buckets": 8,
        "max_relative_positions": -1, "pos_att_type": ["p2c", "c2p"], "position_biased_input": False,
        "norm_rel_ebd": "layer_norm", "share_att_key": True}),
    Family("mpnet", "MPNet", "MPNet", "MPNetConfig", _ROBERTA),  # 32 buckets: transformers hard-codes 32
    # Layers 0 and 2 global, layer 1 local over a window of 8 (4 either side).
    Family("modernbert", "ModernBERT (`classifier_pooling: cls`)", "ModernBert", "ModernBertConfig", {
        **_ENCODER, "num_hidden_layers": 3, "local_attention": 8, "global_attn_every_n_layers": 2,
        "cls_token_id": BOS_ID, "sep_token_id": EOS_ID, "classifier_pooling": "cls"}),
    Family("modernbert-mean", "ModernBERT (`classifier_pooling: mean`)", "ModernBert", "ModernBertConfig", {
        **_ENCODER, "num_hidden_layers": 3, "local_attention": 8, "global_attn_every_n_layers": 2,
        "cls_token_id": BOS_ID, "sep_token_id": EOS_ID, "classifier_pooling": "mean"}),
    Family("ernie", "ERNIE", "Ernie", "ErnieConfig", {**_ENCODER, "type_vocab_size": 2}),
    Family("llama", "Llama", "Llama", "LlamaConfig", _DECODER, decoder=True, causal=True),
    Family("mistral", "Mistral (`sliding_window`)", "Mistral", "MistralConfig",
           {**_DECODER, "head_dim": 16, "sliding_window": 4}, decoder=True, causal=True),
    Family("qwen2", "Qwen2", "Qwen2", "Qwen2Config", _DECODER, decoder=True, causal=True),
    # gte-Qwen2: bidirectional attention through `is_causal: false` in config.json.
    Family("qwen2-bidirectional", "Qwen2 (`is_causal: false`, gte-Qwen2)", "Qwen2", "Qwen2Config",
           {**_DECODER, "is_causal": False}, decoder=True),
    Family("qwen3", "Qwen3", "Qwen3", "Qwen3Config", {**_DECODER, "head_dim": 16}, decoder=True, causal=True),
    # Layers from max_window_layers on slide: layer 0 full, layers 1 and 2 over a window of 4.
    Family("qwen3-sliding", "Qwen3 (`use_sliding_window: true`)", "Qwen3", "Qwen3Config", {
        **_DECODER, "head_dim": 16, "num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 4,
        "max_window_layers": 1}, decoder=True, causal=True),
    # Layers alternate sliding (0, 2) and full (1); attention logits soft-capped at 2.
    Family("gemma2", "Gemma2 (soft-capping, `sliding_window`)", "Gemma2", "Gemma2Config", {
        **_GEMMA, "sliding_window": 4, "attn_logit_softcapping": 2.0, "final_logit_softcapping": None},
        decoder=True, causal=True),
    Family("gemma3", "Gemma3 text", "Gemma3Text", "Gemma3TextConfig", {
        **_GEMMA, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        decoder=True, causal=True, status=_exact("model", "sequence")),
    # EmbeddingGemma: bidirectional, the sliding layers over a symmetric window.
    Family("gemma3-bidirectional", "Gemma3 text (`use_bidirectional_attention`, EmbeddingGemma)", "Gemma3Text",
           "Gemma3TextConfig", {
               **_GEMMA, "sliding_window": 8, "use_bidirectional_attention": True,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
           decoder=True, status=_exact("model", "sequence")),
    Family("phi3", "Phi-3", "Phi3", "Phi3Config", {**_DECODER, "original_max_position_embeddings": MAX_POSITIONS},
           decoder=True, causal=True),
    # Attention sinks (one extra softmax logit per head), mixture of experts, sliding layers.
    Family("gpt-oss", "GPT-OSS (attention sinks)", "GptOss", "GptOssConfig", {
        **_DECODER, "intermediate_size": 64, "head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
        decoder=True, causal=True),
    Family("gpt2", "GPT-2", "GPT2", "GPT2Config", {
        "vocab_size": VOCAB_SIZE, "n_embd": 64, "n_inner": 128, "n_layer": 2, "n_head": 4,
        "n_positions": MAX_POSITIONS, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID},
        decoder=True, causal=True),
    Family("clip-text", "CLIP text tower", "CLIPText", "CLIPTextConfig", _CLIP_TEXT, status=_REFUSED_MODEL),
    Family("clip-text-projection", "CLIP text tower with projection", "CLIPText", "CLIPTextConfig", _CLIP_TEXT,
           status=_REFUSED_MODEL, classes={"model": "CLIPTextModelWithProjection"}),
    Family("clip", "CLIP (text and image)", "CLIP", "CLIPConfig",
           {"text_config": _CLIP_TEXT, "vision_config": _VISION, "projection_dim": 32}, status={"model": TEXT_IMAGE}),
    Family("colpali", "ColPali (PaliGemma: SigLIP vision, Gemma)", "ColPali", "ColPaliConfig", {},
           status={"model": PAGE_RETRIEVAL}, classes={"model": "ColPaliForRetrieval"}),
    Family("colqwen2", "ColQwen2 (Qwen2-VL, dynamic resolution)", "ColQwen2", "ColQwen2Config", {},
           status={"model": PAGE_RETRIEVAL}, classes={"model": "ColQwen2ForRetrieval"}),
    Family("siglip-text", "SigLIP text tower", "SiglipText", "SiglipTextConfig", _ENCODER, status=_REFUSED_MODEL),
    Family("siglip", "SigLIP (text and image)", "Siglip", "SiglipConfig",
           {"text_config": _SIGLIP_TEXT, "vision_config": _VISION}, status={"model": TEXT_IMAGE}),
    Family("siglip2", "SigLIP2 (text and image, NaFlex)", "Siglip2", "Siglip2Config",
           {"text_config": _SIGLIP_TEXT, "vision_config": _SIGLIP2_VISION}, status={"model": TEXT_IMAGE}),
)


def rows() -> list[Row]:
    """Every ``(family, head)`` of :data:`FAMILIES`, in table order."""
    return [Row(family, head) for family in FAMILIES for head in family.heads]


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    """Token-id inputs of one row (special tokens included, none added by poolrunner).

    :ivar mixed: Lengths 3, 9, 17, 30: longer than every sliding window and the ModernBERT
        local window, shorter than the one-step budget of 8 for three of them.
    :ivar equal: Three different inputs of 12 tokens (no padding anywhere in a batch).
    :ivar eos: Decoder sequence heads only (else empty): inputs ending in EOS == pad, as a
        reranker tokenizer that appends EOS makes them; transformers then reads the row before.
    """

    mixed: tuple[tuple[int, ...], ...]
    equal: tuple[tuple[int, ...], ...]
    eos: tuple[tuple[int, ...], ...] = ()

    @property
    def all(self) -> tuple[tuple[int, ...], ...]:
        return self.mixed + self.equal + self.eos


def inputs_for(row: Row, seed: int = 0) -> Inputs:
    """Seeded inputs: encoders ``<s> words </s>``, decoders ``<s> words`` (no EOS, never the
    pad id) and, for decoder sequence heads, ``<s> words </s>`` as :attr:`Inputs.eos`."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def words(n: int) -> list[int]:
        return torch.randint(FIRST_WORD_ID, VOCAB_SIZE, (n,), generator=generator).tolist()

    def make(length: int, *, eos: bool) -> tuple[int, ...]:
        return tuple([BOS_ID, *words(length - 2), EOS_ID] if eos else [BOS_ID, *words(length - 1)])

    encoder = not row.family.decoder
    mixed = tuple(make(n, eos=encoder) for n in (3, 9, 17, 30))
    equal = tuple(make(12, eos=encoder) for _ in range(3))
    eos = tuple(make(n, eos=True) for n in (6, 14, 25)) if row.family.decoder and row.head == "sequence" else ()
    return Inputs(mixed, equal, eos)


# --------------------------------------------------------------------------- folders


def make_config(row: Row) -> Any:
    """The row's transformers config: the family's, ``architectures`` set to the row's class,
    labels for the classification heads."""
    import transformers

    labels: dict[str, Any] = {}
    if row.head == "sequence":
        labels = {"id2label": dict(SEQUENCE_LABELS)}
    elif row.head == "token":
        labels = {"id2label": dict(TOKEN_LABELS)}
    config_class = getattr(transformers, row.family.config_class)
    return config_class(**row.family.config, **labels, architectures=[row.architecture])


def make_model(row: Row, seed: int = 0) -> Any:
    """A seeded random model of the row's class in eval mode, every matrix widened to std
    :data:`INIT_STD` (the default 0.02 leaves outputs nearly input-independent)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, row.architecture)(make_config(row)).eval()
    return widen_weights(model, INIT_STD)


@cache
def _tokenizer_backend_json() -> str:
    """A byte-level BPE over the words ``w0 .. w499`` with the special tokens at ids 0-4.

    Byte-level BPE because transformers rebuilds some families' tokenizers from the vocabulary
    and merges (Qwen2's), which a WordLevel vocabulary does not survive. The tests feed token
    ids, so the tokenizer only has to load and tokenize sensibly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    words = [f"w{i}" for i in range(500)]
    backend.train_from_iterator([" ".join(words[i : i + 10]) for i in range(0, len(words), 10)] * 2, trainer)
    assert backend.get_vocab_size() <= VOCAB_SIZE
    assert [backend.token_to_id(t) for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")] == [0, 1, 2, 3, 4]
    return backend.to_str()


def make_tokenizer() -> Any:
    """The folders' tokenizer (:func:`_tokenizer_backend_json`) with the special tokens named."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_backend_json()), bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", unk_token="<unk>", mask_token="<mask>", cls_token="<s>", sep_token="</s>",
    )


def image_processor(family: Family) -> Any:
    """A ``TEXT_IMAGE`` family's own image processor, sized for its vision tower."""
    import transformers

    vision = family.config["vision_config"]
    if family.id == "siglip2":
        return transformers.Siglip2ImageProcessor(patch_size=vision["patch_size"],
                                                  max_num_patches=vision["num_patches"])
    side = vision["image_size"]
    if family.id == "siglip":
        return transformers.SiglipImageProcessor(size={"height": side, "width": side})
    return transformers.CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def build_folder(row: Row, folder: Path, seed: int = 0) -> Path:
    """Save the row's tiny model (:func:`make_model`) and tokenizer into ``folder``; a
    ``TEXT_IMAGE`` row also gets its family's image processor (:func:`image_processor`); a
    ``PAGE_RETRIEVAL`` row is the family's tiny folder with its processor (``tiny_colpali_folder``...)."""
    if row.status == PAGE_RETRIEVAL:
        from poolrunner.core.testing import tiny_models

        return getattr(tiny_models, f"tiny_{row.family.id}_folder")(folder)
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer().save_pretrained(folder)
    if row.status == TEXT_IMAGE:
        image_processor(row.family).save_pretrained(folder)
    make_model(row, seed).save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert saved["architectures"] == [row.architecture], saved.get("architectures")
    return folder


def load_reference(row: Row, folder: Path) -> Any:
    """transformers' own model of the folder: the row's class, eager attention (it implements
    every feature, e.g. soft-capping), fp32, eval."""
    import torch
    import transformers

    return getattr(transformers, row.architecture).from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32, local_files_only=True,
    ).eval()


def reference_output(model: Any, ids: Sequence[int]) -> Any:
    """The right answer for one input: it alone, a batch of one, no padding, no mask.

    :returns: float64 numpy ``last_hidden_state[0]`` (``[T, hidden]``) or ``logits[0]``
        (``[num_labels]`` or ``[T, num_labels]``).
    """
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)], dtype=torch.int64))
    result = out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state
    return result[0].double().numpy()


# --------------------------------------------------------------------------- refused folders


@dataclass(frozen=True)
class Variant:
    """A folder of a matrix row, edited into a layout that must be refused at load.

    :ivar id: Test id.
    :ivar row: The ``(family, head)`` id of the folder it starts from.
    :ivar edit: Changes the saved folder (config keys, files, weights).
    :ivar message: What the :class:`poolrunner.ModelLoadError` must contain.
    """

    id: str
    row: str
    edit: Callable[[Path], None]
    message: str


DROP = object()
"""As a value of :func:`edit_config`: remove the key."""


def edit_config(folder: Path, **changes: Any) -> None:
    """Set keys of ``folder/config.json`` (remove those given :data:`DROP`)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")


REMOTE_CODE_MARKER = "ran-folder-code"
"""A file the remote-code variant's modules write next to themselves when they are imported."""


def _remote_code(folder: Path) -> None:
    """A folder written for ``trust_remote_code``: its own model type, config and model classes,
    whose import would leave :data:`REMOTE_CODE_MARKER` in the folder."""
    edit_config(folder, model_type="custom_bert", auto_map={
        "AutoConfig": "configuration_custom.CustomConfig", "AutoModel": "modeling_custom.CustomModel"})
    marker = f"(__import__('pathlib').Path(__file__).parent / {REMOTE_CODE_MARKER!r}).touch()\n"
    (folder / "configuration_custom.py").write_text(
        marker + "from transformers import BertConfig\n\n\nclass CustomConfig(BertConfig):\n"
        "    model_type = 'custom_bert'\n", encoding="utf-8")
    (folder / "modeling_custom.py").write_text(
        marker + "from transformers import BertModel\n\n\nclass CustomModel(BertModel):\n    pass\n", encoding="utf-8")


def _relative_key(folder: Path) -> None:
    """A BERT ``relative_key`` checkpoint as transformers 4.x saved it: transformers 5 has no
    place for its ``distance_embedding`` weights and would drop them."""
    import torch
    from safetensors.torch import load_file, save_file

    edit_config(folder, position_embedding_type="relative_key")
    weights = load_file(folder / "model.safetensors")
    head_dim = _ENCODER["hidden_size"] // _ENCODER["num_attention_heads"]
    for layer in range(_ENCODER["num_hidden_layers"]):
        weights[f"encoder.layer.{layer}.attention.self.distance_embedding.weight"] = torch.randn(
            2 * MAX_POSITIONS - 1, head_dim, generator=torch.Generator().manual_seed(layer))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _save_as(folder: Path, architecture: str) -> None:
    """Replace the folder's weights with a seeded model of transformers' class ``architecture``."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder, architectures=[architecture])
    torch.manual_seed(0)
    getattr(transformers, architecture)(config).save_pretrained(folder)


VARIANTS: tuple[Variant, ...] = (
    Variant("bert-relative-key", "bert/model", _relative_key,
            "BertModel has no place for the weights encoder.layer.0.attention.self.distance_embedding.weight"),
    Variant("bert-more-layers-than-weights", "bert/model", lambda f: edit_config(f, num_hidden_layers=3),
            "the weights lack encoder.layer.2."),
    Variant("bert-head-not-in-weights", "bert/model",
            lambda f: edit_config(f, architectures=["BertForSequenceClassification"]),
            "the weights lack classifier.bias, classifier.weight, which BertForSequenceClassification would fill "
            "with random values"),
    Variant("bert-question-answering", "bert/model", lambda f: _save_as(f, "BertForQuestionAnswering"),
            "BertForQuestionAnswering applies qa_outputs after its backbone, which poolrunner does not run"),
    Variant("bert-shapes-not-the-config", "bert/model", lambda f: edit_config(f, vocab_size=100),
            "weights of another shape than config.json describes: embeddings.word_embeddings.weight (512, 64) "
            "(the config makes (100, 64))"),
    Variant("remote-code", "bert/model", _remote_code,
            "config.json's model_type 'custom_bert' is not a transformers model type"),
    Variant("qwen2-reward", "qwen2/sequence", lambda f: edit_config(f, architectures=["Qwen2ForRewardModel"]),
            "architectures names 'Qwen2ForRewardModel', which is not a transformers model class"),
    Variant("qwen2-process-reward", "qwen2/token",
            lambda f: edit_config(f, architectures=["Qwen2ForProcessRewardModel"]),
            "architectures names 'Qwen2ForProcessRewardModel', which is not a transformers model class"),
    Variant("no-model-type", "bert/model", lambda f: edit_config(f, model_type=DROP),
            "config.json has no model_type"),
    Variant("unknown-model-type", "bert/model", lambda f: edit_config(f, model_type="no_such_family"),
            "config.json's model_type 'no_such_family' is not a transformers model type"),
    Variant("hidden-size-not-an-int", "bert/model", lambda f: edit_config(f, hidden_size="64"),
            "cannot read the model config of"),
    Variant("architectures-not-a-list", "bert/model", lambda f: edit_config(f, architectures="BertModel"),
            "architectures must be a list of class names, got 'BertModel'"),
    Variant("config-not-an-object", "bert/model",
            lambda f: (f / "config.json").write_text("[]", encoding="utf-8"), "expected a JSON object, got list"),
)


# --------------------------------------------------------------------------- README table

_HEAD_COLUMNS = {
    "model": "`*Model`: `embed`, `token_embed`",
    "sequence": "`*ForSequenceClassification`: `classify`",
    "token": "`*ForTokenClassification`: `token_classify`",
}
NO_HEAD = "—"
LORA_COLUMN = "LoRA (PEFT's default `target_modules`)"


def lora_targets(family: Family) -> list[str] | None:
    """PEFT's default LoRA ``target_modules`` for the family's ``model_type``
    (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``), for families whose ``*Model`` row
    is exact; ``None`` when PEFT has none (a ``LoraConfig`` must then name them)."""
    import transformers
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    if family.status.get("model") != EXACT:
        return None
    model_type = getattr(transformers, family.config_class).model_type
    return TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)


LORA_REFUSED = {"deberta-v2": "query_proj"}
"""Families whose default LoRA targets poolrunner refuses, and the layer it names: DeBERTa also
runs ``query_proj`` on its relative position embeddings, shared by a step's requests."""


def lora_status(family: Family) -> str:
    """The LoRA column's cell: ``refused`` (:data:`LORA_REFUSED`), ``exact``, or ``—`` (PEFT has
    no default targets: :func:`lora_targets`)."""
    if not lora_targets(family):
        return NO_HEAD
    return REFUSED if family.id in LORA_REFUSED else EXACT


def support_table(families: Sequence[Family] = FAMILIES) -> str:
    """The README's ``## Supported architectures`` table: one row per family layout (with its
    classes' prefix, as ``architectures`` in ``config.json`` names them), one column per head;
    cells ``exact``, ``refused`` or ``—`` (transformers has no such head); the LoRA column
    as :func:`lora_status` says."""
    lines = [
        "| architecture | classes | " + " | ".join(_HEAD_COLUMNS[head] for head in HEADS) + f" | {LORA_COLUMN} |",
        "|---|---|" + "---|" * (len(HEADS) + 1),
    ]
    for family in families:
        cells = [family.status.get(head, NO_HEAD) for head in HEADS] + [lora_status(family)]
        classes = ", ".join(f"`{name}`" for name in family.classes.values()) or f"`{family.prefix}*`"
        lines.append(f"| {family.label} | {classes} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(support_table(), end="")
