"""Tokenizing only the part of a long text that truncation keeps.

To keep ``k`` tokens of a text of megabytes, the tokenizer reads a window of it instead: its
first characters for right truncation, its last for left truncation, cut at a space. The answer
is used only when, by the argument below, it equals the truncated tokenization of the whole text;
otherwise the caller tokenizes the whole text (within the character limit) or refuses it.

Why a cut can be exact: a fast tokenizer normalizes, splits the text into pre-tokens, then
tokenizes each pre-token alone (WordPiece, BPE, Unigram and WordLevel models never look across
pre-tokens), then truncates and adds special tokens. :func:`cuttable` accepts only pipelines whose
normalizers change characters locally and whose pre-tokenizers split at spaces, so a pre-token
never reaches across a space that follows a non-space character. Text cut at such a space tokenizes
as the whole text does, except near the cut; the tokens of the last two words before the cut (of
the first two words after it, for left truncation) are treated as uncertain. BERT's normalizer puts
spaces around CJK ideographs, so with it the place before an ideograph is such a space too, and
Chinese text, which has no spaces, can be cut (:func:`isolates_ideographs`). A window is accepted
when truncation kept exactly ``k`` tokens and none of its text tokens is uncertain: then the ``k``
kept tokens are the whole text's ``k`` kept tokens (checked against the whole text in
``tests/test_input_cutting.py``).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import frozen

from poolrunner.core.types import TruncationSide

CUT_CHARS_PER_TOKEN = 8
"""Characters read per kept token by the first window (English averages 4-5 per token); a
window that holds too few tokens is retried up to the character limit."""
CUT_MARGIN_CHARS = 256
"""Characters added to each first window, beyond :data:`CUT_CHARS_PER_TOKEN` per token."""

_LOCAL_NORMALIZERS = frozenset({
    "BertNormalizer", "ByteLevel", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Nmt", "Precompiled", "Prepend",
    "Strip", "StripAccents",
})
"""Normalizers that map each character (or grapheme) on its own, or touch only the text's ends."""
_SPLITTING_PRE_TOKENIZERS = frozenset({"BertPreTokenizer", "Whitespace", "WhitespaceSplit"})
"""Pre-tokenizers that split at every space whatever their settings."""
_REFINING_PRE_TOKENIZERS = frozenset({"Punctuation", "Digits", "UnicodeScripts", "ByteLevel", "Metaspace",
                                      "CharDelimiterSplit", "Split"})
"""Pre-tokenizers that may follow a splitting one: they only split a pre-token further, or map it."""
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
_SPACE_RUNS = r"|\s*[\r\n]+|\s+(?!\S)|\s+"
_WORD_SPLIT_PATTERNS = frozenset({
    # Qwen2's; Llama 3's and cl100k's (digits by three); Qwen3.5's (marks kept with letters).
    _CONTRACTIONS + r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _SPACE_RUNS,
    _CONTRACTIONS + r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _SPACE_RUNS,
    _CONTRACTIONS + r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*" + _SPACE_RUNS,
})
"""Regex ``Split`` pre-tokenizers known to split at spaces (no match runs from a word over a space
into the next word)."""
_SPACE_PATTERNS = frozenset({" ", " {2,}", " +", r"\s+", r"\s{2,}"})
"""``Replace`` patterns that rewrite runs of spaces only."""
_IDEOGRAPHS = ("\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002ceaf"
               "\U0002f800-\U0002fa1f")
"""The CJK ideographs BERT's normalizer puts spaces around (``handle_chinese_chars``: the
ranges of its ``_is_chinese_char``)."""
_AFTER_WORD = re.compile(r"(?<=\S) ")
_BEFORE_WORD = re.compile(r" (?=\S)")
_AFTER_WORD_OR_IDEOGRAPH = re.compile(rf"(?<=\S)(?: |(?=[{_IDEOGRAPHS}]))")
_BEFORE_WORD_OR_IDEOGRAPH = re.compile(rf" (?=\S)|(?=[{_IDEOGRAPHS}])")


@frozen
class Window:
    """A piece of a text to tokenize instead of the whole, and which of its tokens are certain.

    :ivar text: The piece: a prefix (right truncation) or a suffix (left) of the text.
    :ivar bound: Right: tokens ending at or before this character of :attr:`text` are certain;
        left: tokens starting at or after it.
    :ivar side: The truncation side it was cut for.
    """

    text: str
    bound: int
    side: TruncationSide

    def certain(self, ids: Sequence[int], offsets: Sequence[tuple[int, int]], special: Sequence[int],
                keep: int) -> bool:
        """Whether ``ids`` (the window's tokenization truncated to ``keep`` tokens, with each
        token's character ``offsets`` and ``special`` mask) are the whole text's: ``keep`` tokens
        were kept (the window held enough) and every text token among them is certain."""
        if len(ids) != keep:
            return False
        spans = [span for span, added in zip(offsets, special, strict=True) if not added]
        if self.side == "right":
            return all(stop <= self.bound for _, stop in spans)
        return all(start >= self.bound for start, _ in spans)


