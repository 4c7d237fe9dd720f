"""Batch jobs over large datasets on Ray: Ray Data ``map_batches`` over an actor pool in which each
actor holds one :class:`~poolrunner.core.runtime.Runtime`; and online serving on Ray Serve
(:func:`serve_replicas`): the HTTP server as replicas, each holding one runtime.

Ray is an optional dependency (``pip install -e '.[ray]'`` in a poolrunner checkout); importing this package works
without it, and :func:`run_job` raises :class:`RayNotInstalledError` then.

Example::

    from poolrunner.distributed import run_job
    result = run_job("s3://bucket/docs/", "s3://bucket/vectors/", num_actors=8, text_field="body")
    print(result.num_rows, result.rows_per_second)

    from poolrunner.distributed import serve_replicas
    with serve_replicas(num_replicas=4, host="0.0.0.0") as served:   # returns once every replica serves
        print(served.url)                                              # the same API as `poolrunner serve`
"""

from poolrunner.core.distributed.job import JobResult, run_job
from poolrunner.core.distributed.replicas import ServedReplicas, serve_replicas
from poolrunner.core.errors import JobConflictError, RayNotInstalledError, ReplicaStartError
from poolrunner.core.files import INPUT_FORMATS

__all__ = ["INPUT_FORMATS", "JobConflictError", "JobResult", "RayNotInstalledError", "ReplicaStartError",
           "ServedReplicas", "run_job", "serve_replicas"]
