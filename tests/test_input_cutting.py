"""Truncation reads a window of a long text (``poolrunner.core.inputs.cutting``): the answer must
equal what the tokenizer gives for the whole text, truncated.

Each tokenizer is compared on many texts (real prose with hostile pieces mixed in: runs of
spaces and newlines, tabs, punctuation runs, CJK, emoji, combining marks, words over 100
characters, the tokenizer's own special tokens written in the text) at many ``k``, on both
sides, against the tokenizer itself on the whole text.
"""

from __future__ import annotations

import random

import attrs
import pytest

from poolrunner import InvalidRequestError
from poolrunner.core.errors import InputTooLongError
from poolrunner.core.inputs import cutting
from poolrunner.core.inputs.tokenize import InputProcessor
from tests.models.smollm2 import smollm2_folder

PIECES = (
    "  ", "   ", "\n", "\n\n", " \n ", "\t", " \t ", "...", "!!!", "--", "?!", "'s", "don't", "l'été", "é",
    "e\u0301", "n\u0303o", "日本語の文章", "中文", "😀", "👍🏽", "\u200b", "\xa0", "\u3000", "1234567", "3.14159",
    "http://example.com/a?b=c&d=e", "a" * 120, "x" * 40 + "y" * 70, "[SEP]", "[CLS]", "<|im_end|>", "</s>",
    "ÀÉÎÕÜ", "ß", "İstanbul", "\x00", "\x07", "ﬁ", "Ⅻ", "¹²³", "<unk>", "w12 w345",
)
SEPARATORS = (" ",) * 12 + ("  ", "\n", " \n", "\t", ". ", ", ", " - ", "\n\n")


def hostile_texts(words: list[str], count: int, seed: int) -> list[str]:
    """``count`` texts of 300 to 12,000 characters: Lee words with :data:`PIECES` mixed in."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        size = rng.choice((300, 1500, 4000, 12000))
        parts: list[str] = []
        length = 0
        while length < size:
            part = rng.choice(PIECES) if rng.random() < 0.15 else rng.choice(words)
            parts.append(part + rng.choice(SEPARATORS))
            length += len(parts[-1])
        texts.append("".join(parts))
    return texts


def processor(tokenizer, runtime, max_model_len: int = 512, max_input_chars: int | None = None) -> InputProcessor:
    """An input processor for ``tokenizer`` (the default model's config with the tokenizer's
    vocabulary and another length), whose default side is the folder's (right): tests turn the
    shared tokenizer's side both ways."""
    tokenizer.truncation_side = "right"
    config = attrs.evolve(runtime.model_config, max_model_len=max_model_len,
                          hf_config={**runtime.model_config.hf_config, "vocab_size": len(tokenizer)})
    return InputProcessor(tokenizer, config, max_input_chars=max_input_chars)


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """The lengths of the texts handed to the tokenizer, in order."""
    lengths: list[int] = []
    encode = InputProcessor._encode

    def spy(self, texts, *args, **kwargs):
        lengths.extend(map(len, texts))
        return encode(self, texts, *args, **kwargs)

    monkeypatch.setattr(InputProcessor, "_encode", spy)
    return lengths


