"""Input and output files of the command line and of distributed jobs, streamed in bounded chunks.

Reading (:func:`read_chunks`): the records of a text, JSON Lines, CSV or Parquet file come in
:class:`Chunk` objects of at most :data:`CHUNK_RECORDS` records, so memory stays flat however
long the file is. A record gives one or more texts (:class:`Fields`) and, when asked, an id. A
malformed record is an :class:`~poolrunner.core.errors.InvalidRequestError` that names it
(``FILE:LINE``, or ``FILE row N`` in Parquet) and says what is wrong; with ``on_error="skip"``
it is left out of the chunk and listed in :attr:`Chunk.skipped` instead. JSON Lines and CSV are
parsed line by line (``json``, ``csv``) so that each bad record is named by its line and can be
skipped alone (pyarrow's block readers fail a whole block); Parquet is read with pyarrow, in
record batches.

Writing (:func:`open_output`): results go to JSON Lines, CSV, Parquet (pyarrow), ``.npy`` or
``.npz``, chunk after chunk, into a temporary file beside the output that replaces it only once
every chunk is written: a run that fails or is interrupted leaves the previous file as it was.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import json
import logging
import os
import re
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs
import numpy as np

from poolrunner.core.errors import InvalidRequestError, NonFiniteOutputError, PoolrunnerError
from poolrunner.core.validators import unencodable_at

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import pyarrow as pa

INPUT_FORMATS = ("text", "jsonl", "csv", "parquet")
"""``text``: one input a line (empty lines too); ``jsonl``: one JSON object a line (blank lines
skipped); ``csv``: a header line naming the columns, then one record a row; ``parquet``."""

ON_ERROR = ("fail", "skip")
"""What a malformed record does: stop the run (``fail``), or leave it out and count it (``skip``)."""

INPUT_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
                  ".parquet": "parquet", ".pq": "parquet"}
"""The input formats by suffix; any other file is read as the caller's default (text)."""
OUTPUT_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet",
                   ".npy": "npy", ".npz": "npz"}
"""The output formats by suffix: ``jsonl``, one JSON object a record; ``csv``, a header, then one
row a record, arrays and maps as JSON text; ``parquet``; ``npy``, one array ``[n, ...]`` of one
column; ``npz``, one array per record, named by its ``index``."""

CHUNK_RECORDS = 512
"""Most records in one chunk."""
CHUNK_CHARS = 1 << 22
"""Most characters of text in one chunk (4 Mi): a chunk of very long texts ends early."""


def input_format(path: str, default: str = "text") -> str:
    """The format ``path``'s suffix names (:data:`INPUT_SUFFIXES`, any case), else ``default``."""
    return INPUT_SUFFIXES.get(os.path.splitext(path.lower())[1], default)


# --- reading ----------------------------------------------------------------------------------


@attrs.frozen
class Fields:
    """What each record gives: the strings under ``texts`` and, with ``id``, an id copied to the output.

    Each field is ``(name, option)``, the option being the flag that names it, for error messages.
    Text files have no fields: a line is one text, and they have no id.
    """

    texts: tuple[tuple[str, str], ...] = (("text", "--text-field"),)
    """One field (a text each) or two (a ``(text, text_pair)`` or ``(query, document)`` pair)."""
    id: tuple[str, str] | None = None
    optional_id: bool = False
    """Take ``id`` only where a file has it (by its header, its schema, or its first record)."""
    images: bool = False
    """The fields hold images: a string is a file path or a ``data:image/`` URL, and a Parquet
    binary column holds each image's encoded bytes (the command line's ``--image-field``)."""

    @classmethod
    def with_id(cls, texts: tuple[tuple[str, str], ...], id_field: str | None,
                option: str = "--id-field") -> Fields:
        """``texts`` and the id field the caller named (a file without it is an error), or with
        none named :data:`DEFAULT_ID_FIELD`, copied from the files that have it: the command line
        and Ray jobs read ids alike."""
        return cls(texts, (id_field or DEFAULT_ID_FIELD, option), optional_id=id_field is None)


DEFAULT_ID_FIELD = "id"
"""The id field (JSON field, CSV or Parquet column) copied to the output when none is named."""


