"""``poolrunner embed``: texts in (arguments, a text, JSONL, CSV or Parquet file, or stdin), vectors
out (JSONL, CSV, Parquet or .npy), streamed in chunks."""

from __future__ import annotations

import argparse
import glob
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from poolrunner.core.cli.common import (
    CliError,
    Inputs,
    add_command,
    add_input_option,
    add_lora_option,
    add_model_options,
    add_output_option,
    add_plugin_options,
    add_truncation_options,
    check_output,
    flag_values,
    index_columns,
    input_fields,
    load_model,
    output_format,
    positive_int,
    progress,
    read_inputs,
    request_of,
)
from poolrunner.core.cli.ray_job import EPILOG as RAY_EPILOG
from poolrunner.core.cli.ray_job import add_ray_options, run_ray
from poolrunner.core.files import CHUNK_RECORDS, Chunk, open_output
from poolrunner.core.frontend.quantize import PRECISIONS, Precision, quantize
from poolrunner.core.frontend.requests import EncodeRequest

__all__ = ["add_parser", "run"]

FORMATS = ("jsonl", "csv", "parquet", "npy")

DESCRIPTION = """\
Embed texts into one vector each and write them in input order.

input (one source):
  TEXT ...          each argument is one text
  --input FILE      by its suffix (or --input-format): .jsonl, one JSON object a
                    line, the text under --text-field (blank lines are skipped);
                    .csv, a header line naming the columns, then one row a text
                    (column --text-field); .parquet, column --text-field; any
                    other FILE: UTF-8 text, every line is one text (an empty line
                    is an input too)
  --input -         stdin, as text lines (or --input-format)
  A file is read in chunks of 512 records, each embedded and written before the
  next is read: memory stays flat however large the file is.

output (by the suffix of --output FILE, or --output-format; stdout: JSON Lines):
  .jsonl    one {"index": i, "embedding": [...]} a line
  .csv      columns index, embedding (a JSON list)
  .parquet  columns index (int64), embedding (fixed_size_list<float>[d])
  .npy      a float32 numpy array [n, d] (or --precision's dtype)
  index is the record's 0-based position among the file's records (arguments:
  their position); the record's id follows it (its --id-field, else its "id"
  field where the input has one; not in .npy)."""

EPILOG = """\
examples:
  poolrunner embed "A cat sat." "A dog ran."
  poolrunner embed --input docs.jsonl --text-field body --output vectors.npy
  poolrunner embed --input docs.csv --text-field body --id-field doc_id --output vectors.parquet
  cat texts.txt | poolrunner embed --input - --truncate -1 > vectors.jsonl
  poolrunner embed --model ./my-model --prompt-name query "what is pooling?"
  poolrunner embed --model ./clip --images photos/ --output photos.parquet"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = add_command(subparsers, "embed", summary="embed texts into vectors (JSONL, CSV, Parquet or .npy)",
                         description=DESCRIPTION, epilog=f"{EPILOG}\n\n{RAY_EPILOG}")
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (or use --input)")

    files = parser.add_argument_group("input and output")
    add_input_option(files, "texts")
    files.add_argument("--images", metavar="DIR_OR_GLOB",
                       help="embed image files (a text-image model: CLIP): every file of a folder, or the files a "
                            "glob pattern matches ('photos/*.jpg', quoted), in sorted order; each output record "
                            "names its file (column file)")
    files.add_argument("--image-field", metavar="FIELD",
                       help="--input's records hold images in FIELD instead of texts: JSON Lines, CSV or Parquet "
                            "strings are image file paths (relative to the working directory) or data:image/ "
                            "URLs, a Parquet binary column holds each image's encoded bytes")
    add_output_option(files, FORMATS, "; .npy: a numpy array [n, d] (float32, or --precision's dtype)")

    model = add_model_options(parser)
    model.add_argument("--is-matryoshka", action="store_true",
                       help="accept --dimensions although the model's config does not declare "
                            "Matryoshka dimensions")

    request = parser.add_argument_group("embedding")
    request.add_argument("--dimensions", metavar="N", type=positive_int,
                         help="Matryoshka size: keep the first N dimensions (then normalize); "
                              "only for Matryoshka models")
    request.add_argument("--no-normalize", dest="normalize", action="store_const", const=False,
                         default=None, help="do not L2-normalize (default: the model's setting)")
    request.add_argument("--precision", choices=PRECISIONS, default="float32",
                         help="sentence-transformers' quantization after --dimensions and normalization: int8 / "
                              "uint8 calibrate each dimension's range on all the inputs of the run; binary / "
                              "ubinary pack one bit per dimension (.npy keeps the dtype)")
    add_truncation_options(request)
    add_lora_option(request)
    prompt = request.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="STR", help="literal prefix prepended to every text")
    prompt.add_argument("--prompt-name", metavar="NAME",
                        help="name of one of the model's prompts (config_sentence_transformers.json)")

    add_plugin_options(parser)
    add_ray_options(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Check the input and output, load the model, then embed and write chunk after chunk."""
    if args.ray is not None:
        if args.precision != "float32":
            raise CliError("--precision runs on one machine only: a --ray job writes float32 vectors")
        return run_ray(args, "embed", flag_values(EncodeRequest, args, "precision"))
    fmt = output_format(args, FORMATS)
    if fmt == "npy" and args.id_field is not None:
        raise CliError("--id-field: a .npy file holds the vectors only; write .jsonl, .csv or .parquet to keep ids")
    if args.images is not None:
        if args.texts or args.input is not None or args.ray is not None:
            raise CliError("--images is the input: pass no TEXT, --input or --ray with it")
        if args.id_field is not None:
            raise CliError("--images: each record's id is its file (column file); --id-field names no field")
        inputs = image_inputs(args.images, args.max_images_per_request, args.on_error)
        args.id_field = "file"
    elif args.image_field is not None:
        if args.input is None or args.texts:
            raise CliError("--image-field names a field of --input FILE's records: pass --input FILE, no TEXT")
        fields = attrs.evolve(input_fields(args, (args.image_field, "--image-field")), images=True)
        inputs = read_inputs(args, fields, [], what="images to embed")
    else:
        inputs = read_inputs(args, input_fields(args), args.texts, what="texts to embed")
    check_output(args.output)
    runtime = load_model(args, task="embed", is_matryoshka=True if args.is_matryoshka else None)
    calibrated = args.precision in ("int8", "uint8")  # on the whole run's float32 vectors, after the run
    request = request_of(EncodeRequest, args, task="embed", precision="float32" if calibrated else args.precision)

    def embed(texts: list[Any]) -> np.ndarray:
        if args.image_field is None:
            return np.stack(runtime.execute(attrs.evolve(request, inputs=texts)))
        items, step = [image_item(item) for item in texts], args.max_images_per_request  # a chunk may hold more
        return np.concatenate([np.stack(runtime.execute(attrs.evolve(request, inputs=items[start:start + step])))
                               for start in range(0, len(items), step)])

    with progress("embedding", inputs) as bar, open_output(args.output, fmt, column="embedding") as writer:
        chunks = _embedded(inputs, embed, bar.update, args.id_field)
        for columns in _calibrated(chunks, args.precision) if calibrated else chunks:
            writer.write(columns)
        inputs.check("texts to embed")
    inputs.report()
    return 0


