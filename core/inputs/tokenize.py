"""Turns user inputs (text or token ids) into validated ``prompt_token_ids``."""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any

import attrs
import numpy as np
from transformers import PreTrainedTokenizerBase

from poolrunner.core.errors import InvalidRequestError, PromptTooLongError
from poolrunner.core.types import ModelConfig, TruncationSide

PromptInput = str | Sequence[int]
"""A text, or an already tokenized prompt (special tokens included)."""


class InputProcessor:
    """Applies prompts, tokenization and truncation with sentence-transformers' and vLLM's rules.

    * Text is tokenized as the model's tokenizer does, special tokens included; it is not
      stripped (sentence-transformers strips, so compare against it with stripped text).
    * A prompt is a literal prefix of the text: ``prompt``, or the model's named prompt
      ``prompt_name`` (``config_sentence_transformers.json``), else its ``default_prompt_name``.
    * ``truncate_prompt_tokens``: ``None`` never truncates (a longer input is an error naming
      both lengths); ``k`` keeps ``k`` tokens, special tokens included; ``-1`` keeps the model
      maximum. ``truncation_side`` picks which end is kept. For text, ``k`` must cover the
      special tokens the tokenizer adds (2 for BERT's ``[CLS] ... [SEP]``, 3 for a BERT pair):
      transformers silently returns the untruncated input below that, so it is an error here.
      Every truncated prompt is checked again afterwards (at most ``k`` tokens).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_config: ModelConfig) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.vocab_size = int(model_config.hf_config.get("vocab_size") or len(tokenizer))
        # Special tokens the tokenizer adds to one text, and to a (text, text_pair) pair.
        self.num_special_tokens = {pair: _num_special_tokens(tokenizer, pair) for pair in (False, True)}
        self._lock = threading.Lock()

    def without_length_limit(self) -> InputProcessor:
        """The same tokenizer, prompts and checks with no ``max_model_len`` limit, for inputs a
        caller checks against a limit of its own (:class:`~poolrunner.core.chunking.LongInputs`).
        The lock is shared: the tokenizer's truncation side is state of the one tokenizer."""
        other = InputProcessor(self.tokenizer, attrs.evolve(self.model_config, max_model_len=sys.maxsize))
        other._lock = self._lock
        return other

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str:
        """The literal prefix to prepend to every text.

        :raises InvalidRequestError: if both are given or ``prompt_name`` is unknown.
        """
        if prompt is not None and prompt_name is not None:
            raise InvalidRequestError("pass either prompt or prompt_name, not both")
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
        :raises InvalidRequestError: for 0, values below -1, values above ``max_model_len``, or
            (text) fewer tokens than the special tokens the tokenizer adds to every input
            (``tokenizer.num_special_tokens_to_add``): transformers would ignore such a limit.
        """
        limit = self.model_config.max_model_len
        if truncate_prompt_tokens is None:
            return None
        if isinstance(truncate_prompt_tokens, bool) or not isinstance(truncate_prompt_tokens, int):
            raise InvalidRequestError(f"truncate_prompt_tokens must be an integer, got {truncate_prompt_tokens!r}")
        keep = limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        minimum = 0 if pair is None else self.num_special_tokens[pair]
        if not 1 <= keep <= limit:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={truncate_prompt_tokens} is out of range: use -1 (the model "
                f"maximum) or {max(minimum, 1)}..{limit} (max_model_len of {self.model_config.name})"
            )
        if keep < minimum:
            every = "(text, text_pair) pair" if pair else "input"
            if truncate_prompt_tokens == -1:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens=-1 keeps max_model_len={limit} tokens, below the {minimum} special "
                    f"tokens model {self.model_config.name} adds to every {every}; load it with max_model_len "
                    f"of at least {minimum}"
                )
            raise InvalidRequestError(
                f"truncate_prompt_tokens={truncate_prompt_tokens} is below the {minimum} special tokens model "
                f"{self.model_config.name} adds to every {every}; use at least {minimum} (or -1 for the model "
                "maximum)"
            )
        return keep

    def encode(
        self,
        inputs: Sequence[PromptInput],
        *,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        add_special_tokens: bool = True,
    ) -> list[tuple[int, ...]]:
        """Tokenize ``inputs`` and check each against the model's limits.

        :param add_special_tokens: ``False`` tokenizes text without the special tokens the
            tokenizer adds (vLLM's ``add_special_tokens``; e.g. no ``[CLS]``/``[SEP]``), so
            ``truncate_prompt_tokens`` then has no minimum. Token-id inputs are taken as given.
        :returns: One ``prompt_token_ids`` tuple per input, in order.
        :raises InvalidRequestError: naming the input's index and the limit it breaks.
        """
        if truncation_side not in ("left", "right"):
            raise InvalidRequestError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
        texts = {i: item for i, item in enumerate(inputs) if isinstance(item, str)}
        for index, text in texts.items():
            check_text(text, f"input {index}")
        keep = self.check_truncation(truncate_prompt_tokens, pair=False if texts and add_special_tokens else None)
        prefix = self.resolve_prompt(prompt, prompt_name)
        encoded = self._tokenize([prefix + text for text in texts.values()], keep, truncation_side,
                                 add_special_tokens)
        by_index = dict(zip(texts, encoded, strict=True))
        results = []
        for index, item in enumerate(inputs):
            if index in by_index:
                ids = by_index[index]
            elif prefix:
                raise InvalidRequestError(f"input {index}: a prompt applies to text, not to token ids")
            else:
                ids = self._check_token_ids(index, item, keep, truncation_side)
            results.append(self._check_length(index, ids, keep))
        return results

    def encode_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
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
        if truncation_side not in ("left", "right"):
            raise InvalidRequestError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
        keep = self.check_truncation(truncate_prompt_tokens, pair=True if add_special_tokens else None)
        for index, pair in enumerate(pairs):
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
                raise InvalidRequestError(f"pair {index}: expected two texts (query, document), got {pair!r:.80}")
            for side, text in enumerate(pair):
                check_text(text, f"pair {index}, text {side + 1}")
        with self._lock:  # truncation_side is tokenizer state (the call argument is ignored)
            self.tokenizer.truncation_side = truncation_side
            encoded = self.tokenizer(
                [query for query, _ in pairs], [document for _, document in pairs],
                add_special_tokens=add_special_tokens, truncation=keep is not None, max_length=keep,
                return_attention_mask=False, return_token_type_ids=True, verbose=False,
            )
        with_types = self.model_config.type_vocab_size >= 2 and "token_type_ids" in encoded
        results = []
        for index, ids in enumerate(encoded["input_ids"]):
            types = tuple(encoded["token_type_ids"][index]) if with_types else None
            results.append((self._check_length(index, tuple(ids), keep), types))
        return results

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The text of a chat conversation, rendered with the tokenizer's own chat template
        (``tokenizer.apply_chat_template(..., tokenize=False)``), as vLLM renders the ``messages``
        of its pooling requests. Tokenize the text with ``add_special_tokens=False`` (vLLM's
        default for chat): the template writes the special tokens it wants.

        :param messages: ``{"role", "content", ...}`` mappings; ``content`` a string.
        :param chat_template_kwargs: Extra variables for the template (e.g. ``enable_thinking``);
            none may be a parameter of ``apply_chat_template`` itself.
        :raises InvalidRequestError: when the tokenizer has no chat template, both
            ``add_generation_prompt`` and ``continue_final_message`` are set, a variable is
            reserved, or the template fails on these messages (its message is kept).
        """
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                f"the tokenizer of model {self.model_config.name} has no chat template, so messages cannot be "
                "rendered; send the text as input instead"
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
                continue_final_message=continue_final_message, **variables,
            )
        except Exception as exc:  # jinja2's TemplateError, transformers' ValueError: the messages don't fit
            raise InvalidRequestError(f"the chat template of model {self.model_config.name} cannot render these "
                                      f"messages: {exc}") from exc
        if not isinstance(text, str):
            raise InvalidRequestError(f"the chat template of model {self.model_config.name} did not render a text")
        return text

    def _tokenize(self, texts: list[str], keep: int | None, side: TruncationSide,
                  add_special_tokens: bool = True) -> list[tuple[int, ...]]:
        if not texts:
            return []
        with self._lock:  # truncation_side is tokenizer state (the call argument is ignored)
            self.tokenizer.truncation_side = side
            encoded = self.tokenizer(
                texts, add_special_tokens=add_special_tokens, truncation=keep is not None, max_length=keep,
                return_attention_mask=False, return_token_type_ids=False, verbose=False,
            )
        return [tuple(ids) for ids in encoded["input_ids"]]

    def _check_token_ids(
        self, index: int, item: object, keep: int | None, side: TruncationSide
    ) -> tuple[int, ...]:
        if isinstance(item, np.ndarray) and item.ndim == 1:
            item = item.tolist()
        if not isinstance(item, Sequence) or not all(
            isinstance(t, Integral) and not isinstance(t, bool) for t in item
        ):
            raise InvalidRequestError(f"input {index}: expected a string or a list of token ids, got {item!r:.80}")
        bad = [t for t in item if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"input {index}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        ids = tuple(int(t) for t in item)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:] if side == "left" else ids[:keep]
        return ids

    def _check_length(self, index: int, ids: tuple[int, ...], keep: int | None) -> tuple[int, ...]:
        """``ids`` if it has 1..``keep`` tokens (truncated) or 1..``max_model_len`` (not truncated);
        the kept length is checked, not assumed from the tokenizer.

        :raises InvalidRequestError: naming the input's index, its length and the limit.
        """
        limit = self.model_config.max_model_len
        if not ids:
            raise InvalidRequestError(f"input {index} is empty: it has no tokens to pool")
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


_CHAT_TEMPLATE_PARAMETERS = frozenset(
    name for name in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    if name not in ("self", "kwargs")
) | {"messages"}
"""Names ``chat_template_kwargs`` may not use: the arguments of ``apply_chat_template`` itself
(and ``messages``, the conversation the template reads)."""


def _num_special_tokens(tokenizer: PreTrainedTokenizerBase, pair: bool) -> int:
    """``tokenizer.num_special_tokens_to_add(pair)``; 0 for a tokenizer that cannot say (or pair)."""
    try:
        return int(tokenizer.num_special_tokens_to_add(pair=pair))
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return 0


def check_text(text: str, where: str) -> None:
    """Refuse text that is not valid Unicode: a lone surrogate (``"\\ud800"``, half of an emoji
    cut by a JavaScript client) cannot be encoded as UTF-8, so no tokenizer can read it.

    :raises InvalidRequestError: naming ``where``, the character's position and its code point.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{where} is not valid Unicode text: character {exc.start} is U+{ord(text[exc.start]):04X}, a lone "
            "surrogate (half of a UTF-16 pair); send whole characters"
        ) from None
