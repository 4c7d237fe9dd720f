"""``poolrunner.integrations.mteb``: re-exported from :mod:`poolrunner.core.integrations.mteb`."""

from poolrunner.core.integrations.mteb import PoolrunnerEncoder

__all__ = ["PoolrunnerEncoder"]
