"""The LoRA adapters a runtime serves, by name: what the front end resolves a request's ``lora``
against and what ``Runtime.load_lora`` / ``unload_lora`` change. The adapters' weights live in
the model, loaded by a plugin (``load_adapter``); this holds names, numbers and folders, and which
adapters are resident (in the model) now.

vLLM's semantics: every adapter named by ``lora_modules`` or ``load_lora`` is registered with its
folder; at most ``max_loras`` are resident at once (vLLM's ``--max-loras`` slots). A request
naming a registered adapter that is not resident loads it from its folder again, unloading the
least recently used resident adapter that has no request in flight. When every resident adapter
has requests in flight, the request waits its turn (first come, first served, as vLLM's scheduler
queues a request whose adapter finds no slot), and callers arriving after it wait behind it, so
steady traffic on one adapter cannot starve another.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from poolrunner.core.errors import InvalidRequestError, ModelLoadError
from poolrunner.core.model.st_metadata import read_st_metadata
from poolrunner.core.types import LoraRequest, ModelConfig, PoolingRequest
from poolrunner.core.validators import check_adapter_name


class _SlotsBusy(Exception):
    """Every one of the ``max_loras`` resident adapters has requests in flight: a caller needing
    another waits its turn (:meth:`LoraAdapters.hold`)."""


class AdapterTurn:
    """A caller's place in the queue for adapter slots.

    :param wake: Called (from any thread, holding the registry's lock: it must not block) when the
        caller should call :meth:`LoraAdapters.hold` again.
    """

    def __init__(self, wake: Callable[[], object]) -> None:
        self.wake = wake


class LoraAdapters:
    """Registered adapters by name, at most ``capacity`` of them resident at once.

    Numbers (``lora_id``) are never reused: an adapter unloaded by :meth:`remove` and registered
    again gets a new one, so a request planned against the old registration can never run with
    the new weights. An adapter evicted and loaded again from its folder keeps its number.

    :param capacity: Most adapters resident at once (``max_loras``); 0: adapters are not served.
    :param load: Puts an adapter's weights into the model (the ``load_adapter`` hook); returns a
        description for the log. Raises :class:`~poolrunner.core.errors.ModelLoadError` for a bad folder.
    :param unload: Takes adapter ``lora_id``'s weights out of the model.
    """

    def __init__(self, capacity: int, load: Callable[[LoraRequest], str] | None = None,
                 unload: Callable[[int], None] | None = None) -> None:
        self.capacity = capacity
        self._load = load or (lambda lora: "")
        self._unload = unload or (lambda lora_id: None)
        self._by_name: dict[str, LoraRequest] = {}
        self._by_id: dict[int, LoraRequest] = {}
        self._resident: dict[int, LoraRequest] = {}  # least recently used first
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._in_flight: Counter[int] = Counter()
        self._turns: deque[AdapterTurn] = deque()  # callers waiting for slots, first come first

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        """The registered adapters' names, in registration order."""
        return list(self._by_name)

    def resident(self) -> list[str]:
        """The names of the adapters in the model now, least recently used first."""
        with self._lock:
            return [lora.name for lora in self._resident.values()]

    @property
    def waiting(self) -> int:
        """Callers waiting for a slot (:meth:`hold`)."""
        with self._lock:
            return len(self._turns)

    def get(self, name: str) -> LoraRequest:
        """The adapter registered as ``name`` (resident or not: :meth:`using` loads it).

        :raises InvalidRequestError: (param ``lora``) naming ``name`` and the registered adapters.
        """
        lora = self._by_name.get(name)
        if lora is None:
            if not self.capacity:
                raise InvalidRequestError(f"lora {name!r}: this runtime serves no LoRA adapters (start it with "
                                          "lora_modules or max_loras, --lora-modules)", param="lora")
            raise InvalidRequestError(f"lora {name!r} is not loaded; loaded adapters: {self.names()}", param="lora")
        return lora

    def register(self, name: str, path: Path, model_config: ModelConfig) -> tuple[LoraRequest, str]:
        """Register adapter ``name`` at ``path`` and load it (checking the folder), unloading the
        least recently used idle adapter when ``capacity`` are resident. When every resident
        adapter has requests in flight (or callers wait for slots), the folder is checked by
        loading it all the same, and it leaves the model again until a request names it: a
        registration never waits, as vLLM's ``/v1/load_lora_adapter`` does not.

        :returns: The adapter and the loader's description.
        :raises InvalidRequestError: when ``name`` is registered already or no adapters are served.
        :raises ModelLoadError: for a folder refused (:func:`st_prompts` too); nothing is
            registered then.
        """
        check_adapter_name(name)
        prompts = st_prompts(path, model_config)
        with self._lock:
            if not self.capacity:
                raise InvalidRequestError("this runtime serves no LoRA adapters: start it with max_loras "
                                          "(--max-loras) to load them at run time", param="lora")
            if name in self._by_name:
                raise InvalidRequestError(f"lora {name!r} is loaded already; unload it first", param="lora")
            lora = LoraRequest(name=name, lora_id=next(self._ids), path=path,
                               prompts=prompts[0] if prompts else None, default_prompt_name=prompts and prompts[1])
            try:
                if self._turns:  # callers waiting for slots come first
                    raise _SlotsBusy
                described = self._make_resident([lora])[0]
            except _SlotsBusy:
                described = self._load(lora)
                self._unload(lora.lora_id)
            self._by_name[name] = self._by_id[lora.lora_id] = lora
            return lora, described

    def remove(self, name: str) -> LoraRequest:
        """Unregister ``name``: new requests naming it are refused; once its requests in flight
        have finished, its weights leave the model.

        :raises InvalidRequestError: when it is not registered.
        """
        with self._lock:
            lora = self.get(name)
            del self._by_name[name], self._by_id[lora.lora_id]
            self._lock.wait_for(lambda: self._in_flight[lora.lora_id] <= 0)
            if self._resident.pop(lora.lora_id, None) is not None:
                self._unload(lora.lora_id)
                self._wake_first()
            return lora

    @contextlib.contextmanager
    def using(self, requests: Sequence[PoolingRequest]) -> Iterator[None]:
        """:meth:`hold` ``requests``' adapters while the block runs (waiting in this thread for
        its turn), then :meth:`release` them."""
        woken = threading.Event()
        turn = AdapterTurn(woken.set)
        try:
            while (held := self.hold(requests, turn)) is None:
                woken.wait()
                woken.clear()
        finally:
            self.leave(turn)
        try:
            yield
        finally:
            self.release(held)

    def hold(self, requests: Sequence[PoolingRequest], turn: AdapterTurn) -> list[int] | None:
        """Make ``requests``' adapters resident and count them in use until :meth:`release`: they
        are neither evicted nor unloaded meanwhile (:meth:`remove` waits). Loading an evicted
        adapter reads its folder: callers on an event loop run this in a thread.

        When an adapter must be loaded and every resident one is busy, or earlier callers are
        waiting, ``turn`` joins the queue and ``None`` is returned: call again once ``turn.wake``
        was called, and :meth:`leave` when giving up (or done: it is then a no-op).

        :returns: The adapter numbers held, for :meth:`release`; ``None``: wait.
        :raises InvalidRequestError: (param ``lora``) for an adapter unloaded since the request
            was planned, or more adapters than ``capacity`` in one call. An evicted adapter whose
            folder no longer loads raises it too.
        """
        ids = [request.params.lora_id for request in requests if request.params.lora_id is not None]
        if not ids:
            return ids
        with self._lock:
            if self._turns and self._turns[0] is not turn:  # first come, first served
                if turn not in self._turns:
                    self._turns.append(turn)
                return None
            try:
                self._admit(sorted(set(ids)))
            except _SlotsBusy:
                if not self._turns:
                    self._turns.append(turn)
                return None
            self._in_flight.update(ids)
            self.leave(turn)  # the next caller may fit in the slots left
            return ids

    def leave(self, turn: AdapterTurn) -> None:
        """Take ``turn`` out of the queue (held, failed or cancelled); the next caller is woken."""
        with self._lock:
            if turn in self._turns:
                first = self._turns[0] is turn
                self._turns.remove(turn)
                if first:
                    self._wake_first()

    def release(self, ids: list[int]) -> None:
        """Stop counting the adapters :meth:`hold` returned as in use."""
        if ids:
            with self._lock:
                self._in_flight.subtract(ids)
                self._lock.notify_all()
                self._wake_first()

    def _wake_first(self) -> None:
        if self._turns:
            self._turns[0].wake()

    def _admit(self, ids: list[int]) -> None:
        adapters = []
        for lora_id in ids:
            lora = self._by_id.get(lora_id)
            if lora is None:
                raise InvalidRequestError(f"lora adapter number {lora_id} was unloaded after the request was "
                                          f"planned; loaded adapters: {self.names()}", param="lora")
            adapters.append(lora)
        if len(adapters) > self.capacity:
            raise InvalidRequestError(f"one call names {len(adapters)} LoRA adapters, more than max_loras "
                                      f"{self.capacity} (--max-loras) resident at once: "
                                      f"{[lora.name for lora in adapters]}", param="lora")
        try:
            self._make_resident(adapters)
        except ModelLoadError as exc:  # its folder changed since it was checked: the request cannot run
            raise InvalidRequestError(f"a LoRA adapter of this request was unloaded for room (max_loras "
                                      f"{self.capacity}) and no longer loads from its folder: {exc}",
                                      param="lora") from None

    def _make_resident(self, adapters: list[LoraRequest]) -> list[str]:
        """Load the adapters that are not resident, evicting idle ones least recently used first,
        and mark all of them most recently used. Called holding the lock."""
        missing = [lora for lora in adapters if lora.lora_id not in self._resident]
        keep = {lora.lora_id for lora in adapters}
        idle = [i for i in self._resident if i not in keep and self._in_flight[i] <= 0]
        evict = len(self._resident) + len(missing) - self.capacity
        if evict > len(idle):
            raise _SlotsBusy
        for lora_id in idle[:max(evict, 0)]:
            del self._resident[lora_id]
            self._unload(lora_id)
        described = []
        for lora in adapters:
            if lora.lora_id not in self._resident:
                described.append(self._load(lora))  # a refused folder raises: nothing changes for it
            self._resident[lora.lora_id] = self._resident.pop(lora.lora_id, lora)  # most recently used last
        return described


def st_prompts(path: Path, model_config: ModelConfig) -> tuple[dict[str, str], str | None] | None:
    """The prompts of an adapter folder that is also a sentence-transformers folder (a
    ``SentenceTransformer`` with an adapter, saved: ``modules.json`` beside the PEFT files), which
    sentence-transformers loading that folder applies; ``None`` for a plain PEFT folder.

    Requests share the base model's pooling, so the folder's pipeline must pool as the base
    model does.

    :raises ModelLoadError: naming the adapter's file and both values, for a pipeline that pools,
        projects (Dense), normalizes, truncates, lowercases or compares otherwise than the base model.
    """
    st = read_st_metadata(path)
    if st is None:
        return None
    served = {
        "pooling": ("1_Pooling/config.json", st.pooling_type or model_config.pooling_type, model_config.pooling_type),
        "Normalize": ("modules.json", st.normalize, model_config.normalize),
        "Dense": ("modules.json", [d.out_features for d in st.dense_layers],
                  [d.out_features for d in model_config.dense_layers]),
        "max_seq_length": ("sentence_bert_config.json", st.max_seq_length or model_config.max_model_len,
                           model_config.max_model_len),
        "do_lower_case": ("sentence_bert_config.json", st.lowercase, model_config.lowercase),
        "similarity_fn_name": ("config_sentence_transformers.json", st.similarity_fn_name,
                               model_config.similarity_fn_name),
    }
    for what, (file, adapter, base) in served.items():
        if adapter != base:
            raise ModelLoadError(f"{path / file}: the adapter's {what} {adapter!r} differs from the base model's "
                                 f"{base!r}; its requests share the base model's pipeline, so only its prompts may "
                                 "differ")
    if st.dense_layers:
        raise ModelLoadError(f"{path / 'modules.json'}: the adapter's own Dense modules are not served (their "
                             "weights would differ per request)")
    return st.prompts, st.default_prompt_name
