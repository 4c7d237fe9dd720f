"""Turns user inputs (text or token ids) into validated ``prompt_token_ids``."""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from numbers import Integral, Number
from typing import Any

import attrs
import numpy as np
from tokenizers import normalizers
from transformers import PreTrainedTokenizerBase

from poolrunner.core.config import default_max_input_chars
from poolrunner.core.errors import (
    InputTooLongError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    TokenOutOfVocabularyError,
)
from poolrunner.core.inputs import cutting
from poolrunner.core.memory import TRIM_AFTER_CHARS, release_memory
from poolrunner.core.types import ModelConfig, PromptInput, TruncationSide
from poolrunner.core.validators import check_text, shown

LOCK_CHARS = 65_536
"""Most characters tokenized under one hold of the tokenizer lock (about 20-60 ms on one CPU
core): a request with megabytes of text lets other requests tokenize between its pieces."""


class InputProcessor:
    """Applies prompts, tokenization and truncation with sentence-transformers' and vLLM's rules.

    * Text is tokenized as the model's tokenizer does, special tokens included; it is not
      stripped (sentence-transformers strips, so compare against it with stripped text).
    * A prompt is a literal prefix of the text: ``prompt``, or the model's named prompt
      ``prompt_name`` (``config_sentence_transformers.json``), else its ``default_prompt_name``.
    * :attr:`~poolrunner.core.types.ModelConfig.lowercase` (sentence-transformers'
      ``do_lower_case``) lowercases text, prompt included, inside the tokenizer, which is changed
      for good as sentence-transformers changes its own (:func:`lowercase_text`); token ids are
      taken as given.
    * ``truncate_prompt_tokens``: ``None`` never truncates (a longer input is an error naming
      both lengths); ``k`` keeps ``k`` tokens, special tokens included; ``-1`` keeps the model
      maximum. ``truncation_side`` picks which end is kept (``None``: the folder's own, its
      ``tokenizer_config.json``'s, as sentence-transformers keeps; ``right`` unless it says
      ``left``). For text, ``k`` must cover the
      special tokens the tokenizer adds (2 for BERT's ``[CLS] ... [SEP]``, 3 for a BERT pair):
      transformers silently returns the untruncated input below that, so it is an error here.
      Every truncated prompt is checked again afterwards (at most ``k`` tokens).
    * A text longer than ``max_input_chars`` characters is refused before it is tokenized, unless
      it is truncated and the tokens kept can be read from a window of it (:mod:`.cutting`):
      truncating a text reads only such a window whenever the tokenizer allows, so megabytes are
      never tokenized to keep a few hundred tokens. A (text, text_pair) pair's document is read
      in such a window when its query fits in the tokens kept (:meth:`_document_windows`);
      otherwise both texts are read whole: how many tokens each keeps depends on both lengths.

    The tokenizer's truncation settings are state of its one Rust object, set by every call: a
    call from another thread in between would tokenize with the other call's settings, or fail
    ("Already borrowed": the Rust object refuses a change while another thread reads it). So each
    call sets and uses them under one lock, held for at most :data:`LOCK_CHARS` characters at a
    time: a large batch is tokenized in pieces, and other callers' texts go in between.

    :param max_input_chars: Longest text accepted, characters; ``None``:
        :func:`~poolrunner.core.config.default_max_input_chars` of ``max_model_len``.
    :raises ModelLoadError: for ``lowercase`` with a tokenizer that has no ``tokenizers`` pipeline.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_config: ModelConfig, *,
                 max_input_chars: int | None = None) -> None:
        if model_config.lowercase:
            lowercase_text(tokenizer, model_config.name)
        self.tokenizer = tokenizer
        # The folder's own side (tokenizer_config.json), read before any call sets the tokenizer's.
        self.truncation_side: TruncationSide = "left" if tokenizer.truncation_side == "left" else "right"
        self.model_config = model_config
        self.max_input_chars = max_input_chars or default_max_input_chars(model_config.max_model_len)
        self.vocab_size = int(model_config.hf_config.get("vocab_size") or len(tokenizer))
        # Tokens added to the tokenizer past the embedding matrix (not resized): text can hold them.
        self.ids_past_vocab = len(tokenizer) > self.vocab_size
        # Special tokens the tokenizer adds to one text, and to a (text, text_pair) pair.
        self.num_special_tokens = {pair: _num_special_tokens(tokenizer, pair) for pair in (False, True)}
        self.cuttable = cutting.cuttable(tokenizer)
        self.cut_at_ideographs = self.cuttable and cutting.isolates_ideographs(tokenizer)
        self._lock = threading.Lock()

    def without_length_limit(self) -> InputProcessor:
        """The same tokenizer, prompts and checks with no ``max_model_len`` limit, for inputs a
        caller checks against a limit of its own (:class:`~poolrunner.core.frontend.chunking.LongInputs`).
        The lock is shared: the tokenizer's truncation side is state of the one tokenizer."""
        other = InputProcessor(self.tokenizer, attrs.evolve(self.model_config, max_model_len=sys.maxsize),
                               max_input_chars=self.max_input_chars)
        other.truncation_side, other._lock = self.truncation_side, self._lock
        return other

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str:
        """The literal prefix to prepend to every text.

        :raises InvalidRequestError: if ``prompt_name`` is unknown (both given is
            :class:`~poolrunner.core.frontend.requests.Tokenization`'s error).
        """
        if prompt is not None:
            return prompt
        name = prompt_name or self.model_config.default_prompt_name
        if name is None:
            return ""
        prompts = self.model_config.prompts
        if name not in prompts:
            raise InvalidRequestError(
                f"prompt_name {name!r} is not defined by model {self.model_config.name}; "
                f"defined: {sorted(prompts)}"
            )
        return prompts[name]

    def check_truncation(self, truncate_prompt_tokens: int | None, *, pair: bool | None = False) -> int | None:
        """The number of tokens to keep, or ``None`` for no truncation.

        :param pair: What is truncated: single texts (``False``), ``(text, text_pair)`` pairs
            (``True``), or token ids only (``None``: the tokenizer adds nothing, so no minimum).
        An integer already (:class:`~poolrunner.core.frontend.requests.Tokenization` checks the type).

        :raises InvalidRequestError: for 0, values below -1, values above ``max_model_len``, or
            (text) fewer tokens than the special tokens the tokenizer adds to every input
            (``tokenizer.num_special_tokens_to_add``): transformers would ignore such a limit.
        """
        limit = self.model_config.max_model_len
        if truncate_prompt_tokens is None:
            return None
        keep = limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        minimum = 0 if pair is None else self.num_special_tokens[pair]
        if not 1 <= keep <= limit:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={truncate_prompt_tokens} is out of range: use -1 (the model "
                f"maximum) or {max(minimum, 1)}..{limit} (max_model_len of {self.model_config.name})",
                param="truncate_prompt_tokens",
            )
        if keep < minimum:
            every = "(text, text_pair) pair" if pair else "input"
            if truncate_prompt_tokens == -1:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens=-1 keeps max_model_len={limit} tokens, below the {minimum} special "
                    f"tokens model {self.model_config.name} adds to every {every}; load it with max_model_len "
                    f"of at least {minimum}", param="truncate_prompt_tokens",
                )
            raise InvalidRequestError(
                f"truncate_prompt_tokens={truncate_prompt_tokens} is below the {minimum} special tokens model "
                f"{self.model_config.name} adds to every {every}; use at least {minimum} (or -1 for the model "
                "maximum)", param="truncate_prompt_tokens",
            )
        return keep

    def encode(
        self,
        inputs: Sequence[PromptInput],
        *,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide | None = None,
        add_special_tokens: bool = True,
        check_vocabulary: bool = True,
    ) -> list[tuple[int, ...]]:
        """Tokenize ``inputs`` and check each against the model's limits.

        :param add_special_tokens: ``False`` tokenizes text without the special tokens the
            tokenizer adds (vLLM's ``add_special_tokens``; e.g. no ``[CLS]``/``[SEP]``), so
            ``truncate_prompt_tokens`` then has no minimum. Token-id inputs are taken as given.
        :param check_vocabulary: ``False`` answers a text's ids even where the tokenizer numbers
            a token past the model's vocabulary, or gives it none (a tokenize request: the model
            never runs, and ``[]`` is an answer).
        :returns: One ``prompt_token_ids`` tuple per input, in order.
        :raises InvalidRequestError: naming the input's index and the limit it breaks (a text over
            ``max_input_chars`` characters: its length, the limit and the flag that sets it).
        """
        texts = {i: item for i, item in enumerate(inputs) if isinstance(item, str)}
        for index, text in texts.items():
            check_text(text, f"input {index}", param="input")
        keep = self.check_truncation(truncate_prompt_tokens, pair=False if texts and add_special_tokens else None)
        prefix = self.resolve_prompt(prompt, prompt_name)
        truncation_side = truncation_side or self.truncation_side
        by_index = self._tokenize(texts, prefix, keep, truncation_side, add_special_tokens)
        results = []
        for index, item in enumerate(inputs):
            if index in by_index:
                ids = by_index[index]
            elif prefix:
                raise InvalidRequestError(f"input {index}: a prompt applies to text, not to token ids")
            else:
                ids = self._check_token_ids(index, item, keep, truncation_side)
            if ids or check_vocabulary:
                ids = self._check_length(index, ids, keep)
            results.append(self._check_vocabulary(index, ids) if check_vocabulary and index in by_index else ids)
        return results

    def encode_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide | None = None,
        add_special_tokens: bool = True,
    ) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
        """Tokenize (query, document) pairs as the model's tokenizer pairs them.

        Truncation uses the tokenizer's pair strategy (``longest_first``, special tokens kept),
        as sentence-transformers' CrossEncoder does. ``add_special_tokens=False`` joins the two
        texts' tokens without the special tokens (no truncation minimum then).

        :returns: ``(prompt_token_ids, token_type_ids)`` per pair; ``token_type_ids`` is ``None``
            for models without token types (``type_vocab_size < 2``, e.g. RoBERTa).
        :raises InvalidRequestError: naming the pair's index and the limit it breaks.
        """
        keep = self.check_truncation(truncate_prompt_tokens, pair=True if add_special_tokens else None)
        truncation_side = truncation_side or self.truncation_side
        for index, pair in enumerate(pairs):
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
                raise InvalidRequestError(f"pair {index}: expected two texts (query, document), got {shown(pair)}")
            for side, text in enumerate(pair):
                check_text(text, f"pair {index}, text {side + 1}", param="input")
        windows: dict[int, str] = {}
        if self.cuttable and keep is not None:
            budget = keep - (self.num_special_tokens[True] if add_special_tokens else 0)
            windows = self._document_windows(pairs, budget, truncation_side)
        for index, pair in enumerate(pairs):
            for side, text in enumerate(pair[:1] if index in windows else pair):
                self.check_chars(text, f"pair {index}, text {side + 1}", _PAIR_ADVICE)
        pairs = [(query, windows.get(index, document)) for index, (query, document) in enumerate(pairs)]
        results = []
        for chunk in _chunks(pairs, lambda pair: len(pair[0]) + len(pair[1])):
            encoded = self._call(truncation_side, [query for query, _ in chunk], [document for _, document in chunk],
                                 add_special_tokens=add_special_tokens, truncation=keep is not None,
                                 max_length=keep, return_attention_mask=False, return_token_type_ids=True)
            with_types = self.model_config.type_vocab_size >= 2 and "token_type_ids" in encoded
            if not with_types:
                self._check_one_type(encoded)
            types = encoded["token_type_ids"] if with_types else [None] * len(chunk)
            for ids, row_types in zip(encoded["input_ids"], types, strict=True):
                index = len(results)
                results.append((self._check_vocabulary(index, self._check_length(index, tuple(ids), keep)),
                                None if row_types is None else tuple(row_types)))
        self._trim(sum(len(query) + len(document) for query, document in pairs))
        return results

    def _document_windows(self, pairs: Sequence[tuple[str, str]], budget: int,
                          side: TruncationSide) -> dict[int, str]:
        """Windows (:mod:`.cutting`) of the documents over ``max_input_chars`` characters that a
        pair truncated to ``budget`` text tokens keeps exactly, by pair index.

        ``longest_first`` (the tokenizers library's) decides how many tokens each side keeps
        from the query's length and, of the document's, only from whether it passes the budget and
        the query's length. So where the query fits in the budget, a document window whose first
        ``budget + 1`` tokens are certain keeps what the whole document keeps; a longer query
        needs the whole document's length, and its pair is read whole.
        """
        long = {index: pair for index, pair in enumerate(pairs)
                if len(pair[1]) > self.max_input_chars >= len(pair[0])}
        if not long:
            return {}
        queries = self._call(side, [query for query, _ in long.values()], add_special_tokens=False,
                             return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        documents = {index: document for (index, (_, document)), ids in zip(long.items(), queries, strict=True)
                     if len(ids) <= budget}
        return {index: text for index, (text, _) in self._windowed(documents, "", budget + 1, side, False).items()}

    def _check_one_type(self, encoded: Any) -> None:
        """:raises InvalidRequestError: where the tokenizer marks a document as type 1 for a model
        that embeds one token type: transformers (and ``CrossEncoder``) fail on its index, and
        dropping the types would score what neither computes. Models without a token-type input
        (``type_vocab_size`` 0: DistilBERT, decoders) or whose tokenizer sends none (RoBERTa) pass."""
        if (self.model_config.type_vocab_size == 1 and "token_type_ids" in self.tokenizer.model_input_names
                and any(any(row) for row in encoded.get("token_type_ids", ()))):
            raise InvalidRequestError(
                f"model {self.model_config.name} embeds one token type (type_vocab_size 1), but its tokenizer marks "
                "a pair's document as type 1, which transformers cannot embed: this model cannot score pairs")

    def check_chars(self, text: str, where: str, advice: str = "shorten it", *, truncation_helps: bool = False) -> None:
        """:raises InputTooLongError: for ``text`` over ``max_input_chars`` characters, naming
        ``where``, its length, the limit, its flag and ``advice``."""
        if len(text) > self.max_input_chars:
            raise InputTooLongError(
                f"{where} has {len(text)} characters, more than the limit of {self.max_input_chars} per input "
                f"(max_input_chars, the --max-input-chars flag); {advice}", param="input",
                truncation_helps=truncation_helps)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The text of a chat conversation, rendered with the tokenizer's own chat template
        (``tokenizer.apply_chat_template(..., tokenize=False)``), as vLLM renders the ``messages``
        of its pooling requests. Tokenize the text with ``add_special_tokens=False`` (vLLM's
        default for chat): the template writes the special tokens it wants.

        :param messages: ``{"role", "content", ...}`` mappings; ``content`` a string.
        :param chat_template_kwargs: Extra variables for the template (e.g. ``enable_thinking``);
            none may be a parameter of ``apply_chat_template`` itself.
        :param tools: Tool definitions (OpenAI's ``{"type": "function", "function": {...}}``) the
            template renders, as ``apply_chat_template(tools=...)`` does (vLLM's tokenize).
        :raises InvalidRequestError: when the tokenizer has no chat template, both
            ``add_generation_prompt`` and ``continue_final_message`` are set, a variable is
            reserved, or the template fails on these messages (its message is kept).
        """
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                f"the tokenizer of model {self.model_config.name} has no chat template, so messages cannot be "
                "rendered; send the text as input instead, or start the server with --chat-template"
            )
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true")
        variables = dict(chat_template_kwargs or {})
        reserved = sorted(set(variables) & _CHAT_TEMPLATE_PARAMETERS)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}: "
                                      "it is an argument of the rendering, not a template variable")
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(message) for message in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=[dict(tool) for tool in tools] if tools else None,
                **variables,
            )
        except Exception as exc:  # jinja2's TemplateError, transformers' ValueError: the messages don't fit
            raise InvalidRequestError(f"the chat template of model {self.model_config.name} cannot render these "
                                      f"messages: {exc}") from exc
        if not isinstance(text, str):
            raise InvalidRequestError(f"the chat template of model {self.model_config.name} did not render a text")
        return text

    def _tokenize(self, texts: Mapping[int, str], prefix: str, keep: int | None, side: TruncationSide,
                  add_special_tokens: bool) -> dict[int, tuple[int, ...]]:
        """``prefix + text``'s token ids by input index: from a window when truncation allows
        (:meth:`_windowed`), else from the whole text within ``max_input_chars``.

        :raises InvalidRequestError: for a text read whole that is over ``max_input_chars``.
        """
        windows = self._windowed(texts, prefix, keep, side, add_special_tokens) if self.cuttable and keep else {}
        found = {index: ids for index, (_, ids) in windows.items()}
        whole = {index: text for index, text in texts.items() if index not in found}
        for index, text in whole.items():
            if len(text) > self.max_input_chars:
                helps = keep is None and self._truncation_helps(text, prefix, side, add_special_tokens)
                self.check_chars(text, f"input {index}", self._advice(keep, side, helps), truncation_helps=helps)
        rows = self._encode([prefix + text for text in whole.values()], keep, side, add_special_tokens)
        found.update(zip(whole, (ids for ids, _ in rows), strict=True))
        return found

    def _windowed(self, texts: Mapping[int, str], prefix: str, keep: int, side: TruncationSide,
                  add_special_tokens: bool) -> dict[int, tuple[str, tuple[int, ...]]]:
        """The window's text and the ``keep`` token ids of the texts longer than a window whose
        window proved exact (:class:`~.cutting.Window`), by input index; a window too short is
        retried at ``max_input_chars`` characters."""
        found: dict[int, tuple[str, tuple[int, ...]]] = {}
        for size in sorted({min(cutting.first_window(keep), self.max_input_chars), self.max_input_chars}):
            cuts = {index: cutting.cut(text, size, side, prefix, ideographs=self.cut_at_ideographs)
                    for index, text in texts.items() if index not in found}
            windows = {index: window for index, window in cuts.items() if window is not None}
            rows = self._encode([window.text for window in windows.values()], keep, side, add_special_tokens,
                                spans=True)
            for (index, window), (ids, spans) in zip(windows.items(), rows, strict=True):
                if window.certain(ids, spans["offset_mapping"], spans["special_tokens_mask"], keep):
                    found[index] = window.text, ids
        return found

    def _truncation_helps(self, text: str, prefix: str, side: TruncationSide, add_special_tokens: bool) -> bool:
        """Whether truncating ``text`` (over ``max_input_chars``) to the model maximum would read
        it: its window proves exact (:meth:`_windowed`). Asked only of a text being refused."""
        keep = self.model_config.max_model_len
        return self.cuttable and bool(self._windowed({0: text}, prefix, keep, side, add_special_tokens))

    def _advice(self, keep: int | None, side: TruncationSide, truncation_helps: bool) -> str:
        """What to do about a text over ``max_input_chars`` read whole (:meth:`check_chars`):
        truncation is advised only where :meth:`_truncation_helps` (it would otherwise lead to a
        second refusal)."""
        if truncation_helps:
            return "shorten it, or pass truncate_prompt_tokens to read only the part kept"
        if not self.cuttable:
            return "shorten it" if keep is None else (
                f"shorten it (the tokenizer of {self.model_config.name} reads whole texts, even to truncate them)")
        part = "first" if side == "right" else "last"
        tokens = keep if keep is not None else self.model_config.max_model_len
        return (f"shorten it or raise the limit: truncating reads only its {part} {self.max_input_chars} "
                f"characters, and they have no space between words at which {tokens} tokens can be cut exactly")

    def _encode(self, texts: list[str], keep: int | None, side: TruncationSide, add_special_tokens: bool, *,
                spans: bool = False) -> list[tuple[tuple[int, ...], dict[str, Any]]]:
        """Each text's token ids and, with ``spans``, its ``offset_mapping`` and
        ``special_tokens_mask``; tokenized in pieces of at most :data:`LOCK_CHARS` characters."""
        rows: list[tuple[tuple[int, ...], dict[str, Any]]] = []
        for chunk in _chunks(texts, len):
            encoded = self._call(side, chunk, add_special_tokens=add_special_tokens, truncation=keep is not None,
                                 max_length=keep, return_attention_mask=False, return_token_type_ids=False,
                                 return_offsets_mapping=spans, return_special_tokens_mask=spans)
            extra = [{name: encoded[name][row] for name in ("offset_mapping", "special_tokens_mask")} if spans else {}
                     for row in range(len(chunk))]
            rows.extend(zip(map(tuple, encoded["input_ids"]), extra, strict=True))
        self._trim(sum(map(len, texts)))
        return rows

    def _call(self, side: TruncationSide, *texts: list[str], **options: Any) -> Any:
        """``tokenizer(*texts, **options)`` truncating on ``side``, under the lock (truncation
        settings are state of the one tokenizer; the call's own ``truncation_side`` is ignored)."""
        with self._lock:
            self.tokenizer.truncation_side = side
            return self.tokenizer(*texts, verbose=False, **options)

    @staticmethod
    def _trim(chars: int) -> None:
        """Hand freed memory back to the system after tokenizing ``chars`` >= ``TRIM_AFTER_CHARS``."""
        if chars >= TRIM_AFTER_CHARS:
            release_memory()

    def _check_token_ids(
        self, index: int, item: object, keep: int | None, side: TruncationSide
    ) -> tuple[int, ...]:
        if isinstance(item, np.ndarray) and item.ndim == 1:
            item = item.tolist()
        position = None
        if isinstance(item, list | tuple):  # one pass on the good path; the error path looks again
            position = next((p for p, t in enumerate(item) if not isinstance(t, Integral) or isinstance(t, bool)), None)
        if isinstance(item, list) and item and all(isinstance(t, str) for t in item):
            raise InvalidRequestError(f"input {index}: {shown(item)} is a list of texts, not one input: send texts as "
                                      "one flat list (a (text, text_pair) pair is a tuple in Python, a two-text "
                                      "list where the route reads pairs: /classify, /pooling)", param="input")
        if not isinstance(item, list | tuple) or (
                position is not None and not all(t is None or isinstance(t, Number) for t in item)):
            raise InvalidRequestError(f"input {index}: expected a text, a list of token ids or a (text, text_pair) "
                                      f"pair, got {shown(item)}", param="input")
        if position is not None:
            raise InvalidRequestError(f"input {index}: the token id at position {position} is "
                                      f"{shown(item[position])}, not an integer", param="input")
        bad = [t for t in item if not 0 <= t < self.vocab_size]
        if bad:
            raise TokenOutOfVocabularyError(
                f"input {index}: token id {shown(bad[0])} is outside the vocabulary [0, {self.vocab_size})",
                param="input")
        ids = tuple(int(t) for t in item)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:] if side == "left" else ids[:keep]
        return ids

    def _check_vocabulary(self, index: int, ids: tuple[int, ...]) -> tuple[int, ...]:
        """``ids`` (a text's), unless the tokenizer gave a token an id past the model's vocabulary.

        :raises InvalidRequestError: naming the token and the vocabulary (a token added to the
            tokenizer without resizing the embeddings: transformers cannot embed it).
        """
        if self.ids_past_vocab and max(ids) >= self.vocab_size:
            token = max(ids)
            raise InvalidRequestError(
                f"input {index}: its token {self.tokenizer.convert_ids_to_tokens(token)!r} has the id {token}, outside "
                f"the model's vocabulary [0, {self.vocab_size}) (config.json vocab_size: a token added to the "
                "tokenizer without resizing the model's embeddings)", param="input")
        return ids

    def _check_length(self, index: int, ids: tuple[int, ...], keep: int | None) -> tuple[int, ...]:
        """``ids`` if it has 1..``keep`` tokens (truncated) or 1..``max_model_len`` (not truncated);
        the kept length is checked, not assumed from the tokenizer.

        :raises InvalidRequestError: naming the input's index, its length and the limit.
        """
        limit = self.model_config.max_model_len
        if not ids:
            raise InvalidRequestError(f"input {index} is empty: it has no tokens to pool", param="input")
        if keep is not None and len(ids) > keep:
            raise InvalidRequestError(
                f"input {index} still has {len(ids)} tokens after truncation to {keep} (the tokenizer of "
                f"{self.model_config.name} did not truncate it); shorten it"
            )
        if len(ids) > limit:
            raise PromptTooLongError(
                f"input {index} has {len(ids)} tokens, more than the maximum of {limit} "
                f"(max_model_len of {self.model_config.name}); shorten it or pass "
                "truncate_prompt_tokens (-1 keeps the maximum)"
            )
        return ids


def lowercase_text(tokenizer: PreTrainedTokenizerBase, model: str) -> None:
    """Make ``tokenizer`` lowercase every text it reads, as sentence-transformers' Transformer
    module does for ``do_lower_case``: a ``Lowercase`` normalizer put first in the tokenizer's
    pipeline, unless its normalizer already is one or a ``Sequence`` holding one. So the prompt and
    the text are lowercased together, both texts of a pair too, by the tokenizer's own rules (added
    tokens it does not normalize, such as its special tokens, are matched before it).

    :raises ModelLoadError: naming ``model``, for a tokenizer without a ``tokenizers`` pipeline
        (``backend_tokenizer``).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelLoadError(
            f"{model}: do_lower_case=true (sentence_bert_config.json) needs a fast tokenizer (tokenizer.json); "
            f"{type(tokenizer).__name__} has none"
        )
    normalizer = backend.normalizer
    parts = list(normalizer) if isinstance(normalizer, normalizers.Sequence) else [normalizer]
    if any(isinstance(part, normalizers.Lowercase) for part in parts):
        return
    backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), *(part for part in parts if part is not None)])


_CHAT_TEMPLATE_PARAMETERS = frozenset(
    name for name in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    if name not in ("self", "kwargs")
) | {"messages"}
"""Names ``chat_template_kwargs`` may not use: the arguments of ``apply_chat_template`` itself
(and ``messages``, the conversation the template reads)."""


_PAIR_ADVICE = ("shorten it (a pair is read whole unless it is truncated, its query fits in the tokens kept and "
                "its document can be cut at a space)")


def _chunks(items: Sequence[Any], size: Callable[[Any], int]) -> Iterator[Sequence[Any]]:
    """Consecutive runs of ``items`` of at most :data:`LOCK_CHARS` characters by ``size(item)``
    (one item alone when it is longer)."""
    start, total = 0, 0
    for end, item in enumerate(items):
        if end > start and total + size(item) > LOCK_CHARS:
            yield items[start:end]
            start, total = end, 0
        total += size(item)
    if start < len(items):
        yield items[start:]


def _num_special_tokens(tokenizer: PreTrainedTokenizerBase, pair: bool) -> int:
    """``tokenizer.num_special_tokens_to_add(pair)``; 0 for a tokenizer that cannot say (or pair)."""
    try:
        return int(tokenizer.num_special_tokens_to_add(pair=pair))
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return 0
