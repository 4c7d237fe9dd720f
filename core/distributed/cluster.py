"""Joining or starting the Ray cluster a job or a deployment runs on.

A cluster poolrunner starts itself (no address given, no ``$RAY_ADDRESS``) has no dashboard, and
its control plane (GCS, raylet) takes only calls that carry the cluster's token: Ray's token
authentication, on by default for local clusters since Ray 2.59 (poolrunner's floor). Ray binds
a local cluster to the machine's address, not to loopback (it resolves 127.0.0.1 to that address
on purpose), so the token is what keeps others out. A cluster the user names is joined as it is.
"""

from __future__ import annotations

import os
import socket
import time
import weakref
from typing import Any

from poolrunner.core.errors import InvalidRequestError

SETTLE_S = 0.2
"""Seconds a local cluster's GCS gets to act on a stop signal this process got too."""
ANSWER_S = 1.0
"""Seconds within which a live GCS answers (it takes milliseconds)."""
CONNECT_S = 5.0
"""Seconds a named cluster's head gets to accept a connection before the address is refused
(Ray itself would keep retrying for minutes)."""

_lost_node: weakref.ref[Any] | None = None
"""The local node whose GCS :func:`lost` found gone: a stopped GCS does not come back, so the
next shutdown step asking again is answered at once."""


def starts_local(address: str | None) -> bool:
    """Whether :func:`init` with ``address`` starts a cluster on this machine (else it joins one,
    whose nodes may see other files than this one)."""
    return address in (None, "", "local") and not os.environ.get("RAY_ADDRESS")


def init_options(address: str | None) -> dict[str, Any]:
    """``ray.init`` keywords for ``address``: a cluster poolrunner starts has no dashboard;
    joining one adds nothing."""
    if not starts_local(address):
        return {"address": address}
    return {"address": None, "include_dashboard": False}


def init(address: str | None, **options: Any) -> Any:
    """``ray.init`` with :func:`init_options` and ``options`` (``num_cpus``...); Ray's context.

    :raises InvalidRequestError: for an address Ray cannot read (it raises a bare ``ValueError``),
        or one where nothing accepts a connection (:func:`check_address`).
    """
    import ray

    check_address(address)
    try:
        return ray.init(**init_options(address), **options)
    except ValueError as exc:
        if "address" not in str(exc).lower():
            raise
        raise InvalidRequestError(f"Ray address {address!r}: {exc} (expected HOST:PORT of a cluster's head, "
                                  "auto, or local)", param="address") from None


def check_address(address: str | None) -> None:
    """:func:`check_reachable` for the cluster :func:`init` would join: ``address``, or
    ``$RAY_ADDRESS`` when none is given (``local`` starts a cluster: nothing to check)."""
    if address not in (None, "", "local"):
        check_reachable(address)
    elif address != "local" and os.environ.get("RAY_ADDRESS"):  # ray.init joins it
        check_reachable(os.environ["RAY_ADDRESS"], from_environment=True)


def check_reachable(address: str, *, from_environment: bool = False) -> None:
    """Refuse at once a cluster address (``HOST:PORT``, ``ray://HOST:PORT``; ``from_environment``:
    ``$RAY_ADDRESS``'s) where nothing accepts a TCP connection within :data:`CONNECT_S`:
    ``ray.init`` would retry for minutes (3 and more, measured) before failing. A value that is not
    ``HOST:PORT`` (``auto``) is left to Ray, which names what it expects.

    :raises InvalidRequestError: (param ``address``) naming the address and the socket's error.
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_S).close()
    except OSError as exc:
        source, instead = ("$RAY_ADDRESS ", "unset RAY_ADDRESS") if from_environment else ("", "leave the address out")
        raise InvalidRequestError(
            f"Ray address {source}{address!r}: nothing accepts a connection at {host}:{port} "
            f"({exc.strerror or type(exc).__name__}); start the cluster's head there (`ray start --head --port "
            f"{port}`), or {instead} to start a cluster on this machine", param="address") from None


def lost() -> bool:
    """Whether the local cluster this process started no longer answers: a stop signal sent to the
    whole process group (``timeout``, systemd's control-group kill, ``kill -- -PGID``) reaches
    Ray's processes too, and a call to the cluster would then wait a minute for its GCS and end
    this process. ``False`` at once for a cluster this process joined.

    The signal reaches the GCS as it reaches this process, so the GCS gets :data:`SETTLE_S` to
    act on it; then it must answer within :data:`ANSWER_S`. A GCS found gone is remembered (the
    shutdown steps each ask).
    """
    global _lost_node
    import ray.exceptions
    from ray._private import ray_constants, worker  # the node this process started, its GCS: no public accessor

    node = worker._global_node
    if node is None or not node.all_processes.get(ray_constants.PROCESS_TYPE_GCS_SERVER):
        return False
    if _lost_node is not None and _lost_node() is node:
        return True
    time.sleep(SETTLE_S)
    try:
        worker.global_worker.gcs_client.internal_kv_get(b"poolrunner", None, timeout=ANSWER_S)
    except ray.exceptions.RpcError:
        _lost_node = weakref.ref(node)
        return True
    return False
