"""The driver of a distributed job: connect to Ray, read the pending shards with Ray Data (each
file with :mod:`poolrunner.core.files`' reader), run them through an actor pool of runtimes, and
commit one Parquet file per shard as it completes."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from poolrunner.core.config import RuntimeConfig
from poolrunner.core.distributed import cluster
from poolrunner.core.distributed.shards import (
    ERROR,
    PATH,
    Shard,
    check_manifest,
    list_shards,
    read_shards,
    require_ray,
    resolve,
)
from poolrunner.core.errors import InvalidRequestError, PoolrunnerError
from poolrunner.core.files import ON_ERROR, Fields
from poolrunner.core.types import PoolingTask

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs
    import pyarrow.parquet as pq

    from poolrunner.core.plugin_api.options import RequestOptions

logger = logging.getLogger(__name__)

LEFT_OUT_SHOWN = 10
"""Messages of rows left out that a :class:`JobResult` keeps; the rest are counted."""


@attrs.frozen
class JobResult:
    """What one :func:`run_job` call did."""

    output: str
    written: tuple[str, ...]
    """Output files this run wrote (names in ``output``), one per input file processed."""
    skipped: tuple[str, ...]
    """Output files already there from an earlier run: their input files were not read."""
    num_rows: int
    """Rows processed by this run."""
    seconds: float
    """Wall time of the run, Ray start-up and model loading included."""
    rows_left_out: int = 0
    """Bad rows left out of the outputs (``on_error="skip"``)."""
    left_out: tuple[str, ...] = ()
    """The first :data:`LEFT_OUT_SHOWN` of them, each ``PLACE: <problem>``."""

    @property
    def rows_per_second(self) -> float:
        return self.num_rows / self.seconds if self.seconds > 0 else 0.0


def run_job(
    inputs: str | Sequence[str],
    output: str,
    *,
    task: PoolingTask | None = "embed",
    model: str | os.PathLike[str] | None = None,
    text_field: str = "text",
    image_field: str | None = None,
    id_field: str | None = None,
    input_format: str | None = None,
    on_error: str = "fail",
    num_actors: int = 1,
    num_cpus_per_actor: float = 1.0,
    num_gpus_per_actor: float = 0.0,
    batch_size: int = 256,
    runtime_options: Mapping[str, Any] | None = None,
    request_options: Mapping[str, Any] | None = None,
    lora_modules: Mapping[str, str] | None = None,
    lora: str | None = None,
    address: str | None = None,
) -> JobResult:
    """Run ``task`` over every row of ``inputs`` on Ray and write one Parquet file per input file.

    Ray Data reads the input files (on the cluster's workers) and ``map_batches`` sends batches of
    ``batch_size`` rows to a pool of ``num_actors`` actors, each holding one
    :class:`~poolrunner.core.runtime.Runtime` (``num_gpus_per_actor > 0``: the runtime runs on the
    GPU Ray assigns). Order is preserved, so the driver writes each input file's rows to
    ``output/<stem>-<hash>.parquet`` as soon as the file is complete (a temporary file, then a
    rename). Columns: ``row`` (int64, 0-based index among the file's records: JSON objects,
    CSV or Parquet rows, or text lines, empty ones included), the id column (``id_field``, or
    ``id`` when the input has one), and the results: ``embedding`` (``fixed_size_list<float>[d]``)
    for ``embed``, else ``output`` (``[num_labels]``, ``[num_tokens, hidden_size]``... as
    :meth:`Runtime.encode` returns them, float32; integer outputs keep their type), or one
    column per named output.

    A bad row (malformed JSON or CSV, a missing field, a text the runtime refuses) fails its own
    file only: that file is not written, the others are, and the error names the file and the
    row (``FILE:LINE``, ``FILE row N`` in Parquet). With ``on_error="skip"`` bad rows are left out
    (their ``row`` index is missing from the output) and counted in the result instead.

    A rerun with the same settings skips input files whose output exists, so a failed job is
    resumed by running it again; an actor that dies is restarted by Ray and its batch retried
    (Ray Data's actor pools default to ``max_restarts=-1``, ``max_task_retries=-1``), so no row
    is lost or written twice. A job that fails or is interrupted (Ctrl-C) removes its temporary
    file.

    :param inputs: Files or folders (searched recursively): local paths or URIs of any
        filesystem pyarrow reads. Every worker node must be able to read them.
    :param output: Output folder (local path or URI), written by the driver; created if missing.
    :param task: The task each runtime serves (``embed``, ``classify``, ``token_embed``...);
        ``None``: the model's default task.
    :param model: Local model folder on every node, or a Hugging Face hub id in every node's
        local Hugging Face cache (``runtime_options={"revision": ...}`` picks a revision; never
        downloaded); ``None``: the default model.
    :param text_field: Column (JSONL field) holding the texts; text files have only ``text``.
    :param image_field: Column (JSONL field) holding images instead of texts (a text-image model):
        Parquet binary (encoded bytes), or strings that are file paths (as the workers see them)
        or ``data:image/`` URLs; not for text files.
    :param id_field: Column (JSONL field) copied to the output; ``None``: ``id`` where a file has it.
    :param input_format: ``text``, ``jsonl``, ``csv`` or ``parquet``; ``None`` infers it from file names.
    :param on_error: ``fail``: a bad row fails its file; ``skip``: it is left out and counted.
    :param num_actors: Size of the actor pool (one runtime each).
    :param num_cpus_per_actor: CPUs Ray reserves per actor (torch uses as many threads).
    :param num_gpus_per_actor: GPUs per actor; fractions share a GPU between actors.
    :param batch_size: Rows per ``map_batches`` call; each call is one :meth:`Runtime.encode`,
        which packs them into forward passes under ``max_num_batched_tokens``.
    :param runtime_options: Other :class:`Runtime` arguments: ``plugins`` and any
        :class:`~poolrunner.core.config.RuntimeConfig` option (``dtype``, ``max_num_batched_tokens``...).
    :param request_options: :meth:`Runtime.encode` arguments (``dimensions``, ``normalize``,
        ``truncate_prompt_tokens``, ``prompt_name``...).
    :param lora_modules: LoRA adapters each runtime loads, name -> PEFT folder readable on every
        node (the runtime option ``lora_modules``, vLLM's ``--lora-modules``).
    :param lora: The adapter every row runs with (the request option ``lora``); ``None``: the base model.
    :param address: Ray cluster to connect to (``auto``, ``ray://host:10001``...); ``None``: the
        one Ray is already initialized with, else ``ray.init()``'s default (``$RAY_ADDRESS``, a
        running local cluster, or a new one).
    :raises RayNotInstalledError: without Ray Data: ``pip install -e '.[ray]'`` in a poolrunner checkout.
    :raises InvalidRequestError: for bad inputs or options, before any work; at the end, for
        input files that failed (a bad row, an unreadable file), naming each and its first bad
        row, once every other file is written.
    :raises JobConflictError: if ``output`` holds a job with other settings.
    """
    require_ray()

    start = time.perf_counter()
    runtime_options = _with_option(runtime_options, "lora_modules", lora_modules, "runtime_options")
    config, plugins = runtime_config(task, model, runtime_options)
    # On a cluster started here the actors read this machine's folder: read it first, so that a
    # bad one fails in one line before Ray starts (a cluster joined may hold the folder elsewhere).
    declared = _declared(config, plugins) if cluster.starts_local(address) else None
    request_options = _request_options(_with_option(request_options, "lora", lora, "request_options"), config,
                                       plugins, declared)
    for name, value in (("num_actors", num_actors), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
    if on_error not in ON_ERROR:
        raise InvalidRequestError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    import ray

    if not ray.is_initialized():  # a cluster nobody answers for is refused before the output is written
        cluster.check_address(address)
    in_fs, input_format, shards = list_shards(inputs, input_format, output=output)
    if input_format == "text":
        if id_field is not None:
            raise InvalidRequestError("text files have no id column: id_field (--id-field) needs jsonl, csv or "
                                      "parquet input")
        if image_field is not None:
            raise InvalidRequestError("text files have no columns: image_field (--image-field) needs jsonl, csv or "
                                      "parquet input")
        text_field = "text"
    fields = Fields.with_id(((text_field, "--text-field"),), id_field)
    if image_field is not None:
        fields = attrs.evolve(Fields.with_id(((image_field, "--image-field"),), id_field), images=True)
    out_fs, folder = _output_folder(output)
    done = {info.base_name for info in out_fs.get_file_info(_listing(folder))}
    check_manifest(out_fs, folder, {
        "text_field": text_field, "id_field": id_field, **({"image_field": image_field} if image_field else {}),
        # Speed-only settings (RuntimeConfig's SPEED_ONLY fields) may differ when a job resumes.
        "runtime_options": _json_safe({**config.recorded(), **({"plugins": plugins} if plugins else {})}),
        "request_options": _recorded(request_options),
    }, committed=any(shard.output_name in done for shard in shards))
    pending = [shard for shard in shards if shard.output_name not in done]
    skipped = tuple(shard.output_name for shard in shards if shard.output_name in done)
    if skipped:
        logger.info("skipping %d of %d input files: their outputs exist in %s", len(skipped), len(shards), output)
    if not pending:
        return JobResult(output, (), skipped, 0, time.perf_counter() - start)
    import ray.data

    with _connected(address), _job_context():
        # One read task per file (it reserves no CPU: parsing is cheap next to inference, and
        # actors sized to all of a node's CPUs would otherwise starve the reads for good).
        dataset = ray.data.from_items([{"path": shard.path} for shard in pending], override_num_blocks=len(pending))
        dataset = dataset.map_batches(
            functools.partial(read_shards, filesystem=in_fs, input_format=input_format, fields=fields,
                              on_error=on_error),
            batch_size=1, batch_format="pyarrow", num_cpus=0,
        )
        dataset = dataset.map_batches(
            _actor_class(),
            fn_constructor_kwargs={"config": config, "plugins": plugins, "request_options": request_options,
                                   "on_error": on_error, "images": image_field is not None},
            batch_size=batch_size, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=num_actors),
            num_cpus=num_cpus_per_actor, num_gpus=num_gpus_per_actor or None,
        )
        writer = _ShardWriter(out_fs, folder, pending)
        try:
            for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
                writer.write(batch)
            writer.finish()
        except BaseException as exc:  # Ctrl-C too: the temporary file goes
            writer.abort()
            cause = _poolrunner_cause(exc) if isinstance(exc, Exception) else None
            if cause is None:
                raise
            raise _without_retry_advice(cause) from None
    if writer.failed:
        raise InvalidRequestError(
            f"{len(writer.failed)} of {len(pending)} input files failed and were not written (the other "
            f"{len(writer.written)} were; rerun to resume once they are fixed, or pass on_error='skip' / "
            f"--on-error skip): " + "; ".join(writer.failed.values()))
    return JobResult(output, tuple(writer.written), skipped, writer.num_rows, time.perf_counter() - start,
                     writer.rows_left_out, tuple(writer.left_out))


def runtime_config(
    task: str | None, model: Any, options: Mapping[str, Any] | None,
) -> tuple[RuntimeConfig, list[object]]:
    """The workers' :class:`RuntimeConfig` and plugin objects, checked here, before any worker starts."""
    options = dict(options or {})
    plugins = list(options.pop("plugins", ()))
    clashing = sorted({"model", "task"} & set(options))
    if clashing:
        raise InvalidRequestError(f"runtime_options must not hold {', '.join(clashing)}: pass them as arguments")
    if model is not None and "://" not in os.fspath(model) and os.path.isdir(model):
        model = os.path.abspath(model)  # workers need not share the driver's working folder
    try:
        return RuntimeConfig.from_options(model, task=task, **options), plugins
    except TypeError as exc:
        raise InvalidRequestError(f"runtime_options: {exc}") from None


def _with_option(options: Mapping[str, Any] | None, name: str, value: Any, where: str) -> Mapping[str, Any] | None:
    """``options`` with the argument ``name`` added, when given."""
    if value is None:
        return options
    if name in (options or {}):
        raise InvalidRequestError(f"{name} is given both as an argument and in {where}: pass it once")
    return {**(options or {}), name: value}


def _declared(config: RuntimeConfig, plugins: Sequence[object]) -> RequestOptions:
    """The request options the plugins declare for ``config``'s model, its folder read (no weights).

    :raises ModelLoadError: if the folder cannot be read or is refused.
    """
    from poolrunner.core.loading import declared_options

    return declared_options(config, plugins)


def _request_options(options: Mapping[str, Any] | None, config: RuntimeConfig, plugins: Sequence[object],
                     declared: RequestOptions | None) -> dict[str, Any]:
    """``options`` checked by name: an :class:`EncodeRequest` field, or a plugin's request option
    for this model (``declared``, else read from its folder when an option needs it)."""
    from poolrunner.core.frontend.requests import EncodeRequest

    options = dict(options or {})
    known = set(EncodeRequest.field_names()) - {"task"}
    if set(options) - known:  # the rest must be request options the plugins declare for this model
        known |= {entry.option.name for entry in (declared if declared is not None else _declared(config, plugins))}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidRequestError(
            f"unknown request_options: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    lora = options.get("lora")
    if lora is not None and lora not in config.lora_modules:  # a job's adapters are its lora_modules
        loaded = ", ".join(map(repr, config.lora_modules)) or "none"
        raise InvalidRequestError(f"lora {lora!r} is not one of lora_modules (--lora-modules): {loaded}",
                                  param="lora")
    return options


def _recorded(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that change results, as JSON, defaults left out: the Python API and the command
    line record the same job alike."""
    from poolrunner.core.frontend.requests import EncodeRequest

    defaults = EncodeRequest.defaults()
    return {name: _json_safe(value) for name, value in sorted(options.items())
            if _json_safe(value) != _json_safe(defaults.get(name))}


def _json_safe(value: Any) -> Any:
    """``value`` as JSON holds it: tuples as lists, other objects (plugins) by their class's name."""
    import json

    return json.loads(json.dumps(value, default=lambda obj: f"{type(obj).__module__}.{type(obj).__qualname__}"))


def _listing(folder: str) -> pyarrow.fs.FileSelector:
    from pyarrow import fs

    return fs.FileSelector(folder, allow_not_found=True)


def _output_folder(output: str) -> tuple[pyarrow.fs.FileSystem, str]:
    from pyarrow import fs

    filesystem, folder = resolve(output)
    if filesystem.get_file_info(folder).type == fs.FileType.File:
        raise InvalidRequestError(f"output {output!r} is a file; name a folder")
    filesystem.create_dir(folder, recursive=True)
    return filesystem, folder


class _connected:
    """Use the Ray connection already made, else ``ray.init(address)`` and shut it down after."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.started = False

    def __enter__(self) -> None:
        import ray

        if not ray.is_initialized():
            cluster.init(self.address)
            self.started = True

    def __exit__(self, *exc: object) -> None:
        import ray

        if self.started:
            ray.shutdown()


@contextlib.contextmanager
def _job_context() -> Iterator[None]:
    """Datasets made inside return rows in input order, so each file's rows arrive together, in
    order, and raise an actor's own exception (a rejected input) rather than Ray Data's wrapper.
    A dataset copies Ray Data's current context when it is made."""
    from ray.data import DataContext

    context = DataContext.get_current()
    previous = context.execution_options.preserve_order, context.raise_original_map_exception
    context.execution_options.preserve_order = True
    context.raise_original_map_exception = True
    try:
        yield
    finally:
        context.execution_options.preserve_order, context.raise_original_map_exception = previous


def _actor_class() -> type:
    from poolrunner.core.distributed.actor import RuntimeActor

    return RuntimeActor


def _poolrunner_cause(exc: BaseException) -> PoolrunnerError | None:
    """The :class:`PoolrunnerError` an actor raised, out of Ray's wrappers (``cause``, ``__cause__``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        cause = getattr(current, "cause", None)
        if type(current).__module__.startswith("poolrunner") and isinstance(current, PoolrunnerError):
            return current
        current = cause if isinstance(cause, BaseException) else current.__cause__ or current.__context__
    return None


def _without_retry_advice(exc: PoolrunnerError) -> PoolrunnerError:
    """``exc`` without the paragraph Ray Data appends to a failed task's message ("Failed to apply
    UDF transform after 1/1 attempts ... if you believe this to be transient"): a rejected input is
    not transient, and the message should be the runtime's own."""
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (re.sub(r"\nFailed to .+ after \d+/\d+ attempts .*\Z", "", exc.args[0], flags=re.S), *exc.args[1:])
    return exc


class _ShardWriter:
    """Writes each input file's good rows to a temporary Parquet file, renamed to its output name
    once the next file's rows (or the end) show it is complete. Bad rows (``_error`` set) are
    counted and left out, or, where their ``row`` is null, fail their file: its temporary file
    goes, and its later rows are dropped."""

    def __init__(self, filesystem: pyarrow.fs.FileSystem, folder: str, shards: Sequence[Shard]) -> None:
        self.filesystem = filesystem
        self.folder = folder
        self.shards = {shard.path: shard for shard in shards}
        self.written: list[str] = []
        self.failed: dict[str, str] = {}
        """The first error of each input file that failed, by path."""
        self.num_rows = 0
        self.rows_left_out = 0
        self.left_out: list[str] = []
        self.schema: pa.Schema | None = None
        self._path: str | None = None
        self._rows = 0
        self._tmp = ""
        self._writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> None:
        paths = table.column(PATH).to_pylist()
        start = 0
        for end in range(1, len(paths) + 1):
            if end == len(paths) or paths[end] != paths[start]:
                self._append(paths[start], table.slice(start, end - start).drop_columns([PATH]))
                start = end

    def finish(self) -> None:
        """Commit the last file, then an empty output for each input file that had no rows."""
        import pyarrow as pa

        self._commit()
        for path, shard in self.shards.items():
            if shard.output_name not in self.written and path not in self.failed:
                self._open(path, self.schema or pa.schema([("row", pa.int64())]))
                self._commit()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self.filesystem.delete_file(self._tmp)
            self._writer = None

    def _append(self, path: str, part: pa.Table) -> None:
        import pyarrow.compute as pc

        path = self._known(path)
        if path in self.failed:
            return
        if path != self._path:
            self._commit()
            if self.shards[path].output_name in self.written:
                raise RuntimeError(f"rows of {path!r} arrived after the file was committed")
            self._path = path
        errors = part.column(ERROR)
        if errors.null_count < len(errors):
            bad = part.filter(pc.is_valid(errors))
            fatal = bad.filter(pc.is_null(bad.column("row")))
            if fatal.num_rows:
                self.abort()
                self.failed[path] = fatal.column(ERROR)[0].as_py()
                logger.warning("not written (the job fails at its end): %s", self.failed[path])
                return
            self.rows_left_out += bad.num_rows
            for message in bad.column(ERROR).to_pylist()[:LEFT_OUT_SHOWN - len(self.left_out)]:
                self.left_out.append(message)
                logger.warning("left out %s", message)
            part = part.filter(pc.is_null(errors))
        part = part.drop_columns([ERROR])
        if not part.num_rows:
            return
        if self._writer is None:
            self._open(path, part.schema)
        assert self._writer is not None
        self._writer.write_table(part)
        self._rows += part.num_rows
        self.num_rows += part.num_rows

    def _known(self, path: str) -> str:
        if path in self.shards:
            return path
        bare = path.split("://", 1)[-1]
        if bare in self.shards:
            return bare
        raise RuntimeError(f"Ray Data returned rows of {path!r}, which is not one of this job's inputs")

    def _open(self, path: str, schema: pa.Schema) -> None:
        import pyarrow.parquet as pq

        self.schema = self.schema or schema
        self._path, self._rows = path, 0
        self._tmp = posixpath.join(self.folder, f".{self.shards[path].output_name}.{uuid.uuid4().hex}.tmp")
        self._writer = pq.ParquetWriter(self._tmp, schema, filesystem=self.filesystem)

    def _commit(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        name = self.shards[self._path].output_name  # type: ignore[index]
        self.filesystem.move(self._tmp, posixpath.join(self.folder, name))
        self.written.append(name)
        logger.info("wrote %s (%d rows)", name, self._rows)
