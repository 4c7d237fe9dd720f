"""Joining or starting the Ray cluster a job or a deployment runs on.

A cluster poolrunner starts itself (no address given, no ``$RAY_ADDRESS``) has no dashboard, and
its control plane (GCS, raylet) takes only calls that carry the cluster's token: Ray's token
authentication, on by default for local clusters since Ray 2.59 (poolrunner's floor). Ray binds
a local cluster to the machine's address, not to loopback (it resolves 127.0.0.1 to that address
on purpose), so the token is what keeps others out. A cluster the user names is joined as it is.
"""

from __future__ import annotations

import os
from typing import Any


def init_options(address: str | None) -> dict[str, Any]:
    """``ray.init`` keywords for ``address``: a cluster poolrunner starts has no dashboard;
    joining one adds nothing."""
    if address not in (None, "", "local") or os.environ.get("RAY_ADDRESS"):
        return {"address": address}
    return {"address": None, "include_dashboard": False}


def init(address: str | None, **options: Any) -> Any:
    """``ray.init`` with :func:`init_options` and ``options`` (``num_cpus``...); Ray's context."""
    import ray

    return ray.init(**init_options(address), **options)
