"""The LoRA adapters a runtime serves, by name: what the front end resolves a request's ``lora``
against and what ``Runtime.load_lora`` / ``unload_lora`` change. The adapters' weights live in
the model, loaded by a plugin (``load_adapter``); this holds names, numbers and folders only.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from poolrunner.core.errors import InvalidRequestError
from poolrunner.core.types import LoraRequest, PoolingRequest


class LoraAdapters:
    """Names -> :class:`~poolrunner.core.types.LoraRequest`, at most ``capacity`` at once.

    Numbers (``lora_id``) are never reused, so a request planned against an adapter that was
    unloaded and loaded again under the same name can never run with the wrong weights.

    :param capacity: Most adapters at once (``max_loras``); 0: adapters are not served.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_name: dict[str, LoraRequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._in_flight: Counter[int] = Counter()
        self._idle = threading.Condition(self._lock)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        """The loaded adapters' names, in load order."""
        return list(self._by_name)

    def get(self, name: str) -> LoraRequest:
        """The adapter loaded as ``name``.

        :raises InvalidRequestError: (param ``lora``) naming ``name`` and the loaded adapters.
        """
        lora = self._by_name.get(name)
        if lora is None:
            if not self.capacity:
                raise InvalidRequestError(f"lora {name!r}: this runtime serves no LoRA adapters (start it with "
                                          "lora_modules or max_loras, --lora-modules)", param="lora")
            raise InvalidRequestError(f"lora {name!r} is not loaded; loaded adapters: {self.names()}", param="lora")
        return lora

    def reserve(self, name: str, path: Path) -> LoraRequest:
        """A number for a new adapter ``name`` at ``path`` (not yet servable: see :meth:`add`).

        :raises InvalidRequestError: when ``name`` is loaded already or ``capacity`` adapters are.
        """
        with self._lock:
            if not self.capacity:
                raise InvalidRequestError("this runtime serves no LoRA adapters: start it with max_loras "
                                          "(--max-loras) to load them at run time", param="lora")
            if name in self._by_name:
                raise InvalidRequestError(f"lora {name!r} is loaded already; unload it first", param="lora")
            if len(self._by_name) >= self.capacity:
                raise InvalidRequestError(f"cannot load lora {name!r}: {self.capacity} adapters are loaded, the limit "
                                          f"(max_loras): {self.names()}; unload one first", param="lora")
            return LoraRequest(name=name, lora_id=next(self._ids), path=path)

    def add(self, lora: LoraRequest) -> None:
        """Serve ``lora`` (its weights are in the model)."""
        with self._lock:
            self._by_name[lora.name] = lora

    def remove(self, name: str) -> LoraRequest:
        """Stop serving ``name``: new requests naming it are refused.

        :raises InvalidRequestError: when it is not loaded.
        """
        with self._lock:
            lora = self.get(name)
            del self._by_name[name]
            return lora

    @contextlib.contextmanager
    def using(self, requests: Sequence[PoolingRequest]) -> Iterator[None]:
        """Count ``requests``' adapters as in use while the block runs (see :meth:`wait_idle`)."""
        ids = [request.params.lora_id for request in requests if request.params.lora_id is not None]
        if not ids:
            yield
            return
        with self._lock:
            self._in_flight.update(ids)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight.subtract(ids)
                self._idle.notify_all()

    def wait_idle(self, lora_id: int) -> None:
        """Wait until no request counted by :meth:`using` runs with adapter ``lora_id``."""
        with self._lock:
            self._idle.wait_for(lambda: self._in_flight[lora_id] <= 0)
