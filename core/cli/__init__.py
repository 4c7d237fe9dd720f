"""The ``poolrunner`` command line: ``embed``, ``classify``, ``score``, ``rerank``, ``encode``,
``plugins`` and ``--version``.

Entry point: :func:`poolrunner.core.cli.main.main` (the ``poolrunner`` console script and
``python -m poolrunner``). One module per subcommand; each has ``add_parser`` and ``run``.
"""
