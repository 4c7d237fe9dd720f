"""The command line never leaves a partial output file: it writes a new file and puts it in place
only once every record is written, so a run that fails or is interrupted (Ctrl-C) keeps the
previous output as it was."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from poolrunner.core.files import open_output


def write_indices(path, count, fmt="jsonl"):
    with open_output(str(path), fmt) as writer:
        writer.write({"index": list(range(count))})


def test_an_interrupted_write_keeps_the_previous_file(tmp_path):
    output = tmp_path / "vectors.jsonl"
    output.write_text('{"index": 0, "embedding": [1.0]}\n')

    with pytest.raises(KeyboardInterrupt), open_output(str(output), "jsonl") as writer:
        writer.write({"index": [0], "embedding": [np.array([2.0])]})
        raise KeyboardInterrupt  # Ctrl-C in the middle of the run
    assert output.read_text() == '{"index": 0, "embedding": [1.0]}\n'
    assert sorted(path.name for path in tmp_path.iterdir()) == ["vectors.jsonl"]  # no partial file left


def test_a_finished_write_replaces_the_file(tmp_path):
    output = tmp_path / "vectors.jsonl"
    output.write_text("old\n")
    write_indices(output, 3)
    assert [json.loads(line)["index"] for line in output.read_text().splitlines()] == [0, 1, 2]
    with open_output(str(tmp_path / "raw.npy"), "npy", column="embedding") as writer:
        writer.write({"embedding": [np.array([1, 2], np.int8)]})
    np.testing.assert_array_equal(np.load(tmp_path / "raw.npy"), [[1, 2]])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["raw.npy", "vectors.jsonl"]


def test_the_output_gets_the_usual_permissions(tmp_path):
    existing = tmp_path / "kept.jsonl"
    existing.write_text("old\n")
    existing.chmod(0o640)
    write_indices(existing, 1)
    assert existing.stat().st_mode & 0o777 == 0o640  # an existing file keeps its mode
    fresh = tmp_path / "fresh.jsonl"
    umask = os.umask(0o022)
    try:
        write_indices(fresh, 1)
    finally:
        os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o644  # a new one follows the umask, not 0600


def test_partial_files_a_killed_run_left_are_removed_by_the_next(tmp_path, caplog):
    output = tmp_path / "vectors.jsonl"
    stale = [tmp_path / ".vectors.jsonl.k3x9q.partial", tmp_path / ".vectors.jsonl.abc.partial"]
    for path in stale:
        path.write_text('{"index": 0')
    other = tmp_path / ".other.jsonl.k3x9q.partial"  # another output's: not this run's to remove
    other.write_text("")
    with caplog.at_level("WARNING", logger="poolrunner.core.files"):
        write_indices(output, 2)
    assert sorted(path.name for path in tmp_path.iterdir()) == [".other.jsonl.k3x9q.partial", "vectors.jsonl"]
    assert sorted(record.getMessage() for record in caplog.records) == sorted(
        f"removed {path}, a partial output an interrupted run left" for path in stale)


def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path):
    """``kill PID`` (SIGTERM: what a job scheduler or ``timeout`` sends) used to kill the process
    where it stood, leaving its partial file behind; now the run stops cleanly with status 143,
    the previous output kept and no partial file left."""
    import signal
    import subprocess
    import sys
    import time

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"sentence number {i} about cats and dogs\n" for i in range(200_000)))
    output = tmp_path / "vectors.jsonl"
    output.write_text("previous\n")
    with subprocess.Popen([sys.executable, "-m", "poolrunner", "embed", "--input", str(corpus), "--output",
                           str(output)], stderr=subprocess.PIPE, text=True) as process:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob(".vectors.jsonl.*.partial")):  # writing has begun
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 128 + signal.SIGTERM
        assert "poolrunner: terminated (SIGTERM)" in process.stderr.read()
    assert output.read_text() == "previous\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt", "vectors.jsonl"]
