"""The plugin API: the hook specs and every object a hook receives or returns.

Plugins import these names from :mod:`poolrunner.core`; this package keeps them apart from
the engine, which is private to the load sequence and the runtime (an import-linter contract).
"""
