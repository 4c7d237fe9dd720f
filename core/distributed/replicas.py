"""Online serving on Ray Serve: the app of ``poolrunner serve`` (:func:`~poolrunner.core.server.app.create_app`)
as replicas behind Ray Serve's HTTP proxy, each replica holding one
:class:`~poolrunner.core.runtime.Runtime`.

Each replica loads its own runtime from a :class:`~poolrunner.core.config.RuntimeConfig` (the driver
never loads the model), builds the app, and Ray Serve runs the app's lifespan, so each replica's
engine loop batches the requests Ray's router sends it. A proxy on each node (port ``port``)
routes every request to one replica. A replica that dies is replaced, and new requests go to the
others meanwhile; the requests it was answering are not sent again (Ray Serve does not know a
request is safe to repeat): with :func:`proxy_middlewares` in the proxies, each gets a JSON 503
saying so, with ``Retry-After`` (OpenAI's and most clients retry it), else Ray's bare 500. No
request waits longer than the proxies' ``request_timeout`` for its answer (a JSON 504 then):
Ray's router can lose a request it sends again after a replica's death.

Ray Serve is an optional dependency (``pip install -e '.[ray]'`` in a poolrunner checkout);
importing this module works without it.
"""

from __future__ import annotations

import contextlib
import logging
import logging.config
import os
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from poolrunner.core.distributed import cluster
from poolrunner.core.distributed.job import runtime_config
from poolrunner.core.errors import InvalidRequestError, RayNotInstalledError, ReplicaStartError
from poolrunner.core.server.settings import ServerSettings
from poolrunner.core.types import PoolingTask
from poolrunner.core.validators import check_seconds

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from poolrunner.core.config import RuntimeConfig

logger = logging.getLogger(__name__)

APP_NAME = "poolrunner"
"""The Ray Serve application's default name."""
DEPLOYMENT_NAME = "PoolrunnerReplica"
REPLICA_HEADER = "x-poolrunner-replica"
"""Response header naming the replica that answered (Ray Serve's replica id)."""
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
"""The variable Ray Serve's proxies read, when they start, for a function returning their middlewares."""
PROXY_CALLBACK = "poolrunner.core.distributed.replicas.proxy_middlewares"
REPLICA_LOST_MESSAGE = ("the replica answering this request stopped before it answered (Ray Serve replaces it); "
                        "the request was not answered: send it again")
REPLICA_TIMEOUT_MESSAGE = ("no replica answered this request within the proxies' request timeout (poolrunner serve "
                           "--ray-request-timeout; Ray Serve's request_timeout_s); it may not have run: send it again")
REQUEST_TIMEOUT = 600.0
"""Seconds Ray Serve's proxies wait for a replica's answer by default before answering 504: the
OpenAI client's own default timeout, so a request Ray's router lost (it can, when it sends a
request again after a replica's death) is answered when the client would give up anyway, never
held forever."""
MAX_ONGOING_REQUESTS = 64
"""Requests Ray sends one replica at once by default. Ray's own default (5) suits a replica that
runs one request at a time; a runtime batches concurrent requests into shared steps, so it gets
more, and the rest wait in Ray's router for the least busy replica."""


def require_serve() -> None:
    """Import Ray Serve, or raise :class:`RayNotInstalledError` saying what to install."""
    try:
        import ray.serve  # noqa: F401
    except ImportError as exc:
        raise RayNotInstalledError(
            f"serving on Ray needs Ray Serve ({exc}); install it with: pip install -e '.[ray]' "
            "(in the poolrunner checkout)"
        ) from exc