def assert_equal_to_whole(inputs: InputProcessor, reference, texts: list[str], keeps: tuple[int, ...],
                          reads: list[int]) -> None:
    """Each text truncated to each ``k`` on each side equals ``reference(text, truncation=True,
    max_length=k)``, and windows were read (not only whole texts)."""
    for side in ("right", "left"):
        reference.truncation_side = side
        for keep in keeps:
            reads.clear()
            expected = [tuple(ids) for ids in reference(texts, truncation=True, max_length=keep)["input_ids"]]
            got = inputs.encode(texts, truncate_prompt_tokens=keep, truncation_side=side)
            wrong = [(i, len(texts[i])) for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
            assert not wrong, f"side={side} k={keep}: texts (index, length) {wrong[:5]} differ"
            assert sum(reads) < sum(map(len, texts)), f"side={side} k={keep}: every text was read whole"


@pytest.fixture(scope="module")
def words(lee_docs) -> list[str]:
    return [word for doc in lee_docs for word in doc.split()]


def test_minilm_wordpiece_windows_equal_whole_text_truncation(runtime, hf_tokenizer, words, reads):
    assert runtime.inputs.cuttable
    texts = hostile_texts(words, 120, seed=1)
    assert_equal_to_whole(runtime.inputs, hf_tokenizer, texts, (2, 3, 17, 64, 255, 256), reads)


def chinese_texts(count: int, seed: int) -> list[str]:
    """``count`` texts of 1,000 to 12,000 characters without spaces: CJK ideographs (common and
    rare blocks), kana, Chinese punctuation, digits and Latin runs, as Chinese and Japanese text is."""
    rng = random.Random(seed)
    extras = ("，", "。", "、", "！", "？", "「", "」", "の", "です", "カタカナ", "2024年", "GPU", "３", "\U00020001")
    texts = []
    for _ in range(count):
        size = rng.choice((1000, 4000, 12000))
        texts.append("".join(rng.choice(extras) if rng.random() < 0.1 else chr(rng.randint(0x4E00, 0x9FFF))
                             for _ in range(size)))
    return texts


def test_minilm_windows_of_text_without_spaces_are_cut_before_ideographs(runtime, hf_tokenizer, reads):
    """BERT's normalizer isolates each ideograph, so Chinese text (no spaces) is cut before one."""
    assert runtime.inputs.cut_at_ideographs
    assert_equal_to_whole(runtime.inputs, hf_tokenizer, chinese_texts(40, seed=6), (2, 17, 256), reads)


def test_windows_equal_whole_text_with_a_prompt_and_without_special_tokens(runtime, hf_tokenizer, words):
    texts = hostile_texts(words, 40, seed=2)
    for side in ("right", "left"):
        hf_tokenizer.truncation_side = side
        expected = hf_tokenizer(["query: " + text for text in texts], truncation=True, max_length=40)["input_ids"]
        got = runtime.inputs.encode(texts, prompt="query: ", truncate_prompt_tokens=40, truncation_side=side)
        assert got == [tuple(ids) for ids in expected]
        expected = hf_tokenizer(texts, truncation=True, max_length=9, add_special_tokens=False)["input_ids"]
        got = runtime.inputs.encode(texts, truncate_prompt_tokens=9, truncation_side=side, add_special_tokens=False)
        assert got == [tuple(ids) for ids in expected]


def test_pair_documents_read_in_windows_equal_whole_pair_truncation(runtime, hf_tokenizer, words, reads):
    """``longest_first`` over a query within the kept tokens and a document over the character
    limit: the document is read in a window, and the pair's ids and token types equal the
    tokenizer's on the whole pair, on both sides, at budgets the query fits in whole or half.
    A document whose window holds too few certain tokens is refused, never cut inexactly."""
    inputs = processor(hf_tokenizer, runtime, max_model_len=256, max_input_chars=3000)
    documents = [text for text in hostile_texts(words, 40, seed=4) if len(text) > 3000]
    rng = random.Random(5)
    pairs = [(" ".join(rng.choice(words) for _ in range(rng.randint(1, 20))), document) for document in documents]
    for side in ("right", "left"):
        hf_tokenizer.truncation_side = side
        for keep in (40, 256):
            served = 0
            for query, document in pairs:
                reads.clear()
                try:
                    (ids, types), = inputs.encode_pairs([(query, document)], truncate_prompt_tokens=keep,
                                                        truncation_side=side)
                except InputTooLongError:
                    continue
                expected = hf_tokenizer(query, document, truncation=True, max_length=keep, return_token_type_ids=True)
                assert (ids, types) == (tuple(expected["input_ids"]), tuple(expected["token_type_ids"])), (side, keep)
                assert sum(reads) < len(document)
                served += 1
            assert served >= 0.9 * len(pairs), f"side={side} k={keep}: {served} of {len(pairs)} pairs served"


def test_a_window_too_short_is_retried_up_to_the_limit_then_refused(runtime, hf_tokenizer, words, reads):
    """Words of 100+ characters are one [UNK] each: the first window (2304 characters for 256
    tokens) holds too few tokens, the second (the limit, 8192) holds enough."""
    inputs = processor(hf_tokenizer, runtime, max_model_len=256)
    text = " ".join(["z" * 150] * 20 + words[:3000])
    hf_tokenizer.truncation_side = "right"
    expected = tuple(hf_tokenizer(text, truncation=True, max_length=256)["input_ids"])
    assert inputs.encode([text], truncate_prompt_tokens=256)[0] == expected
    assert len(reads) == 2 and reads[0] <= cutting.first_window(256) < reads[1] <= 8192, reads
    small = processor(hf_tokenizer, runtime, max_model_len=256, max_input_chars=2500)
    with pytest.raises(InvalidRequestError) as error:
        small.encode([text], truncate_prompt_tokens=256)
    assert str(error.value) == (
        f"input 0 has {len(text)} characters, more than the limit of 2500 per input (max_input_chars, the "
        "--max-input-chars flag); shorten it or raise the limit: truncating reads only its first 2500 characters, "
        "and they have no space between words at which 256 tokens can be cut exactly")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's byte-level BPE (GPT-2's pre-tokenizer regex), from the cached test model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder(), local_files_only=True)


def test_smollm2_byte_level_bpe_windows_equal_whole_text_truncation(runtime, smollm2_tokenizer, words, reads):
    inputs = processor(smollm2_tokenizer, runtime, max_model_len=512)
    assert inputs.cuttable
    texts = hostile_texts(words, 80, seed=3)
    assert_equal_to_whole(inputs, smollm2_tokenizer, texts, (1, 5, 33, 200, 512), reads)


