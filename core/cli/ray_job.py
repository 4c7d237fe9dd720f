"""``--ray [ADDRESS]`` for ``embed`` and ``encode``: run the command as a distributed job on Ray
(:func:`poolrunner.core.distributed.run_job`), from --input files to Parquet files in --output."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from poolrunner.core.cli.common import CliError, positive_int, runtime_options
from poolrunner.core.errors import PoolrunnerError

EPILOG = """\
distributed (--ray):
  --input names a file or folder (searched recursively) of .jsonl, .csv, .parquet or
  text files, local or any URI pyarrow reads (s3://, gs://, hdfs://...), readable from
  every node; --output names a folder, with one Parquet file per input file: row
  (index in the file), the id column (--id-field, or id when the input has one), and
  the results. A bad record fails its file only (the others are written), or is left
  out with --on-error skip; rerunning a job skips the files already written. Needs
  Ray: pip install -e '.[ray]' in the poolrunner checkout."""


def add_ray_options(parser: argparse.ArgumentParser) -> None:
    """The ``distributed job (Ray)`` option group."""
    group = parser.add_argument_group("distributed job (Ray)")
    group.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help="run as a Ray Data job: --input files in, one Parquet file per input file in "
                            "--output FOLDER; ADDRESS: auto, ray://HOST:10001... (default: $RAY_ADDRESS, "
                            "a running local cluster, or a new one)")
    group.add_argument("--actors", metavar="N", type=positive_int, default=1,
                       help="actors in the pool, each holding one runtime (default: %(default)s)")
    group.add_argument("--cpus-per-actor", metavar="N", type=resource_amount(minimum_exclusive=True), default=1.0,
                       help="CPUs Ray reserves per actor, also its torch threads (default: %(default)s)")
    group.add_argument("--gpus-per-actor", metavar="N", type=resource_amount(minimum_exclusive=False), default=0.0,
                       help="GPUs per actor; a fraction shares one GPU between actors (default: %(default)s)")
    group.add_argument("--rows-per-batch", metavar="N", type=positive_int, default=256,
                       help="rows per map_batches call (one encode call on an actor)")


def run_ray(args: argparse.Namespace, task: str | None, request_options: dict[str, Any]) -> int:
    """Run the job the options describe; print a one-line summary to stderr."""
    from poolrunner.core.distributed import run_job

    if args.texts:
        raise CliError("--ray reads --input; TEXT arguments are not taken with it")
    if getattr(args, "images", None) is not None:
        raise CliError("--ray reads --input: for images, list them in a file's column (--image-field)")
    if args.input in (None, "-"):
        raise CliError("--ray needs --input FILE or FOLDER (stdin cannot be spread over a cluster)")
    if args.output in (None, "-"):
        raise CliError("--ray needs --output FOLDER (one Parquet file per input file)")
    options = runtime_options(args)  # --device names the workers' device, unchecked here
    if args.is_matryoshka:
        options["is_matryoshka"] = True
    model = options.pop("model")
    try:
        result = run_job(
            args.input, args.output, task=task, model=model, text_field=args.text_field, id_field=args.id_field,
            image_field=getattr(args, "image_field", None),
            input_format=args.input_format, on_error=args.on_error, num_actors=args.actors,
            num_cpus_per_actor=args.cpus_per_actor, num_gpus_per_actor=args.gpus_per_actor,
            batch_size=args.rows_per_batch, runtime_options=options,
            request_options={name: value for name, value in request_options.items() if value is not None},
            address=args.ray or None,
        )
    except PoolrunnerError:
        raise
    except Exception as exc:
        raise ray_cli_error(exc, "the Ray job failed") from None
    for message in result.left_out:
        print(f"poolrunner: skipped {message}", file=sys.stderr)
    rows = "row" if result.rows_left_out == 1 else "rows"
    left_out = f", left out {result.rows_left_out} bad {rows} (--on-error skip)" if result.rows_left_out else ""
    print(f"wrote {len(result.written)} files ({result.num_rows} rows, {result.rows_per_second:.1f} rows/s), "
          f"skipped {len(result.skipped)} already written{left_out}, in {result.output}", file=sys.stderr)
    return 0


def ray_cli_error(exc: Exception, what: str) -> Exception:
    """``exc`` as a one-line :class:`CliError` (``WHAT: Type: first line``, pointing at Ray's logs)
    when it is Ray's own error or a refused connection to the cluster; any other error as it is."""
    if not (type(exc).__module__.startswith("ray") or isinstance(exc, ConnectionError)):
        return exc
    return CliError(f"{what}: {_one_line(exc)}", hint="Ray's own logs are in /tmp/ray/session_latest/logs on each node")


def _one_line(exc: BaseException) -> str:
    """``Type: first line`` of the innermost cause of a Ray error (Ray wraps a worker's exception,
    traceback and all, in its own)."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(cause, BaseException):
            break
        exc = cause
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def resource_amount(*, minimum_exclusive: bool) -> Any:
    """argparse ``type`` for a resource amount: > 0 (``minimum_exclusive``) or >= 0."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if number < 0 or (minimum_exclusive and number == 0) or number != number:
            bound = "> 0" if minimum_exclusive else ">= 0"
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {value!r}")
        return number

    return parse
