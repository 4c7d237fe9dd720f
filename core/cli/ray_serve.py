"""``serve --ray-serve``: the server as Ray Serve replicas behind Ray Serve's HTTP proxy
(:func:`poolrunner.core.distributed.replicas.serve_replicas`), until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from poolrunner.core.cli.common import CliError, at_least, json_object, positive_int, runtime_options, seconds
from poolrunner.core.cli.ray_job import ray_cli_error, resource_amount
from poolrunner.core.errors import PoolrunnerError

GROUP_DESCRIPTION = """\
Run N replicas, each holding one runtime, behind Ray Serve's HTTP proxy on --host/--port of
every node with replicas (and the head node); the other server flags apply to each replica,
but not --max-connections, --keep-alive-timeout or --read-timeout (Ray's proxy owns the
connections). Needs Ray Serve: pip install -e '.[ray]' in the poolrunner checkout."""

AUTOSCALING_FLAGS = {"min_replicas": "--min-replicas", "max_replicas": "--max-replicas",
                     "target_ongoing_requests": "--target-ongoing-requests"}
"""Flags that set a key of Ray Serve's autoscaling_config, by key."""
FLAGS = {"replicas": "--replicas", **AUTOSCALING_FLAGS, "autoscaling_config": "--autoscaling-config",
         "max_ongoing_requests": "--max-ongoing-requests", "ray_request_timeout": "--ray-request-timeout",
         "cpus_per_replica": "--cpus-per-replica",
         "gpus_per_replica": "--gpus-per-replica", "ray_address": "--ray-address", "ray_app_name": "--ray-app-name"}
"""Every flag of the group but --ray-serve itself, by destination; each defaults to None, so
that one given without --ray-serve is told apart."""


def add_ray_serve_options(parser: argparse.ArgumentParser) -> None:
    """The ``Ray Serve`` option group of ``poolrunner serve``."""
    group = parser.add_argument_group("Ray Serve (scale out)", GROUP_DESCRIPTION)
    group.add_argument("--ray-serve", action="store_true",
                       help="serve as Ray Serve replicas instead of one process")
    group.add_argument("--replicas", metavar="N", type=positive_int,
                       help="replicas, each holding one runtime (default: 1); with autoscaling, the initial number")
    group.add_argument("--min-replicas", metavar="N", type=at_least(0),
                       help="autoscale down to N replicas (Ray Serve's min_replicas)")
    group.add_argument("--max-replicas", metavar="N", type=positive_int,
                       help="autoscale up to N replicas (Ray Serve's max_replicas)")
    group.add_argument("--target-ongoing-requests", metavar="N", type=resource_amount(minimum_exclusive=True),
                       help="requests per replica the autoscaler aims at (Ray Serve's target_ongoing_requests)")
    group.add_argument("--autoscaling-config", metavar="JSON", type=json_object,
                       help="Ray Serve's whole autoscaling_config as a JSON object (upscale_delay_s...); the "
                            "three flags above override its keys")
    group.add_argument("--max-ongoing-requests", metavar="N", type=positive_int,
                       help="most requests Ray sends one replica at once; more wait in Ray's router (default: 64)")
    group.add_argument("--ray-request-timeout", metavar="SECONDS", type=seconds,
                       help="seconds Ray's proxies wait for a request's answer, queueing included, before a 504 "
                            "(default: 600, the OpenAI client's own timeout)")
    group.add_argument("--cpus-per-replica", metavar="N", type=resource_amount(minimum_exclusive=True),
                       help="CPUs Ray reserves per replica, also its torch threads (default: 1)")
    group.add_argument("--gpus-per-replica", metavar="N", type=resource_amount(minimum_exclusive=False),
                       help="GPUs per replica; a fraction shares one GPU between replicas (default: 0)")
    group.add_argument("--ray-address", metavar="ADDRESS",
                       help="Ray cluster to join: auto, HOST:6379, ray://HOST:10001 (default: $RAY_ADDRESS, a "
                            "running local cluster, or a new one that stops with this command)")
    group.add_argument("--ray-app-name", metavar="NAME",
                       help="the Ray Serve application's name (default: poolrunner); deploying a name again "
                            "updates it")


def ray_serve_requested(args: argparse.Namespace) -> bool:
    """Whether ``serve`` runs on Ray Serve (``--ray-serve``).

    :raises CliError: for a flag of the group given without ``--ray-serve``.
    """
    if args.ray_serve:
        return True
    given = [flag for dest, flag in FLAGS.items() if getattr(args, dest, None) is not None]
    if given:
        raise CliError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --ray-serve")
    return False