def first_window(keep: int) -> int:
    """Characters of the first window read to keep ``keep`` tokens."""
    return CUT_CHARS_PER_TOKEN * keep + CUT_MARGIN_CHARS


def cut(text: str, size: int, side: TruncationSide, prefix: str = "", *, ideographs: bool = False) -> Window | None:
    """The window of at most ``size`` characters of ``text`` that ``side`` truncation keeps, cut
    at a space after (right) or before (left) a word, or with ``ideographs`` (a tokenizer that
    :func:`isolates_ideographs`) also before a CJK ideograph; ``prefix`` (a prompt) put before
    a right window. ``None`` when ``text`` is not longer than ``size`` or has fewer than three
    such cuts there."""
    if len(text) <= size:
        return None
    if side == "right":
        points = _AFTER_WORD_OR_IDEOGRAPH if ideographs else _AFTER_WORD
        cuts = [match.start() for match in points.finditer(text, 0, size + 1)]
        return Window(prefix + text[:cuts[-1]], len(prefix) + cuts[-3], side) if len(cuts) >= 3 else None
    points = _BEFORE_WORD_OR_IDEOGRAPH if ideographs else _BEFORE_WORD
    cuts = [match.start() for match in itertools.islice(points.finditer(text, len(text) - size), 3)]
    return Window(text[cuts[0]:], cuts[2] - cuts[0], side) if len(cuts) == 3 else None


def cuttable(tokenizer: Any) -> bool:
    """Whether :func:`cut` windows of ``tokenizer``'s input can be exact: a fast tokenizer with a
    per-pre-token model (WordPiece, WordLevel, Unigram, BPE without dropout), local normalizers,
    pre-tokenizers that split at spaces, and added tokens without inner spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    kind = type(backend.model).__name__
    model_ok = kind in ("WordPiece", "WordLevel", "Unigram") or (kind == "BPE" and not backend.model.dropout)
    return (model_ok and _normalizer_ok(_spec(backend.normalizer)) and _pre_tokenizer_ok(_spec(backend.pre_tokenizer))
            and all(_added_ok(token.content) for token in backend.get_added_tokens_decoder().values()))


def isolates_ideographs(tokenizer: Any) -> bool:
    """Whether a :func:`cuttable` ``tokenizer``'s normalizer puts spaces around every CJK
    ideograph (BERT's ``handle_chinese_chars``): each is then a word of its own, and a text
    without spaces (Chinese, Japanese kanji) can be cut before any of them."""
    spec = _spec(tokenizer.backend_tokenizer.normalizer)
    parts = spec.get("normalizers", ()) if spec and spec.get("type") == "Sequence" else (spec,)
    return any(part and part.get("type") == "BertNormalizer" and part.get("handle_chinese_chars", True)
               for part in parts)


def _spec(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's settings as its JSON (``None`` stays ``None``)."""
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_ok(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_normalizer_ok(part) for part in spec.get("normalizers", ()))
    if kind == "Replace":  # runs of spaces to one space, or a literal inside words
        pattern, content = spec.get("pattern") or {}, spec.get("content", "")
        if _pattern(pattern) in _SPACE_PATTERNS:
            return content == " "
        return "String" in pattern and _no_space(pattern["String"]) and _no_space(content)
    return kind in _LOCAL_NORMALIZERS


def _pre_tokenizer_ok(spec: Mapping[str, Any] | None) -> bool:
    """One splitting pre-tokenizer (in a ``Sequence``, the others refining only)."""
    if spec is None:
        return False
    parts = spec.get("pretokenizers", ()) if spec.get("type") == "Sequence" else (spec,)
    splitting = [part for part in parts if _splits_at_spaces(part)]
    return bool(splitting) and all(part in splitting or _refines(part) for part in parts)


def _splits_at_spaces(spec: Mapping[str, Any]) -> bool:
    kind = spec.get("type")
    if kind == "ByteLevel":
        return bool(spec.get("use_regex", True))
    if kind == "Metaspace":
        return bool(spec.get("split", True))
    if kind == "Split":
        pattern = _pattern(spec.get("pattern") or {})
        return not spec.get("invert") and (pattern in _WORD_SPLIT_PATTERNS or pattern == " ")
    return kind in _SPLITTING_PRE_TOKENIZERS


def _refines(spec: Mapping[str, Any]) -> bool:
    kind = spec.get("type")
    if kind == "Split":  # a literal without spaces splits inside words only
        pattern = spec.get("pattern") or {}
        return not spec.get("invert") and "String" in pattern and _no_space(pattern["String"])
    return kind in _REFINING_PRE_TOKENIZERS


def _pattern(spec: Mapping[str, Any]) -> str | None:
    return spec.get("String", spec.get("Regex"))


def _no_space(text: str) -> bool:
    return not any(char.isspace() for char in text)


def _added_ok(content: str) -> bool:
    """An added token is matched before pre-tokenization: one with inner spaces could span a cut."""
    return _no_space(content) or content.isspace()
