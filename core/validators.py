"""attrs validators whose errors read well in an API response: one plain sentence each.

They raise :class:`~poolrunner.core.errors.InvalidRequestError` (a ``ValueError``).
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Collection
from typing import Any

from attrs import Attribute

from poolrunner.core.errors import InvalidRequestError


class _Shown(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # Python refuses to write an integer of more than sys.get_int_max_str_digits() digits.
        if x.bit_length() > 3 * self.maxlong:
            return f"<an integer of about {int(x.bit_length() * 0.30103) + 1:,} digits>"
        return super().repr_int(x, level)


_SHOWN = _Shown()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 8, 8, 4
_SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 40, 40, 40


def shown(value: Any) -> str:
    """``repr(value)`` cut short (a few levels, items and characters) for an error message: a
    client's value, however large or deeply nested, cannot make the message large or deep."""
    return _SHOWN.repr(value)


def one_of(choices: Collection[Any], *, optional: bool = False):
    """The value must be one of ``choices`` (or ``None`` when ``optional``)."""

    def check(_instance: object, attribute: Attribute, value: Any) -> None:
        if value is None and optional:
            return
        if value not in choices:
            raise InvalidRequestError(f"{attribute.name} must be one of {list(choices)}, got {value!r}",
                                      param=attribute.name)

    return check


def task_name(builtin: Collection[str], plugin_pattern: re.Pattern[str], *, optional: bool = False):
    """A built-in task, or a name a plugin may declare (``plugin_pattern``); whether a runtime
    serves it is checked at load and on admission, where the installed plugins are known."""

    def check(_instance: object, attribute: Attribute, value: Any) -> None:
        if value is None and optional:
            return
        if value in builtin or (isinstance(value, str) and plugin_pattern.fullmatch(value)):
            return
        raise InvalidRequestError(
            f"{attribute.name} must be one of {list(builtin)} or a plugin's task name (lowercase "
            f"letters, digits and '_', at most 64 characters), got {value!r}"
        )

    return check


def check_seconds(name: str, value: Any, *, zero: bool) -> None:
    """:raises InvalidRequestError: unless ``value`` is a finite number of seconds > 0 (``zero``: >= 0)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise InvalidRequestError(f"{name} must be a finite number of seconds {'>=' if zero else '>'} 0, got {value!r}")


def positive_int(_instance: object, attribute: Attribute, value: Any) -> None:
    """``None`` or an integer >= 1 (booleans are not integers here)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidRequestError(f"{attribute.name} must be a positive integer, got {value!r}",
                                  param=attribute.name)


def check_fraction(name: str, value: Any) -> None:
    """:raises InvalidRequestError: unless ``value`` is a number from 0 to 1."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not 0 <= value <= 1:
        raise InvalidRequestError(f"{name} must be a number from 0 to 1, got {value!r}", param=name)


def fraction(_instance: object, attribute: Attribute, value: Any) -> None:
    """attrs validator: :func:`check_fraction`."""
    check_fraction(attribute.name, value)


def optional_bool(_instance: object, attribute: Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"{attribute.name} must be true, false or None, got {value!r}",
                                  param=attribute.name)


def non_negative_int(_instance: object, attribute: Attribute, value: Any) -> None:
    """``None`` or an integer >= 0, such as a token id."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise InvalidRequestError(f"{attribute.name} must be a non-negative integer, got {value!r}",
                                  param=attribute.name)


def non_negative_ints(_instance: object, attribute: Attribute, value: Any) -> None:
    """``None`` or a non-empty tuple of integers >= 0."""
    if value is None:
        return
    if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise InvalidRequestError(f"{attribute.name} must be a non-empty list of non-negative integers, got {value!r}",
                                  param=attribute.name)


def json_object(_instance: object, attribute: Attribute, value: Any) -> None:
    """A dict with string keys whose values JSON can write (a ``config.json`` fragment)."""
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise InvalidRequestError(
            f"{attribute.name} must be a JSON object (a dict with string keys), got {value!r:.200}"
        )
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{attribute.name} must hold JSON values only: {exc}") from None


def unencodable_at(text: str) -> int | None:
    """The index of the first character of ``text`` that UTF-8 cannot encode (a lone surrogate,
    or a byte kept by ``surrogateescape``), else ``None``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_text(text: str, where: str, *, param: str | None = None) -> None:
    """Refuse text that is not valid Unicode: a lone surrogate (``"\\ud800"``, half of an emoji
    cut by a JavaScript client) cannot be encoded as UTF-8, so no tokenizer can read it.

    :param param: The request field holding ``text`` (the HTTP error's ``param``), if known.
    :raises InvalidRequestError: naming ``where``, the character's position and its code point.
    """
    position = unencodable_at(text)
    if position is not None:
        raise InvalidRequestError(
            f"{where} is not valid Unicode text: character {position} is U+{ord(text[position]):04X}, a lone "
            "surrogate (half of a UTF-16 pair); send whole characters", param=param,
        )


MAX_ADAPTER_NAME_CHARS = 256
"""Longest LoRA adapter name: it is a served model's name too (``/v1/models``, ``model`` fields)."""


def check_adapter_name(name: Any) -> None:
    """Refuse a LoRA adapter name that is not a printable name a request can send: not a string,
    empty or only spaces, holding a control character (NUL, a line break), or longer than
    :data:`MAX_ADAPTER_NAME_CHARS`.

    :raises InvalidRequestError: (param ``lora``) naming the value and the rule.
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequestError(f"a LoRA adapter name must be a non-empty string, got {shown(name)}", param="lora")
    if len(name) > MAX_ADAPTER_NAME_CHARS:
        raise InvalidRequestError(f"a LoRA adapter name has at most {MAX_ADAPTER_NAME_CHARS} characters, got "
                                  f"{len(name)}: {shown(name)}", param="lora")
    if any(not character.isprintable() for character in name):
        raise InvalidRequestError(f"a LoRA adapter name must be printable (no control characters), got "
                                  f"{shown(name)}", param="lora")