def image_item(value: str | bytes) -> Any:
    """One ``--image-field`` value as an image input: bytes as they are, a ``data:image/`` URL as
    it is, any other string a file path."""
    return value if isinstance(value, bytes) or value.startswith("data:image/") else Path(value)


def image_inputs(pattern: str, per_chunk: int, on_error: str) -> Inputs:
    """The image files of ``pattern`` (a folder: its files; else a glob), sorted, as chunks of at
    most ``per_chunk`` (the images one request may carry), each record's id its path.

    :raises CliError: when nothing matches.
    """
    folder = Path(pattern)
    paths = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else sorted(
        Path(match) for match in glob.glob(pattern, recursive=True) if Path(match).is_file())
    if not paths:
        raise CliError(f"--images {pattern!r}: no files found")
    size = min(per_chunk, CHUNK_RECORDS)
    chunks = (Chunk(list(range(start, start + len(part))), [str(path) for path in part],
                    [(path,) for path in part], [str(path) for path in part])
              for start in range(0, len(paths), size) for part in [paths[start:start + size]])
    return Inputs(chunks, total=len(paths), on_error=on_error, located=True)


def _embedded(inputs: Inputs, embed: Callable[[list[str]], np.ndarray], done: Callable[[int], Any],
              id_field: str | None) -> Iterator[dict[str, list[Any]]]:
    """Output columns per chunk: ``index``, the id (``id_field``), ``embedding`` (a ``[d]`` row each)."""
    for chunk, vectors in inputs.results(embed, done):
        yield {**index_columns(chunk, id_field), "embedding": list(vectors)}


def _calibrated(chunks: Iterator[dict[str, list[Any]]], precision: Precision) -> Iterator[dict[str, list[Any]]]:
    """``chunks`` with their float32 embeddings quantized to int8 / uint8 on each dimension's range
    over all of them (as ``Runtime.embed`` calibrates over one call): the float32 rows wait in a
    temporary file until the last chunk is in, not in memory."""
    parts: list[tuple[dict[str, list[Any]], tuple[int, ...]]] = []  # each chunk's other columns, its shape
    low = high = None
    with tempfile.TemporaryFile() as spill:
        for columns in chunks:
            vectors = np.stack(columns.pop("embedding")).astype(np.float32)
            low = vectors.min(axis=0) if low is None else np.minimum(low, vectors.min(axis=0))
            high = vectors.max(axis=0) if high is None else np.maximum(high, vectors.max(axis=0))
            spill.write(vectors.tobytes())
            parts.append((columns, vectors.shape))
        # Fewer than two vectors have no range: quantize() refuses them as Runtime.embed does.
        ranges = np.stack([low, high]) if sum(shape[0] for _, shape in parts) >= 2 else None
        spill.seek(0)
        for columns, shape in parts:
            vectors = np.frombuffer(spill.read(4 * int(np.prod(shape))), dtype=np.float32).reshape(shape)
            yield {**columns, "embedding": list(quantize(vectors, precision, ranges))}
