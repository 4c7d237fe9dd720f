"""Importing poolrunner changes nothing around it, and the light commands stay light.

The plugin test kit is a pytest11 plugin, so every pytest run of any project installed next to
poolrunner imports it: it must not touch the process environment (it once forced every such
run offline). ``poolrunner plugins`` and ``--help`` must not import torch or transformers.
Each check runs in a fresh interpreter, where ``sys.modules`` starts empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers")


def _run(code: str) -> dict:
    # Without the variables poolrunner once set, so that setting them again would show.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                            env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_poolrunner_and_its_test_kit_leaves_the_environment_alone():
    seen = _run(
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "import poolrunner, poolrunner.core, poolrunner.core.testing.pytest_plugin\n"
        "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
        f"print(json.dumps({{'changed': changed, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
    )
    assert seen == {"changed": [], "heavy": []}


@pytest.mark.parametrize("argv", [["plugins", "--all", "--json"], ["--help"], ["plugins", "--hook", "get_pooler"]])
def test_light_commands_import_no_torch(argv):
    seen = _run(
        "import contextlib, io, json, sys\n"
        "from poolrunner.core.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    assert seen == []
