"""The plugin test kit: pytest fixtures (``pytest_plugin``) and a conformance suite
(``conformance``) for authors of poolrunner plugins. Nothing here imports torch at import time."""