@attrs.frozen
class Chunk:
    """Consecutive records of one file, in file order (those left out are in :attr:`skipped`)."""

    rows: list[int]
    """Each record's 0-based index among the file's records (lines of a text file, non-blank lines
    of a JSON Lines file, data rows of a CSV or Parquet file), bad records included."""
    places: list[str]
    """Each record's place for messages: ``FILE:LINE``, or ``FILE row N`` (N as in :attr:`rows`)."""
    values: list[tuple[str, ...]]
    """Each record's strings, one per field of :attr:`Fields.texts`."""
    ids: list[Any] | None
    """Each record's id (a string or an integer; any Parquet value), or ``None`` without an id field."""
    skipped: list[tuple[int, str]] = attrs.field(factory=list)
    """``(row, message)`` of each bad record left out (``on_error="skip"``)."""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def texts(self) -> list[str]:
        """The first field of each record."""
        return [values[0] for values in self.values]

    @property
    def inputs(self) -> list[Any]:
        """Texts for one field, ``(text, text_pair)`` tuples for two."""
        return [values if len(values) > 1 else values[0] for values in self.values]


@contextlib.contextmanager
def open_input(path: str) -> Iterator[IO[bytes]]:
    """``path`` opened for binary reading, or stdin for ``-`` (its bytes, or its text where it has none).

    :raises InvalidRequestError: for a missing file, a folder, or a file that cannot be opened.
    """
    if path == "-":
        yield getattr(sys.stdin, "buffer", sys.stdin)
        return
    try:
        file = open(path, "rb")
    except FileNotFoundError:
        raise InvalidRequestError(f"input file {path!r} does not exist") from None
    except IsADirectoryError:
        raise InvalidRequestError(f"input {path!r} is a directory; name a file") from None
    except OSError as exc:
        raise InvalidRequestError(f"cannot read input file {path!r}: {exc.strerror or exc}") from None
    with file:
        yield file


def read_chunks(
    source: Any, fmt: str, fields: Fields, *, name: str, on_error: str = "fail", size: int = CHUNK_RECORDS,
) -> Iterator[Chunk]:
    """The records of ``source`` in chunks of at most ``size`` records (and :data:`CHUNK_CHARS`).

    :param source: For ``text``, ``jsonl`` and ``csv`` a binary stream (decoded as UTF-8, a BOM
        dropped, undecodable bytes reported by line) or a text stream; for ``parquet`` a path or a
        random-access file.
    :param fmt: One of :data:`INPUT_FORMATS`.
    :param name: The file's name in messages.
    :param on_error: ``fail``: a bad record raises; ``skip``: it is left out and listed in the chunk.
    :raises InvalidRequestError: for a bad record (``fail``), naming it (``FILE:LINE: <problem>``);
        for a file the fields cannot come from (a missing column, a text file asked for an id or a
        second field), whatever ``on_error`` says. A chunk may hold only skipped records.
    """
    if on_error not in ON_ERROR:
        raise InvalidRequestError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    readers: dict[str, Callable[..., Iterator[_Record]]] = {
        "text": _text_records, "jsonl": _jsonl_records, "csv": _csv_records, "parquet": _parquet_records}
    if fmt not in readers:
        raise InvalidRequestError(f"input format must be one of {', '.join(INPUT_FORMATS)}, got {fmt!r}")
    chunk = _empty_chunk()
    chars = 0
    records = readers[fmt](source, fields, name)
    while True:
        try:
            row, place, values, record_id, problem = next(records)
        except StopIteration:
            break
        except OSError as exc:
            raise InvalidRequestError(f"cannot read {name}: {exc.strerror or exc}") from None
        if problem is not None:
            if on_error == "fail":
                raise InvalidRequestError(f"{place}: {problem}")
            chunk.skipped.append((row, f"{place}: {problem}"))
        else:
            chunk.rows.append(row)
            chunk.places.append(place)
            chunk.values.append(values)
            if record_id is not _NO_ID:
                chunk.ids.append(record_id)  # type: ignore[union-attr]
            chars += sum(map(len, values))
        if len(chunk) + len(chunk.skipped) >= size or chars >= CHUNK_CHARS:
            yield _finished(chunk)
            chunk, chars = _empty_chunk(), 0
    if len(chunk) or chunk.skipped:
        yield _finished(chunk)


