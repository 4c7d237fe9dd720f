"""The command line never leaves a partial output file: it writes a new file and puts it in place
only once every record is written, so a run that fails or is interrupted (Ctrl-C) keeps the
previous output as it was."""

from __future__ import annotations

import json
import os

import pytest

from poolrunner.core.cli.common import write_jsonl, write_output


def test_an_interrupted_write_keeps_the_previous_file(tmp_path):
    output = tmp_path / "vectors.jsonl"
    output.write_text('{"index": 0, "embedding": [1.0]}\n')

    def records():
        yield {"index": 0, "embedding": [2.0]}
        raise KeyboardInterrupt  # Ctrl-C in the middle of the run

    with pytest.raises(KeyboardInterrupt):
        write_jsonl(records(), str(output))
    assert output.read_text() == '{"index": 0, "embedding": [1.0]}\n'
    assert sorted(path.name for path in tmp_path.iterdir()) == ["vectors.jsonl"]  # no partial file left


def test_a_finished_write_replaces_the_file(tmp_path):
    output = tmp_path / "vectors.jsonl"
    output.write_text("old\n")
    write_jsonl(({"index": i} for i in range(3)), str(output))
    assert [json.loads(line)["index"] for line in output.read_text().splitlines()] == [0, 1, 2]
    write_output(str(tmp_path / "raw.bin"), lambda file: file.write(b"\x00\x01"), binary=True)
    assert (tmp_path / "raw.bin").read_bytes() == b"\x00\x01"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["raw.bin", "vectors.jsonl"]


def test_the_output_gets_the_usual_permissions(tmp_path):
    existing = tmp_path / "kept.jsonl"
    existing.write_text("old\n")
    existing.chmod(0o640)
    write_jsonl([{"index": 0}], str(existing))
    assert existing.stat().st_mode & 0o777 == 0o640  # an existing file keeps its mode
    fresh = tmp_path / "fresh.jsonl"
    umask = os.umask(0o022)
    try:
        write_jsonl([{"index": 0}], str(fresh))
    finally:
        os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o644  # a new one follows the umask, not 0600
