"""An API key that is set must be usable: ``poolrunner serve`` fails closed and fast.

An empty key (``POOLRUNNER_API_KEY=""``) used to start an open server, and a key read from a
file with its trailing newline locked every client out; both are refused before any model
loads, without the key in the message.
"""

from __future__ import annotations

import time

import pytest

from poolrunner.core.cli.main import main
from poolrunner.core.server import ServerSettings

EMPTY = ("the API key is empty or only whitespace, which would leave the server open to anyone; set a key, or "
         "leave --api-key and POOLRUNNER_API_KEY unset for an open server")
PADDED = ("the API key has leading or trailing whitespace (a newline read from a file?), which no client sends, "
          "so every request would be refused; strip it")


@pytest.mark.parametrize(("key", "message"), [
    ("", EMPTY), ("   ", EMPTY), ("\n", EMPTY), ("s3cret\n", PADDED), (" s3cret", PADDED),
])
def test_an_unusable_key_is_refused(key, message):
    with pytest.raises(ValueError) as error:
        ServerSettings(api_key=key)
    assert str(error.value) == message
    assert ServerSettings(api_key="s3cret").api_key == "s3cret" and ServerSettings().api_key is None


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_serve_refuses_an_empty_key_before_loading_a_model(how, monkeypatch, capsys):
    argv = ["serve", "--model", "/nonexistent/model/folder"]
    if how == "flag":
        argv += ["--api-key", ""]
    else:
        monkeypatch.setenv("POOLRUNNER_API_KEY", "")
    started = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"poolrunner: error: {EMPTY}" in err and "Traceback" not in err
    assert "/nonexistent" not in err  # refused before the model folder is even looked at
    assert time.monotonic() - started < 2