def _empty_chunk() -> Chunk:
    return Chunk([], [], [], [])


def _finished(chunk: Chunk) -> Chunk:
    return chunk if chunk.ids else attrs.evolve(chunk, ids=None)


_NO_ID = object()
"""The id of a record read without an id field."""

_Record = tuple[int, str, tuple[str, ...], Any, str | None]
"""``(row, place, values, id, problem)``: a record, or (``problem`` set) a bad one."""


def _text_records(source: Any, fields: Fields, name: str) -> Iterator[_Record]:
    if len(fields.texts) > 1:
        option = fields.texts[1][1]
        raise InvalidRequestError(f"{name} is read as text, one input a line, with no fields: {option} needs "
                                  "jsonl, csv or parquet input (--input-format)")
    if fields.id is not None and not fields.optional_id:
        raise InvalidRequestError(f"{name} is read as text, one input a line, with no fields: {fields.id[1]} needs "
                                  "jsonl, csv or parquet input (--input-format)")
    with _decoded(source) as lines:
        for number, line in enumerate(lines, start=1):
            text = line.removesuffix("\n")
            yield number - 1, f"{name}:{number}", (text,), _NO_ID, _undecodable(text)


def _jsonl_records(source: Any, fields: Fields, name: str) -> Iterator[_Record]:
    id_field, id_option = fields.id or (None, "")
    id_kind: type | None = None  # the first id's type: every id of the file must have it
    optional = fields.optional_id  # until the first object says whether this file has ids
    implicit = fields.optional_id  # ids copied because the file has them, not because they were asked for
    row = -1
    with _decoded(source) as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            row += 1
            record, problem = _json_object(line)
            if record is not None and optional:
                id_field, optional = id_field if id_field in record else None, False
            values: tuple[str, ...] = ()
            record_id: Any = _NO_ID
            if record is not None:
                values, problem = _texts_of(record, fields)
            if record is not None and problem is None and id_field is not None:
                record_id, problem = _id_of(record, id_field, id_option, id_kind, implicit)
                id_kind = id_kind or (type(record_id) if problem is None and record_id is not None else None)
            yield row, f"{name}:{number}", values, record_id, problem