def _qwen2_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from poolrunner.core.testing.tiny_models import tiny_qwen2_bpe

    return PreTrainedTokenizerFast(tokenizer_object=tiny_qwen2_bpe(["<unk>", "<s>", "</s>"]), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def _unigram_tokenizer(words: list[str]):
    """A SentencePiece-style Unigram model (NFKC, space runs collapsed, Metaspace) with a
    ``<s> $A </s>`` template, trained on the Lee words."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.Unigram())
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=800, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>",
                                      show_progress=False)
    backend.train_from_iterator([" ".join(words[i:i + 50]) for i in range(0, len(words), 50)], trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                           special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_qwen2_split_regex_bpe_windows_equal_whole_text_truncation(runtime, words, reads):
    tokenizer = _qwen2_tokenizer()
    inputs = processor(tokenizer, runtime)
    assert inputs.cuttable
    assert_equal_to_whole(inputs, tokenizer, hostile_texts(words, 80, seed=4), (1, 7, 64, 300), reads)


def test_sentencepiece_unigram_windows_equal_whole_text_truncation(runtime, words, reads):
    tokenizer = _unigram_tokenizer(words)
    inputs = processor(tokenizer, runtime)
    assert inputs.cuttable
    assert_equal_to_whole(inputs, tokenizer, hostile_texts(words, 80, seed=5), (2, 9, 100, 512), reads)


def test_tokenizers_that_cannot_be_cut_exactly_are_read_whole(runtime, words):
    """BPE over the whole text (no pre-tokenizer: a merge can reach across any cut), BPE with
    dropout (random), a Split on a pattern not known to split at spaces, a slow tokenizer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert not cutting.cuttable(object())
    for pre_tokenizer, model in (
        (None, models.BPE()),
        (pre_tokenizers.Whitespace(), models.BPE(dropout=0.1)),
        (pre_tokenizers.Split(Regex(".{1,8}"), behavior="isolated"), models.BPE()),
        (pre_tokenizers.Metaspace(split=False), models.Unigram()),
    ):
        backend = Tokenizer(model)
        if pre_tokenizer is not None:
            backend.pre_tokenizer = pre_tokenizer
        assert not cutting.cuttable(PreTrainedTokenizerFast(tokenizer_object=backend)), (pre_tokenizer, model)
    tokenizer = _unigram_tokenizer(words)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(split=False)
    inputs = processor(tokenizer, runtime, max_input_chars=5000)
    text = " ".join(words[:2000])
    tokenizer.truncation_side = "right"
    short = text[:4000]
    assert inputs.encode([short], truncate_prompt_tokens=10)[0] == tuple(
        tokenizer(short, truncation=True, max_length=10)["input_ids"])
    with pytest.raises(InvalidRequestError) as error:
        inputs.encode(["ok", text], truncate_prompt_tokens=10)
    assert str(error.value) == (
        f"input 1 has {len(text)} characters, more than the limit of 5000 per input (max_input_chars, the "
        f"--max-input-chars flag); shorten it (the tokenizer of {runtime.model_config.name} reads whole texts, "
        "even to truncate them)")


def test_cut_windows_end_at_spaces_after_words():
    text = "alpha beta  gamma\ndelta epsilon zeta eta theta"
    window = cutting.cut(text, 30, "right")
    assert window.text == "alpha beta  gamma\ndelta"  # the last space after a word within 30 characters
    assert window.bound == len("alpha")  # tokens of the last two words before the cut are uncertain
    window = cutting.cut(text, 20, "left")
    assert window.text == " zeta eta theta"
    assert window.bound == len(" zeta eta")
    assert cutting.cut(text, len(text), "right") is None
    assert cutting.cut("x" * 100, 50, "right") is None  # no space: read whole
    assert cutting.cut("a " + "x" * 100, 50, "left") is None
    chinese = "今天天气很好，我们去公园散步。"
    assert cutting.cut(chinese, 10, "right") is None  # ideographs are cuts only where the normalizer isolates them
    window = cutting.cut(chinese, 10, "right", ideographs=True)
    assert window.text == "今天天气很好，我们去" and window.bound == len("今天天气很好，我")
    window = cutting.cut(chinese, 6, "left", ideographs=True)
    assert window.text == "去公园散步。" and window.bound == len("去公")


def test_a_megabyte_text_is_read_in_a_window(runtime, hf_tokenizer, words, reads):
    """1.5 MB truncated to 256 tokens reads one window of about 2 KB; the answer is the whole
    text's (that of its first 20 KB, which hold far more than 256 tokens)."""
    text = " ".join(words * 3)[:1_500_000]
    hf_tokenizer.truncation_side = "right"
    expected = tuple(hf_tokenizer(text[:20000], truncation=True, max_length=256)["input_ids"])
    assert runtime.inputs.encode([text], truncate_prompt_tokens=-1)[0] == expected
    assert len(reads) == 1 and reads[0] <= cutting.first_window(256), reads