def run_ray_serve(args: argparse.Namespace, settings: Any, names: Sequence[str] = ()) -> None:
    """Deploy the replicas the flags describe, then wait for SIGTERM or Ctrl-C and remove them
    (a signal while they start removes them too; a second one stops at once).

    :param settings: The app's :class:`~poolrunner.core.server.settings.ServerSettings`.
    :param names: The model's served names (``--served-model-name``, ``--model PATH:name=NAME``);
        empty: the folder's name.
    :raises RayNotInstalledError: without Ray Serve (``pip install -e '.[ray]'``).
    :raises InvalidRequestError: for bad autoscaling options (Ray's reasons) and settings replicas
        cannot honour (:func:`~poolrunner.core.distributed.replicas.check_settings`), before Ray starts.
    :raises ReplicaStartError: when the replicas fail to start, with the replica's own error.
    :raises CliError: when Ray or Ray Serve fails otherwise (a cluster that cannot be joined).
    """
    from poolrunner.core.distributed import replicas

    replicas.require_serve()
    if names:
        settings = attrs.evolve(settings, served_model_name=names)
    scaling = _scaling(args)
    replicas.check_settings(settings)  # bad settings and autoscaling flags fail here, before Ray starts
    replicas.deployment_options(**scaling)
    try:
        started = replicas.connect(args.ray_address)
    except Exception as exc:
        raise ray_cli_error(exc, "Ray Serve did not start") from None
    try:
        with _stop_on_signals():  # after ray.init, which installs its own SIGTERM handler
            served = _deploy(args, settings, scaling)
            print(f"poolrunner: serving on {served.url} (Ray Serve application {served.name!r}); SIGTERM or "
                  "Ctrl-C removes it", file=sys.stderr)
            with served:
                while True:
                    time.sleep(3600)
    except _Stopped:
        pass
    finally:
        if started:
            replicas.disconnect()


def _scaling(args: argparse.Namespace) -> dict[str, Any]:
    """The replica count, autoscaling and resource arguments of
    :func:`~poolrunner.core.distributed.replicas.serve_replicas` the flags give."""
    from poolrunner.core.distributed.replicas import MAX_ONGOING_REQUESTS

    return {
        "num_replicas": args.replicas, "autoscaling_config": _autoscaling(args),
        "num_cpus_per_replica": _or(args.cpus_per_replica, 1.0),
        "num_gpus_per_replica": _or(args.gpus_per_replica, 0.0),
        "max_ongoing_requests": args.max_ongoing_requests or MAX_ONGOING_REQUESTS,
    }


def _deploy(args: argparse.Namespace, settings: Any, scaling: dict[str, Any]) -> Any:
    from poolrunner.core.distributed.replicas import APP_NAME, REQUEST_TIMEOUT, serve_replicas

    options = runtime_options(args)  # --device names the replicas' device, unchecked here
    options.update({"is_matryoshka": True if args.is_matryoshka else None})
    model = options.pop("model")
    try:
        return serve_replicas(
            model, task=args.task, settings=settings, runtime_options=options, host=args.host, port=args.port,
            name=args.ray_app_name or APP_NAME, request_timeout=_or(args.ray_request_timeout, REQUEST_TIMEOUT),
            log_level=args.log_level, log_format=args.log_format, **scaling,
        )
    except PoolrunnerError:
        raise  # ReplicaStartError (the model did not load...): main() reports it
    except Exception as exc:
        raise ray_cli_error(exc, "Ray Serve did not start") from None


def _autoscaling(args: argparse.Namespace) -> dict[str, Any] | None:
    """Ray Serve's autoscaling_config from --autoscaling-config and the flags that override its keys;
    ``None`` when none is given (a fixed number of replicas)."""
    config = dict(args.autoscaling_config or {})
    config.update({key: getattr(args, key) for key in AUTOSCALING_FLAGS if getattr(args, key) is not None})
    return config or None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class _Stopped(BaseException):
    """SIGTERM or SIGINT arrived (a BaseException, as KeyboardInterrupt: no ``except Exception`` takes it)."""


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`_Stopped` in the block; the previous handlers are back after it."""

    def stop(*_: object) -> None:
        raise _Stopped

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be set back
                signal.signal(sig, handler)