def _json_object(line: str) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object of one line, or the problem with it."""
    problem = _undecodable(line)
    if problem is not None:
        return None, problem
    try:
        record = json.loads(line.rstrip("\r\n"))  # an error at the line's end is in its last column
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, "invalid JSON: nested too deeply to read"
    except ValueError:  # int() refuses a number of more digits than sys.get_int_max_str_digits()
        return None, f"invalid JSON: a number of more than {sys.get_int_max_str_digits()} digits"
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    return record, None


def _texts_of(record: Mapping[str, Any], fields: Fields) -> tuple[tuple[str, ...], str | None]:
    values = []
    for field, option in fields.texts:
        if field not in record:
            known = ", ".join(repr(key) for key in record) or "none"
            return (), f"no field {field!r} (fields: {known}); pick one with {option}"
        value = record[field]
        if not isinstance(value, str):
            return (), f"field {field!r} is {type(value).__name__}, not a string"
        problem = _lone_surrogate(value)
        if problem is not None:
            return (), f"field {field!r} {problem}"
        values.append(value)
    return tuple(values), None


def _id_of(record: Mapping[str, Any], field: str, option: str, kind: type | None,
           implicit: bool = False) -> tuple[Any, str | None]:
    """A JSON record's id: a string or an integer (int64), of the same type in every record of a
    file; ``null`` is no id (``None``, written as null, as a Parquet null is). ``implicit`` (the
    default id field, copied because the file has it): a record without it has no id either."""
    if record.get(field) is None and (implicit or field in record):
        return None, None
    if field not in record:
        known = ", ".join(repr(key) for key in record)
        return None, f"no field {field!r} (fields: {known}); pick one with {option}"
    value = record[field]
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None, f"field {field!r} is {type(value).__name__}, not a string or an integer"
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        return None, f"field {field!r} is an integer beyond int64"
    if kind is not None and type(value) is not kind:
        hint = (f" (ids are copied from {field!r} because the file has it); give every id one type, or name "
                f"another field with {option}") if implicit else "; give every id one type"
        return None, f"field {field!r} is {type(value).__name__}, but the ids before it are {kind.__name__}{hint}"
    problem = _lone_surrogate(value) if isinstance(value, str) else None
    return value, None if problem is None else f"field {field!r} {problem}"


def _csv_records(source: Any, fields: Fields, name: str) -> Iterator[_Record]:
    with _decoded(source, newline="") as lines:
        reader = csv.reader(lines)
        try:
            header = next((cells for cells in reader if cells), None)  # blank lines before it are skipped
        except csv.Error as exc:
            raise InvalidRequestError(f"{name}:{reader.line_num}: invalid CSV header: {exc}") from None
        if header is None:
            return
        header_place = f"{name}:{reader.line_num}"
        problem = _undecodable(",".join(header))
        if problem is not None:
            raise InvalidRequestError(f"{header_place}: the header is {problem}")
        columns = {column: index for index, column in reversed(list(enumerate(header)))}
        wanted = [*fields.texts, *([fields.id] if fields.id else [])]
        for field, option in wanted:
            if field not in columns and not (fields.optional_id and (field, option) == fields.id):
                known = ", ".join(repr(column) for column in header)
                raise InvalidRequestError(f"{header_place}: no column {field!r} (the header's columns: {known}); "
                                          f"pick one with {option}")
        id_index = columns.get(fields.id[0]) if fields.id else None
        row, last = -1, reader.line_num
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                row += 1
                yield row, f"{name}:{last + 1}", (), None, f"invalid CSV: {exc}"
                last = reader.line_num
                continue
            place, last = f"{name}:{last + 1}", reader.line_num
            if not cells:
                continue
            row += 1
            if len(cells) != len(header):
                yield row, place, (), None, f"expected {len(header)} fields (as the header has), got {len(cells)}"
                continue
            values = tuple(cells[columns[field]] for field, _ in fields.texts)
            record_id = _NO_ID if id_index is None else cells[id_index]
            named = [*zip([field for field, _ in fields.texts], values, strict=True),
                     *([] if id_index is None else [(fields.id[0], record_id)])]  # type: ignore[index]
            problems = (f"field {field!r} is {problem}" for field, cell in named
                        if (problem := _undecodable(cell, "character")) is not None)
            yield row, place, values, record_id, next(problems, None)


def _parquet_records(source: Any, fields: Fields, name: str) -> Iterator[_Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(source)
    except (pa.ArrowException, OSError) as exc:
        raise InvalidRequestError(f"{name} is not a Parquet file ({exc})") from None
    schema = file.schema_arrow
    wanted = [*fields.texts, *([fields.id] if fields.id else [])]
    image_columns: set[str] = set()  # encoded images (fields.images): a null there is not an image
    for field, option in wanted:
        if field not in schema.names:
            if fields.optional_id and (field, option) == fields.id:
                continue
            known = ", ".join(repr(column) for column in schema.names)
            raise InvalidRequestError(f"{name}: no column {field!r} (columns: {known}); pick one with {option}")
        kind = schema.field(field).type
        text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        binary = fields.images and (pa.types.is_binary(kind) or pa.types.is_large_binary(kind))
        if (field, option) in fields.texts and not (text or binary):
            wanted_kind = "text (image paths) or binary (encoded images)" if fields.images else "text"
            raise InvalidRequestError(f"{name}: column {field!r} is {kind}, not {wanted_kind}; "
                                      f"pick a {'column' if fields.images else 'text column'} with {option}")
        if binary and (field, option) in fields.texts:
            image_columns.add(field)
    id_field = fields.id[0] if fields.id and fields.id[0] in schema.names else None
    names = list(dict.fromkeys([field for field, _ in fields.texts] + ([id_field] if id_field else [])))
    row = 0
    for batch in file.iter_batches(batch_size=CHUNK_RECORDS, columns=names):
        texts = [batch.column(field).to_pylist() for field, _ in fields.texts]
        ids = batch.column(id_field).to_pylist() if id_field else None
        for index in range(batch.num_rows):
            values = tuple(column[index] for column in texts)
            missing = next((field for (field, _), value in zip(fields.texts, values, strict=True) if value is None),
                           None)
            problem = (None if missing is None else
                       f"field {missing!r} is null, not {'an image' if missing in image_columns else 'a string'}")
            yield row, f"{name} row {row}", values, _NO_ID if ids is None else ids[index], problem
            row += 1


@contextlib.contextmanager
def _decoded(source: Any, newline: str | None = None) -> Iterator[IO[str]]:
    """``source`` as UTF-8 text (a BOM dropped), undecodable bytes kept as lone surrogates
    (``surrogateescape``) for :func:`_undecodable` to report by line; a text stream as it is."""
    if isinstance(source, io.TextIOBase):
        yield source
        return
    text = io.TextIOWrapper(source, encoding="utf-8-sig", errors="surrogateescape", newline=newline)
    try:
        yield text
    finally:
        with contextlib.suppress(ValueError):  # the caller owns (and closes) the binary stream
            text.detach()


def _undecodable(text: str, unit: str = "column") -> str | None:
    """What is wrong with a line (or a CSV field: ``unit="character"``) read with
    ``surrogateescape``: ``not UTF-8 text: byte 0xff at column 3``; ``None`` if nothing."""
    position = unencodable_at(text)
    if position is None:
        return None
    return f"not UTF-8 text: byte 0x{ord(text[position]) - 0xDC00:02x} at {unit} {position + 1}"


def _lone_surrogate(text: str) -> str | None:
    """A JSON string may escape half of a UTF-16 pair (``"\\ud800"``); no tokenizer reads it."""
    position = unencodable_at(text)
    if position is None:
        return None
    return f"holds a lone surrogate (U+{ord(text[position]):04X} at character {position + 1}), which is not text"


# --- running a chunk --------------------------------------------------------------------------


RECORD_ERRORS = (InvalidRequestError, NonFiniteOutputError)
"""What one record can cause: its input refused, or an output the model overflowed on."""


def run_each(call: Callable[[list[Any]], Sequence[Any]], inputs: list[Any], places: Sequence[str], *,
             stop: bool) -> tuple[list[Any], list[tuple[int, PoolrunnerError]]]:
    """``call(inputs)``; when it refuses the list (:data:`RECORD_ERRORS`), each input alone.

    :param places: Each input's place, put before the message of an input refused alone.
    :param stop: Raise the first refusal (``on_error="fail"``) rather than go on.
    :returns: ``(results, refused)``: a result per input (``None`` for a refused one), and
        ``(index, error)`` per refused input, the error of the same type as the runtime's, its
        message ``PLACE: <runtime's message>`` (:func:`_located`).
    :raises InvalidRequestError: the first refusal, with ``stop`` (or the
        :class:`~poolrunner.core.errors.NonFiniteOutputError` of an input the model overflows on).
    """
    try:
        return list(call(inputs)), []
    except RECORD_ERRORS:
        pass  # some input is refused: find which
    results: list[Any] = []
    refused: list[tuple[int, PoolrunnerError]] = []
    for index, item in enumerate(inputs):
        try:
            results.append(call([item])[0])
        except RECORD_ERRORS as exc:
            located = _located(exc, places[index])
            if stop:
                raise located from None
            results.append(None)
            refused.append((index, located))
    return results, refused


def _located(exc: PoolrunnerError, place: str) -> PoolrunnerError:
    """``exc`` again, its message after ``place``: "input 0" of a lone call read as "this input",
    or left out where a colon follows it (``a.png:3: the image is...``)."""
    message = f"{place}: " + re.sub(r"^(input|pair) 0\b", r"this \1", re.sub(r"^(input|pair) 0: ", "", str(exc)))
    if isinstance(exc, InvalidRequestError):
        return type(exc)(message, param=exc.param)
    return type(exc)(message)


# --- writing ----------------------------------------------------------------------------------


Columns = Mapping[str, Sequence[Any]]
"""A chunk of results by column, each column one value per record: numbers, strings, ``None``,
arrays (``numpy``), or maps of them (a classifier's label probabilities, named outputs)."""


class Writer:
    """Writes chunks of :data:`Columns` to one file, in order; :meth:`close` ends the file."""

    def write(self, columns: Columns) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Write what ends the file (a footer, a header that holds the row count)."""


class JsonlWriter(Writer):
    """One JSON object a record, keys in column order, non-ASCII escaped (any terminal reads it)."""

    def __init__(self, file: IO[str]) -> None:
        self.file = file

    def write(self, columns: Columns) -> None:
        for record in _records(columns):
            self.file.write(json.dumps(record) + "\n")


class CsvWriter(Writer):
    """A header of the column names, then one row a record; arrays and maps as JSON text, ``None`` empty."""

    def __init__(self, file: IO[str]) -> None:
        self.writer = csv.writer(file, lineterminator="\n")
        self.header: list[str] | None = None

    def write(self, columns: Columns) -> None:
        if self.header is None:
            self.header = list(columns)
            self.writer.writerow(self.header)
        for record in _records(columns):
            self.writer.writerow(["" if value is None else json.dumps(value) if isinstance(value, list | dict)
                                  else value for value in record.values()])


class ParquetWriter(Writer):
    """One Parquet file; the first chunk sets the schema (:func:`arrow_column` per column)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.writer: Any = None

    def write(self, columns: Columns) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({name: arrow_column(values) for name, values in columns.items()})
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.file, table.schema)
        self.writer.write_table(table.cast(self.writer.schema))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class NpyWriter(Writer):
    """One ``.npy`` array ``[n, *row shape]`` of ``column``: the header is written first with
    ``n = 0`` and rewritten in place at the end (numpy pads it so that the row count can grow)."""

    def __init__(self, file: IO[bytes], column: str) -> None:
        self.file = file
        self.column = column
        self.header: dict[str, Any] | None = None
        self.data_start = 0
        self.rows = 0

    def write(self, columns: Columns) -> None:
        if not len(columns[self.column]):
            return
        array = np.stack(columns[self.column])
        if self.header is None:
            self.header = {"descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False,
                           "shape": (0, *array.shape[1:])}
            np.lib.format.write_array_header_1_0(self.file, self.header)
            self.data_start = self.file.tell()
        self.file.write(np.ascontiguousarray(array).tobytes())
        self.rows += len(array)

    def close(self) -> None:
        if self.header is None:  # no rows: an empty float32 array
            np.save(self.file, np.zeros(0, np.float32))
            return
        self.file.seek(0)
        shape = (self.rows, *self.header["shape"][1:])
        np.lib.format.write_array_header_1_0(self.file, {**self.header, "shape": shape})
        if self.file.tell() != self.data_start:  # numpy < 1.22 does not pad the header for growth
            raise RuntimeError("numpy wrote a header of another length: cannot stream .npy output")
        self.file.seek(0, os.SEEK_END)


