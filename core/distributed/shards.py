"""A job's shards: the input files, their format, the deterministic output file of each, and the
reading of their records (:func:`read_shards`, with :mod:`poolrunner.core.files`' reader).

One input file is one shard and gets one output file, named from the file's full path, so a
rerun of the same job finds the shards already written and skips them. Paths are local paths
or URIs of any filesystem pyarrow reads (``s3://``, ``gs://``, ``hdfs://``...).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from poolrunner.core import files
from poolrunner.core.errors import InvalidRequestError, JobConflictError, RayNotInstalledError
from poolrunner.core.files import INPUT_FORMATS, Chunk, Fields, read_chunks

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs

MANIFEST = "_poolrunner_job.json"
"""The file in the output folder that records the job's settings (a rerun must match them)."""


def require_ray() -> None:
    """Import Ray Data and pyarrow, or raise :class:`RayNotInstalledError` saying what to install."""
    try:
        import pyarrow.parquet  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise RayNotInstalledError(
            f"distributed jobs need Ray Data and pyarrow ({exc}); install them with: "
            "pip install -e '.[ray]' (in the poolrunner checkout)"
        ) from exc


@attrs.frozen
class Shard:
    """One input file and the name of its output file (in the output folder)."""

    path: str
    """The file's path as its filesystem names it (no scheme)."""
    output_name: str


def resolve(location: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """``(filesystem, path)`` of a local path (made absolute) or a URI pyarrow knows."""
    from pyarrow import fs

    if "://" not in location:
        return fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))
    try:
        return fs.FileSystem.from_uri(location)
    except Exception as exc:  # pyarrow raises ArrowInvalid or OSError for unknown schemes and bad URIs
        raise InvalidRequestError(f"cannot open {location!r}: {exc}") from None


def list_shards(
    inputs: str | Sequence[str], input_format: str | None = None, *, output: str | None = None
) -> tuple[pyarrow.fs.FileSystem, str, list[Shard]]:
    """The input files of ``inputs`` (files or folders, searched recursively, hidden files and
    ``_``-prefixed ones left out), sorted, with their common format.

    :param output: The job's output folder: files under it are never inputs, so an output folder
        inside an input folder is not read back on a rerun.

    :param input_format: One of :data:`~poolrunner.core.files.INPUT_FORMATS`; ``None`` infers it
        from the file names (``.jsonl``/``.json``/``.ndjson``, ``.csv``, ``.parquet``/``.pq``,
        anything else is text).
    :returns: ``(filesystem, format, shards)``.
    :raises InvalidRequestError: for a missing input, no files, inputs on several filesystems,
        mixed formats, or an unknown ``input_format``.
    """
    from pyarrow import fs

    if input_format is not None and input_format not in INPUT_FORMATS:
        raise InvalidRequestError(f"input_format must be one of {', '.join(INPUT_FORMATS)}, got {input_format!r}")
    locations = [inputs] if isinstance(inputs, str) else list(inputs)
    if not locations:
        raise InvalidRequestError("no inputs: pass at least one file or folder")
    filesystem, paths = None, []
    for location in locations:
        location_fs, path = resolve(location)
        if filesystem is not None and not location_fs.equals(filesystem):
            raise InvalidRequestError(f"{location!r} is on another filesystem than {locations[0]!r}; "
                                      "run one job per filesystem")
        filesystem = location_fs
        info = location_fs.get_file_info(path)
        if info.type == fs.FileType.NotFound:
            raise InvalidRequestError(f"input {location!r} does not exist")
        if info.type == fs.FileType.Directory:
            found = location_fs.get_file_info(fs.FileSelector(path, recursive=True))
            paths += sorted(f.path for f in found if f.type == fs.FileType.File and not _hidden(f.path, path))
        else:
            paths.append(path)
    if output is not None:
        output_fs, output_path = resolve(output)
        if output_fs.equals(filesystem):
            paths = [path for path in paths if not path.startswith(output_path.rstrip("/") + "/")]
    if not paths:
        raise InvalidRequestError(f"no input files in {', '.join(map(repr, locations))}")
    paths = list(dict.fromkeys(paths))
    assert filesystem is not None
    formats = {path: input_format or _format_of(path) for path in paths}
    if len(set(formats.values())) > 1:
        examples = {fmt: path for path, fmt in formats.items()}
        raise InvalidRequestError(
            "inputs mix formats (" + ", ".join(f"{fmt}: {path!r}" for fmt, path in sorted(examples.items()))
            + "); run one job per format or pass input_format"
        )
    return filesystem, formats[paths[0]], [Shard(path, output_name(filesystem, path)) for path in paths]


