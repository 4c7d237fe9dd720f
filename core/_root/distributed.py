"""``poolrunner.distributed``: batch jobs on Ray and replicas on Ray Serve, re-exported from
:mod:`poolrunner.core.distributed`."""

from poolrunner.core.distributed import (
    INPUT_FORMATS,
    JobConflictError,
    JobResult,
    RayNotInstalledError,
    ReplicaStartError,
    ServedReplicas,
    run_job,
    serve_replicas,
)

__all__ = ["INPUT_FORMATS", "JobConflictError", "JobResult", "RayNotInstalledError", "ReplicaStartError",
           "ServedReplicas", "run_job", "serve_replicas"]
