"""The ``poolrunner`` command line: ``poolrunner embed``, ``poolrunner plugins``, ``--version``.

Entry point: :func:`poolrunner.core.cli.main.main` (the ``poolrunner`` console script and
``python -m poolrunner``). One module per subcommand; each has ``add_parser`` and ``run``.
"""