class NpzWriter(Writer):
    """A ``.npz`` archive as ``numpy.savez`` writes it: one array per record named by its
    ``index`` (``"<index>/<name>"`` for each output of a map), each written as it comes."""

    def __init__(self, file: IO[bytes], column: str) -> None:
        self.archive = zipfile.ZipFile(file, "w", allowZip64=True)
        self.column = column

    def write(self, columns: Columns) -> None:
        for index, result in zip(columns["index"], columns[self.column], strict=True):
            named = result.items() if isinstance(result, Mapping) else [(None, result)]
            for name, array in named:
                key = str(index) if name is None else f"{index}/{name}"
                with self.archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)

    def close(self) -> None:
        self.archive.close()


@contextlib.contextmanager
def open_output(path: str | None, fmt: str, *, column: str | None = None) -> Iterator[Writer]:
    """A :class:`Writer` of ``fmt`` (one of :data:`OUTPUT_SUFFIXES`' formats) on stdout (``path`` ``None`` or
    ``-``; ``jsonl`` and ``csv``) or on a new file that replaces ``path`` once the block ends
    without an exception; a block that raises (or is interrupted) leaves the previous file as it
    was and no partial file.

    :param column: The column an ``npy`` file holds, or whose arrays an ``npz`` archive holds.
    :raises InvalidRequestError: if the file cannot be written (its folder, the disk).
    """
    binary = fmt in ("parquet", "npy", "npz")
    if path in (None, "-"):
        if binary:
            raise InvalidRequestError(f"{fmt} output needs a file: name one with --output")
        writer = _writer(sys.stdout, fmt, column)
        yield writer
        writer.close()
        sys.stdout.flush()
        return
    target = Path(path)
    _remove_stale_partials(target)
    partial: Path | None = None
    try:
        with tempfile.NamedTemporaryFile("wb" if binary else "w", encoding=None if binary else "utf-8",
                                         newline=None if binary else "", dir=target.parent,
                                         prefix=f".{target.name}.", suffix=".partial", delete=False) as file:
            partial = Path(file.name)
            writer = _writer(file, fmt, column)
            yield writer
            writer.close()
        os.chmod(partial, _file_mode(target))  # a temporary file is private (0600); the output is not
        os.replace(partial, target)
    except BaseException as exc:
        if partial is not None:
            partial.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise InvalidRequestError(f"cannot write output file {path!r}: {exc.strerror or exc}") from None
        raise


