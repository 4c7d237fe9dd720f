"""Request options a plugin declares for its tasks (SPLADE's ``top_k``, say).

A plugin returns :class:`RequestOption` objects from the ``request_options`` hook. The runtime
then takes them as keyword arguments of ``Runtime.encode``, as ``--option NAME=VALUE`` on the
command line (``VALUE`` read as JSON) and as body fields of ``/pooling``; :class:`RequestOptions`
checks every value against its declaration, fills in the defaults and the pooler reads the
result from :attr:`PoolingParams.extra_kwargs` (vLLM's name for the same bag).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from attrs import field, fields, frozen, validators

from poolrunner.core.errors import InvalidRequestError, PluginConflictError
from poolrunner.core.frontend.requests import REQUEST_FIELDS
from poolrunner.core.types import PoolingParams, PoolingTask

OPTION_TYPES: tuple[type, ...] = (int, float, bool, str)
OPTION_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")

# Names every request already has: an option may not shadow them. The request objects' fields
# and the pooling params' are derived; the rest are what a surface adds around a request (the
# HTTP body's model and encoding, the API's progress bar, the CLI's --option itself).
RESERVED_NAMES = (
    REQUEST_FIELDS | {f.name for f in fields(PoolingParams)}
    | {"input", "model", "encoding_format", "user", "priority", "request_id", "show_progress_bar", "option"}
)


def _option_name(_instance: object, _attribute: object, value: str) -> None:
    if not isinstance(value, str) or not OPTION_NAME.fullmatch(value):
        raise ValueError(f"a request option's name must be a lowercase identifier (at most 64 characters), "
                         f"got {value!r}")
    if value in RESERVED_NAMES:
        raise ValueError(f"request option {value!r} would shadow a core request field; reserved: "
                         f"{sorted(RESERVED_NAMES)}")


@frozen(kw_only=True)
class RequestOption:
    """One option a request of ``tasks`` may set.

    :ivar name: Keyword, flag and body-field name: a lowercase identifier, not a core field
        (:data:`RESERVED_NAMES`).
    :ivar type: ``int``, ``float``, ``bool`` or ``str``; values are checked against it (an
        ``int`` is accepted for a ``float`` option; ``bool`` is never an ``int``).
    :ivar tasks: The tasks that take it; a request of another task that sets it is refused.
    :ivar help: One sentence for ``--help``, ``poolrunner plugins`` and the OpenAPI schema.
    :ivar default: Used when a request leaves the option out; ``None``: the pooler sees no value.
    :ivar check: Optional rule on a typed value: returns what is wrong ("must be at least 1"),
        or ``None`` when the value is fine.
    :raises ValueError: for a bad name, an unknown type, or a default the option would refuse.
    """

    name: str = field(validator=_option_name)
    type: type = field(validator=validators.in_(OPTION_TYPES))
    tasks: frozenset[PoolingTask] = field(converter=frozenset, validator=validators.min_len(1))
    help: str = field(validator=validators.min_len(1))
    default: Any = None
    check: Callable[[Any], str | None] | None = field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.default is not None:
            problem = self.problem(self.default)
            if problem:
                raise ValueError(f"request option {self.name!r}: its default {self.default!r} {problem}")

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (its type, then :attr:`check`), or ``None``."""
        if not _has_type(value, self.type):
            return f"must be {_TYPE_WORDS[self.type]}"
        return self.check(value) if self.check is not None else None


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _has_type(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind) and not isinstance(value, bool)


@frozen
class DeclaredOption:
    """A :class:`RequestOption` and the plugin that declared it (for messages)."""

    option: RequestOption
    plugin: str


class RequestOptions:
    """Every option the installed plugins declare for one model: checks and completes a request's.

    :raises PluginConflictError: at construction, when two plugins declare one name.
    """

    def __init__(self, declared: Iterable[DeclaredOption] = ()) -> None:
        self._by_name: dict[str, DeclaredOption] = {}
        for entry in declared:
            other = self._by_name.get(entry.option.name)
            if other is not None:
                first, second = sorted((other.plugin, entry.plugin))
                raise PluginConflictError(
                    f"plugins {first!r} and {second!r} both declare the request option {entry.option.name!r}; "
                    "disable one of them"
                )
            self._by_name[entry.option.name] = entry

    def __iter__(self):
        return iter(self._by_name.values())

    def for_task(self, task: PoolingTask) -> list[DeclaredOption]:
        """The options requests of ``task`` take, by name."""
        return [entry for name, entry in sorted(self._by_name.items()) if task in entry.option.tasks]

    def get(self, name: str) -> DeclaredOption | None:
        return self._by_name.get(name)

    def resolve(self, task: PoolingTask, given: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """``given`` checked for ``task``, with every default filled in; ``None`` when empty. A
        ``None`` value is an option left out (as a JSON ``null`` field is, or a keyword's default).

        :raises InvalidRequestError: naming the option, its plugin and the rule a value breaks,
            or the options ``task`` takes when a name is unknown to it.
        """
        known = {entry.option.name: entry for entry in self.for_task(task)}
        resolved: dict[str, Any] = {}
        for name, value in given.items():
            if value is None:
                continue
            entry = known.get(name)
            if entry is None:
                raise InvalidRequestError(self._unknown(name, task, known), param=name)
            problem = entry.option.problem(value)
            if problem:
                raise InvalidRequestError(f"option {name}={value!r} (plugin {entry.plugin!r}) {problem}", param=name)
            resolved[name] = value
        for name, entry in known.items():
            if name not in resolved and entry.option.default is not None:
                resolved[name] = entry.option.default
        return MappingProxyType(resolved) if resolved else None

    def _unknown(self, name: str, task: PoolingTask, known: Mapping[str, DeclaredOption]) -> str:
        elsewhere = self._by_name.get(name)
        if elsewhere is not None:
            return (f"option {name!r} (plugin {elsewhere.plugin!r}) applies to tasks "
                    f"{sorted(elsewhere.option.tasks)}, not {task!r}")
        return f"unknown option {name!r} for task {task!r}; it takes {sorted(known) or 'no plugin options'}"
