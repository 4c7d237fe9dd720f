"""Adapters that let other projects' harnesses drive a :class:`~poolrunner.core.runtime.Runtime`."""