def _remove_stale_partials(target: Path) -> None:
    """Remove the partial files of ``target`` that an earlier run left when it was killed outright
    (SIGKILL, a power cut: no ``finally`` ran), with a warning naming each. Two runs writing one output
    at once are not supported: the last to finish would replace the other's file anyway."""
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*.partial"):
        with contextlib.suppress(OSError):
            stale.unlink()
            logger.warning("removed %s, a partial output an interrupted run left", stale)


def _writer(file: IO[Any], fmt: str, column: str | None) -> Writer:
    if fmt == "jsonl":
        return JsonlWriter(file)
    if fmt == "csv":
        return CsvWriter(file)
    if fmt == "parquet":
        return ParquetWriter(file)
    if fmt in ("npy", "npz") and column is not None:
        return NpyWriter(file, column) if fmt == "npy" else NpzWriter(file, column)
    raise ValueError(f"cannot write {fmt!r} output (column: {column!r})")


def _file_mode(path: Path) -> int:
    """The permission bits ``path`` keeps (it exists) or a new file gets under the umask."""
    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _records(columns: Columns) -> Iterator[dict[str, Any]]:
    """The records of ``columns`` as JSON values: arrays as nested lists, numpy scalars as numbers."""
    names = list(columns)
    for values in zip(*columns.values(), strict=True):
        yield {name: _plain(value) for name, value in zip(names, values, strict=True)}


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def arrow_column(values: Sequence[Any]) -> pa.Array:
    """One Arrow column of ``values``: arrays as by :func:`to_arrow`, maps of arrays as a struct of
    such columns, anything else as pyarrow infers it (maps of numbers: a struct)."""
    import pyarrow as pa

    if len(values) and isinstance(values[0], np.ndarray):
        return to_arrow(values)
    if len(values) and isinstance(values[0], Mapping) and isinstance(next(iter(values[0].values()), None),
                                                                     np.ndarray):
        names = list(values[0])
        return pa.StructArray.from_arrays([to_arrow([value[name] for value in values]) for name in names], names)
    return pa.array(list(values))


def to_arrow(arrays: Sequence[np.ndarray]) -> pa.Array:
    """Rows of arrays as Arrow, their dtype kept (float32 results, int8 codes, int64 token ids):
    equal ``[d]`` rows as ``fixed_size_list[d]``, ragged ``[k_i]`` rows as ``list``, ``[k_i, m]``
    rows as ``list<fixed_size_list[m]>``.

    :raises ValueError: for rows of other shapes, or of more than two dimensions.
    """
    import pyarrow as pa

    first = arrays[0]
    flat = pa.array(np.concatenate([np.asarray(a, dtype=first.dtype).reshape(-1) for a in arrays]))
    if first.ndim == 1 and all(a.shape == first.shape for a in arrays):
        return pa.FixedSizeListArray.from_arrays(flat, first.shape[0])
    offsets = pa.array(np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32))
    if all(a.ndim == 1 for a in arrays):
        return pa.ListArray.from_arrays(offsets, flat)
    widths = {a.shape[1:] for a in arrays}
    if len(widths) != 1 or first.ndim != 2:
        raise ValueError(f"cannot store results of shapes {sorted({a.shape for a in arrays})} in one column")
    return pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(flat, first.shape[1]))