def output_name(filesystem: pyarrow.fs.FileSystem, path: str) -> str:
    """``<stem>-<12 hex digits>.parquet``: the stem for people, a hash of the filesystem and full
    path so that same-named files in different folders never share an output."""
    digest = hashlib.sha256(f"{filesystem.type_name}:{path}".encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", posixpath.basename(path).split(".")[0])[:80] or "input"
    return f"{stem}-{digest}.parquet"


def check_manifest(
    filesystem: pyarrow.fs.FileSystem, folder: str, settings: Mapping[str, Any], *, committed: bool
) -> None:
    """Record ``settings`` in the output folder, or check that a rerun's settings match the record.

    :param committed: Whether the folder holds outputs of this job's inputs; without any, a
        different record (a job that failed before its first file) is replaced.
    :raises JobConflictError: if the folder's record differs: its outputs would mix two jobs.
    """
    path = posixpath.join(folder, MANIFEST)
    wanted = json.loads(json.dumps(settings, sort_keys=True))
    try:
        with filesystem.open_input_stream(path) as stream:
            recorded = json.loads(stream.read())
    except FileNotFoundError:
        recorded = None
    if recorded is None or (recorded != wanted and not committed):
        with filesystem.open_output_stream(path) as stream:
            stream.write(json.dumps(wanted, indent=2, sort_keys=True).encode())
        return
    if recorded != wanted:
        changed = sorted(key for key in {*recorded, *wanted} if recorded.get(key) != wanted.get(key))
        raise JobConflictError(
            f"output folder {folder!r} holds a job with other settings ({', '.join(changed)} "
            f"differ{'s' * (len(changed) == 1)}: "
            f"recorded {', '.join(f'{k}={recorded.get(k)!r}' for k in changed)}, "
            f"this run {', '.join(f'{k}={wanted.get(k)!r}' for k in changed)}); "
            "write to another folder, or delete it to start over"
        )


def _format_of(path: str) -> str:
    return files.input_format(posixpath.basename(path))


PATH, TEXT, PLACE, ERROR = "_path", "_text", "_place", "_error"
"""Columns of the rows :func:`read_shards` gives beside ``row`` and the id: each row's input file,
text, place for messages (``FILE:LINE``), and the problem of a bad record (``None`` for a good one).
A bad record's row has no text; one whose ``row`` is null fails its whole file."""


def read_shards(batch: pa.Table, *, filesystem: pyarrow.fs.FileSystem, input_format: str, fields: Fields,
                on_error: str) -> Iterator[pa.Table]:
    """A Ray Data UDF: the records of each file of ``batch``'s ``path`` column, a table per chunk
    (``_path``, ``row``, ``_place``, ``_text``, ``_error``, and the id column when the file has ids).

    Records left out (``on_error="skip"``) come as rows with their ``row`` and ``_error``; a
    file that cannot be read, or whose bad record stops it (``on_error="fail"``), ends with a
    row whose ``row`` is null and whose ``_error`` says why. Nothing is raised for one file.
    """
    import pyarrow as pa

    for path in batch.column("path").to_pylist():
        try:
            opener = filesystem.open_input_file if input_format == "parquet" else filesystem.open_input_stream
            with opener(path) as source:
                for chunk in read_chunks(source, input_format, fields, name=path, on_error=on_error):
                    yield _chunk_table(path, chunk, fields)
        except (InvalidRequestError, OSError, pa.ArrowException) as exc:
            message = str(exc) if isinstance(exc, InvalidRequestError) else f"cannot read {path}: {exc}"
            yield pa.table({PATH: pa.array([path]), "row": pa.array([None], pa.int64()),
                            PLACE: pa.array([path]), TEXT: pa.array([None], pa.string()),
                            ERROR: pa.array([message])})


def _chunk_table(path: str, chunk: Chunk, fields: Fields) -> pa.Table:
    """A chunk's good records, then its skipped ones (no text, their problem in ``_error``)."""
    import pyarrow as pa

    skipped = len(chunk.skipped)
    columns = {
        PATH: pa.array([path] * (len(chunk) + skipped), pa.string()),
        "row": pa.array(chunk.rows + [row for row, _ in chunk.skipped], pa.int64()),
        PLACE: pa.array(chunk.places + [None] * skipped, pa.string()),
        # An image column of encoded bytes (Parquet binary, Fields.images) stays binary.
        TEXT: pa.array(chunk.texts + [None] * skipped,
                       pa.binary() if any(isinstance(value, bytes) for value in chunk.texts) else pa.string()),
        ERROR: pa.array([None] * len(chunk) + [message for _, message in chunk.skipped], pa.string()),
    }
    if chunk.ids is not None and fields.id is not None:
        columns[fields.id[0]] = pa.array(chunk.ids + [None] * skipped)
    return pa.table(columns)


def _hidden(path: str, root: str) -> bool:
    return any(part.startswith((".", "_")) for part in posixpath.relpath(path, root).split("/"))
