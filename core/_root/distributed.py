"""``poolrunner.distributed``: batch jobs on Ray, re-exported from :mod:`poolrunner.core.distributed`."""

from poolrunner.core.distributed import (
    INPUT_FORMATS,
    JobConflictError,
    JobResult,
    RayNotInstalledError,
    run_job,
)

__all__ = ["INPUT_FORMATS", "JobConflictError", "JobResult", "RayNotInstalledError", "run_job"]