@attrs.define
class ServedReplicas:
    """A running Ray Serve application of poolrunner replicas (what :func:`serve_replicas` returns).

    ``shutdown()`` (or leaving a ``with`` block) deletes the application; Ray itself is shut down
    too when :func:`serve_replicas` started it.
    """

    name: str
    """The Ray Serve application's name."""
    url: str
    """Where the proxy listens (on every node that runs one)."""
    started_ray: bool = False

    def shutdown(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        gone = cluster.lost()  # nothing is left to remove, and Ray would wait a minute for its GCS
        if not gone:
            serve.delete(self.name)
        if self.started_ray:
            disconnect(gone)

    def __enter__(self) -> ServedReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def serve_replicas(
    model: str | os.PathLike[str] | None = None,
    *,
    task: PoolingTask | None = None,
    num_replicas: int | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    settings: ServerSettings | None = None,
    runtime_options: Mapping[str, Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_cpus_per_replica: float = 1.0,
    num_gpus_per_replica: float = 0.0,
    max_ongoing_requests: int = MAX_ONGOING_REQUESTS,
    request_timeout: float = REQUEST_TIMEOUT,
    name: str = APP_NAME,
    address: str | None = None,
    log_level: str = "info",
    log_format: str = "text",
) -> ServedReplicas:
    """Deploy the HTTP app of ``poolrunner serve`` as Ray Serve replicas and return once every
    replica serves.

    Each replica loads its own runtime (on the GPU Ray assigns when ``num_gpus_per_replica > 0``)
    and serves every endpoint of ``poolrunner serve``, with ``settings`` (API key, limits...),
    adding the :data:`REPLICA_HEADER` header to its answers. Ray Serve's proxies listen on
    ``host:port`` of each node that runs replicas (and the head node), and route each request to
    the replica with the fewest requests of two it picks. ``settings.drain_timeout`` becomes Ray's
    graceful shutdown timeout (a replica's requests in flight get that long to finish).

    :param model: Local model folder on every node, or a Hugging Face hub id in every node's local
        cache; ``None``: the default model.
    :param task: Serve this task alone; ``None``: every task the model allows.
    :param num_replicas: Replicas, each with one runtime (``None``: 1); with ``autoscaling_config``,
        the initial number (``None``: Ray's, ``min_replicas``) unless it names ``initial_replicas``.
    :param autoscaling_config: Ray Serve's ``autoscaling_config`` (``min_replicas``,
        ``max_replicas``, ``target_ongoing_requests``, ``upscale_delay_s``...), passed through.
    :param settings: The app's settings; ``None``: the defaults of ``poolrunner serve``.
    :param runtime_options: Other :class:`Runtime` arguments: ``plugins`` and any
        :class:`~poolrunner.core.config.RuntimeConfig` option (``dtype``, ``max_num_batched_tokens``...).
    :param host: Address the proxies listen on (``0.0.0.0`` for other machines to reach them).
    :param port: Port the proxies listen on.
    :param num_cpus_per_replica: CPUs Ray reserves per replica (torch uses as many threads).
    :param num_gpus_per_replica: GPUs per replica; fractions share a GPU between replicas.
    :param max_ongoing_requests: Most requests one replica is sent at once (:data:`MAX_ONGOING_REQUESTS`).
    :param request_timeout: Seconds the proxies wait for a request's answer (queueing included)
        before answering a JSON 504 (:data:`REQUEST_TIMEOUT`; Ray Serve's ``request_timeout_s``).
        Proxies already running keep their own (logged).
    :param name: The Ray Serve application's name; deploying a name again updates that application.
    :param address: Ray cluster to join (``auto``, ``ray://host:10001``...); ``None``: the one Ray
        is already initialized with, else ``ray.init()``'s default (``$RAY_ADDRESS``, a running
        local cluster, or a new one).
    :param log_level: Level of poolrunner's loggers in the replicas (and Ray Serve's there).
    :param log_format: ``text`` or ``json`` lines of poolrunner's loggers (the access lines) in the replicas.
    :returns: The application: its URL, and ``shutdown()``.
    :raises RayNotInstalledError: without Ray Serve: ``pip install -e '.[ray]'`` in a poolrunner checkout.
    :raises InvalidRequestError: for bad options (replica counts, autoscaling, resources,
        ``request_timeout``, ``runtime_options``, ``settings.allow_runtime_lora``), before Ray is started.
    :raises ReplicaStartError: when the replicas fail to start (the model does not load in them,
        say), ending with the replica's own error; Ray Serve tries each replica 3 times first.
    """
    require_serve()
    from poolrunner.core.server.logs import log_config

    config, plugins = runtime_config(task, model, runtime_options)
    settings = settings or ServerSettings()
    check_settings(settings)
    try:
        log_config(log_level, log_format)  # here, rather than in each replica
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    options = deployment_options(num_replicas=num_replicas, autoscaling_config=autoscaling_config,
                                 num_cpus_per_replica=num_cpus_per_replica, num_gpus_per_replica=num_gpus_per_replica,
                                 max_ongoing_requests=max_ongoing_requests, drain_timeout=settings.drain_timeout)
    options["logging_config"] = {"log_level": log_level.upper()}
    check_seconds("request_timeout", request_timeout, zero=False)
    started = connect(address)
    try:
        url = _start_proxies(host, port, request_timeout)
        _deploy(name, options, (config, plugins, settings, log_level, log_format))
    except BaseException:
        if started:
            disconnect()
        raise
    logger.info("%s: %s serving on %s", name, _replica_count(options), url)
    return ServedReplicas(name=name, url=url, started_ray=started)


def check_settings(settings: ServerSettings) -> None:
    """Refuse the server settings replicas cannot honour, before Ray starts.

    :raises InvalidRequestError: for ``allow_runtime_lora``: an adapter loaded at run time would
        reach only the replica that answered the call.
    """
    if settings.allow_runtime_lora:
        raise InvalidRequestError(
            "allow_runtime_lora (--allow-runtime-lora) is not served by Ray Serve replicas: an adapter loaded at run "
            "time would reach only the replica that answered the call, and the others would answer 404 for it; name "
            "the adapters with lora_modules (--lora-modules), which every replica loads")


def deployment_options(
    *,
    num_replicas: int | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    num_cpus_per_replica: float = 1.0,
    num_gpus_per_replica: float = 0.0,
    max_ongoing_requests: int = MAX_ONGOING_REQUESTS,
    drain_timeout: float = 30.0,
) -> dict[str, Any]:
    """The options of ``serve.deployment`` for :func:`serve_replicas`' arguments, checked.

    :raises InvalidRequestError: naming the bad option (Ray's own message for a bad ``autoscaling_config``).
    """
    _check_count("max_ongoing_requests", max_ongoing_requests)
    if num_replicas is not None:
        _check_count("num_replicas", num_replicas)
    _check_amount("num_cpus_per_replica", num_cpus_per_replica, zero=False)
    _check_amount("num_gpus_per_replica", num_gpus_per_replica, zero=True)
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": num_cpus_per_replica, "num_gpus": num_gpus_per_replica},
        "max_ongoing_requests": max_ongoing_requests,
        "graceful_shutdown_timeout_s": drain_timeout,
    }
    if autoscaling_config is None:
        options["num_replicas"] = num_replicas or 1
    else:
        initial = {} if num_replicas is None else {"initial_replicas": num_replicas}
        options["autoscaling_config"] = _autoscaling({**initial, **autoscaling_config})
    return options


def _check_count(option: str, value: Any) -> None:
    """:raises InvalidRequestError: unless ``value`` is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"{option} must be a positive integer, got {value!r}")


def _check_amount(option: str, value: Any, *, zero: bool) -> None:
    """:raises InvalidRequestError: unless ``value`` is a number > 0 (>= 0 with ``zero``)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or value < 0 or (value == 0 and not zero) or value != value:
        raise InvalidRequestError(f"{option} must be a number {'>=' if zero else '>'} 0, got {value!r}")


def _autoscaling(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as Ray Serve validates it (unknown keys, ``min_replicas > max_replicas``...).

    :raises InvalidRequestError: naming unknown keys, or with Ray's reasons.
    """
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
    if unknown:  # Ray's model ignores them: a misspelled key would silently change nothing
        raise InvalidRequestError(f"autoscaling_config has unknown keys {', '.join(unknown)} (known: "
                                  f"{', '.join(sorted(AutoscalingConfig.model_fields))})")
    try:
        AutoscalingConfig(**config)
    except (ValidationError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"autoscaling_config {dict(config)!r} is invalid: {_reasons(exc)}") from None
    return dict(config)


def _reasons(exc: Exception) -> str:
    """pydantic's errors as ``field: message``; other exceptions' message."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    return "; ".join(f"{'.'.join(map(str, error['loc'])) or 'config'}: {error['msg']}" for error in errors())


def _replica_count(options: Mapping[str, Any]) -> str:
    autoscaling = options.get("autoscaling_config")
    if autoscaling is None:
        return f"{options['num_replicas']} replica{'' if options['num_replicas'] == 1 else 's'}"
    return f"{autoscaling.get('min_replicas', 1)} to {autoscaling.get('max_replicas', 1)} replicas (autoscaling)"


def connect(address: str | None) -> bool:
    """Use the Ray connection already made, else ``ray.init(address)``; whether this call made it
    (then :func:`disconnect` ends it). A local cluster it starts has :data:`PROXY_CALLBACK` set."""
    import ray

    if ray.is_initialized():
        return False
    with _proxy_callback():
        cluster.init(address)
    return True


@contextlib.contextmanager
def _proxy_callback() -> Iterator[None]:
    """:data:`PROXY_CALLBACK` in the environment of a local cluster ``ray.init`` starts (its
    processes, the proxies too, inherit it then), unless the variable is set already; this
    process's environment as it was afterwards. A cluster started by ``ray start`` needs the
    variable set there (README)."""
    if PROXY_CALLBACK_ENV in os.environ:
        yield
        return
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK
    try:
        yield
    finally:
        os.environ.pop(PROXY_CALLBACK_ENV, None)


def disconnect(lost: bool | None = None) -> None:
    """Shut down Ray Serve and this process's Ray connection (a local cluster it started stops);
    Ray alone where the cluster no longer answers (``lost``, else :func:`cluster.lost
    <poolrunner.core.distributed.cluster.lost>`: the stop signal reached it too)."""
    import ray
    from ray import serve

    if not (cluster.lost() if lost is None else lost):
        serve.shutdown()
    ray.shutdown()


def _start_proxies(host: str, port: int, request_timeout: float) -> str:
    """Start Ray Serve with its proxies on ``host:port`` answering 504 after ``request_timeout``
    seconds; the URL they listen on.

    A cluster whose Serve already runs keeps its proxies' settings (Ray logs a warning), so the
    URL is read back from Serve rather than assumed, and another timeout is logged.
    """
    from ray import serve
    from ray.serve.context import _get_global_client  # the running proxies' address: no public accessor

    serve.start(http_options={"host": host, "port": port, "request_timeout_s": request_timeout})
    http = _get_global_client().http_config
    if http.request_timeout_s != request_timeout:
        logger.warning("Ray Serve's proxies already run with request_timeout_s=%s, kept instead of %g",
                       http.request_timeout_s, request_timeout)
    shown = "127.0.0.1" if http.host in ("0.0.0.0", "::") else http.host
    return f"http://{shown}:{http.port}"


def _deploy(name: str, options: Mapping[str, Any], arguments: tuple[Any, ...]) -> None:
    """Run the application ``name`` of replicas constructed with ``arguments``, waiting until every
    replica serves; a new application that fails is deleted (an update that fails leaves the
    running version as Ray Serve keeps it).

    :raises ReplicaStartError: when the replicas fail to start, with the replica's own error.
    """
    from ray import serve

    new = name not in serve.status().applications
    try:
        serve.run(_deployment(options).bind(*arguments), name=name, route_prefix="/")
    except BaseException as exc:  # Ctrl-C too: a new application does not stay half deployed
        reason = _replica_error(name) if isinstance(exc, RuntimeError) else None
        if new and not cluster.lost():  # a signal to the process group stopped the cluster too
            serve.delete(name)
        if isinstance(exc, RuntimeError):  # Ray Serve's "Deploying application ... failed"
            raise ReplicaStartError(f"Ray Serve could not start the replicas of {name!r}: {reason or exc}") from None
        raise


def _replica_error(name: str) -> str | None:
    """The last exception a replica of application ``name`` raised, as Ray Serve's status reports it
    (``Type: message``, its module left out), or ``None``."""
    from ray import serve

    application = serve.status().applications.get(name)
    messages = [deployment.message for deployment in (application.deployments.values() if application else ())]
    found = re.findall(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)$", "\n".join(messages), re.M)
    return f"{found[-1][0]}: {found[-1][1]}" if found else None


def _deployment(options: Mapping[str, Any]) -> Any:
    """:class:`PoolrunnerReplica` as a Ray Serve ingress deployment (made here: Ray is optional)."""
    from ray import serve

    return serve.deployment(serve.ingress()(PoolrunnerReplica), name=DEPLOYMENT_NAME, **options)


class PoolrunnerReplica:
    """One Ray Serve replica: a runtime and the app serving it.

    Ray Serve calls ``__serve_build_asgi_app__`` once the constructor returns, then runs the app's
    lifespan (the runtime's serving loop) before the replica takes requests, and its shutdown when
    the replica stops.

    :param config: The runtime's settings.
    :param plugins: Plugin objects registered beside the built-ins and entry points.
    :param settings: The app's settings.
    :param log_level: Level of poolrunner's loggers in this replica.
    :param log_format: ``text`` or ``json``.
    """

    def __init__(self, config: RuntimeConfig, plugins: list[object], settings: ServerSettings, log_level: str,
                 log_format: str) -> None:
        from poolrunner.core.runtime import Runtime

        _configure_logging(log_level, log_format)
        self.runtime = Runtime.from_config(config, plugins=plugins)
        self.settings = settings
        self.server_app: FastAPI | None = None  # not `app`: Ray's wrapper class owns that name

    def __serve_build_asgi_app__(self) -> FastAPI:
        from ray import serve

        from poolrunner.core.gc_heap import freeze_loaded_objects
        from poolrunner.core.server.app import create_app

        app = create_app(self.runtime, self.settings)
        app.add_middleware(ReplicaHeaderMiddleware, replica=serve.get_replica_context().replica_id.unique_id)
        self.server_app = app
        freeze_loaded_objects()  # the replica's process is Ray's worker, this model's alone
        return app

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose engine loop stopped is replaced.

        :raises RuntimeError: if the engine loop stopped.
        """
        router = getattr(getattr(self.server_app, "state", None), "router", None)
        if router is not None and not router.alive:
            raise RuntimeError("the runtime's engine loop stopped")


class ReplicaHeaderMiddleware:
    """Adds :data:`REPLICA_HEADER` (the replica's id) to every HTTP answer, so a client or a test
    can tell which replica served it.

    :param app: The app to wrap.
    :param replica: The replica's id.
    """

    def __init__(self, app: ASGIApp, *, replica: str) -> None:
        from poolrunner.core.server.middleware import REQUEST_ID_HEADER  # the server's: in the replica only

        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())
        self.request_id = REQUEST_ID_HEADER.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        given = _header(scope, self.request_id)

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                # Ray's proxy adds the request id it passed in; the app's copy of it would repeat it.
                headers = [(name, value) for name, value in message.get("headers", [])
                           if name.lower() != self.request_id or value != given]
                message = {**message, "headers": [*headers, self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def proxy_middlewares() -> list[Any]:
    """The middlewares of Ray Serve's proxies: name this function in :data:`PROXY_CALLBACK_ENV`
    (as :data:`PROXY_CALLBACK`) where the cluster starts."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLostMiddleware)]


class ReplicaLostMiddleware:
    """In Ray Serve's proxy: a request that got no answer (its replica died, or Ray failed to reach
    it) is answered 503 in the API's error shape, with ``Retry-After: 1``, instead of uvicorn's
    bare ``500 Internal Server Error``; the proxy's own plain-text 408 at its request timeout
    becomes a 504 in that shape, with ``Retry-After: 1`` too (the client sent its request in
    time: no replica answered it; poolrunner's app never answers 408 through Ray). Every other
    answer a replica starts passes as it is.

    :param app: The proxy's app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = timed_out = False

        async def watched_send(message: Message) -> None:
            nonlocal started, timed_out
            if message["type"] == "http.response.start" and not started:
                started = True
                timed_out = message["status"] == 408
            if not timed_out:  # the proxy's timeout answer is replaced below
                await send(message)

        await self.app(scope, receive, watched_send)
        from poolrunner.core.server.errors import send_error  # the app's, loaded in the proxies alone

        if timed_out:
            await send_error(send, 504, REPLICA_TIMEOUT_MESSAGE, [(b"retry-after", b"1")])
        elif not started:
            await send_error(send, 503, REPLICA_LOST_MESSAGE, [(b"retry-after", b"1")])


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key.lower() == name), None)


def _configure_logging(level: str, log_format: str) -> None:
    """poolrunner's loggers in this replica process as ``poolrunner serve`` configures them (the
    replica's stderr goes to its Ray log file and, by default, to the driver)."""
    from poolrunner.core.server.logs import log_config

    config = log_config(level, log_format)
    config["loggers"] = {"poolrunner": config["loggers"]["poolrunner"]}  # uvicorn's and asyncio's are Ray's here
    logging.config.dictConfig(config)
