"""Real models for tests and benchmarks, built from PyPI packages (no model hub).

Import as ``tests.models.<name>``: see ``tests/models/smollm2.py`` for the import path.
"""
