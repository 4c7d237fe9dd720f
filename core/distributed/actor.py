"""The Ray Data UDF: an actor that holds one :class:`~poolrunner.core.runtime.Runtime` and turns
each batch of input rows (:func:`~poolrunner.core.distributed.shards.read_shards`' tables) into
Arrow output columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from poolrunner.core.config import RuntimeConfig
from poolrunner.core.distributed.shards import ERROR, PLACE, TEXT
from poolrunner.core.errors import PoolrunnerError
from poolrunner.core.files import run_each, to_arrow


class RuntimeActor:
    """Loads the model once per actor; each call executes one
    :class:`~poolrunner.core.frontend.requests.EncodeRequest` on one batch.

    :param config: The runtime's settings.
    :param plugins: Plugin objects registered beside the built-ins and entry points.
    :param request_options: The request's fields by name, plugin options too (:meth:`EncodeRequest.of`).
    :param on_error: ``fail``: a row the runtime refuses fails its file; ``skip``: it is left out.
    :param images: The rows hold images (``run_job``'s ``image_field``): bytes, or strings that
        are file paths or ``data:image/`` URLs; run in requests of at most the runtime's
        ``max_images_per_request``.
    """

    def __init__(
        self, config: RuntimeConfig, plugins: Sequence[object], request_options: Mapping[str, Any], on_error: str,
        images: bool = False,
    ) -> None:
        from poolrunner.core.gc_heap import freeze_loaded_objects
        from poolrunner.core.runtime import Runtime

        # Ray reports an error raised here as the actor's death, with the error's text in a
        # traceback and not the error itself; raised by the first call instead, it reaches the
        # driver whole (run_job's one-line ModelLoadError).
        self.load_error: PoolrunnerError | None = None
        try:
            self.runtime = Runtime.from_config(config, plugins=plugins)
        except PoolrunnerError as exc:
            self.load_error = exc
        freeze_loaded_objects()  # the actor's process is Ray's worker, this model's alone
        self.request_options = dict(request_options)
        self.on_error = on_error
        self.images = images
        self.step = config.max_images_per_request

    def _encode(self, texts: list[Any]) -> list[Any]:
        from poolrunner.core.frontend.requests import EncodeRequest

        if not self.images:
            return self.runtime.execute(EncodeRequest.of(inputs=texts, **self.request_options))
        items = [image_item(value) for value in texts]
        return [result for start in range(0, len(items), self.step)
                for result in self.runtime.execute(EncodeRequest.of(inputs=items[start:start + self.step],
                                                                    **self.request_options))]

    def __call__(self, batch: pa.Table) -> pa.Table:
        """The batch's rows, in order, without ``_text`` and ``_place``, with the results of the good
        ones (null for bad ones). A row the runtime refuses becomes a bad row: its ``_error`` names
        it and says why, and (``on_error="fail"``) its ``row`` is null, which fails its file.
        Nothing is raised for a refused row.

        :raises PoolrunnerError: the model's load error (a :class:`ModelLoadError`...), if it failed.
        """
        if self.load_error is not None:
            raise self.load_error
        errors = batch.column(ERROR).to_pylist()
        todo = [index for index, error in enumerate(errors) if error is None]
        rows = batch.column("row").to_pylist()
        results: list[Any] = []
        if todo:
            texts = batch.column(TEXT).take(todo).to_pylist()
            results, refused = run_each(self._encode, texts,
                                        batch.column(PLACE).take(todo).to_pylist(), stop=False)
            for index, error in refused:
                errors[todo[index]] = str(error)
                if self.on_error == "fail":
                    rows[todo[index]] = None
        table = batch.drop_columns([TEXT, PLACE])
        table = table.set_column(table.column_names.index("row"), "row", pa.array(rows, pa.int64()))
        table = table.set_column(table.column_names.index(ERROR), ERROR, pa.array(errors, pa.string()))
        done = [(position, result) for position, result in zip(todo, results, strict=True) if result is not None]
        if done:
            place = [None] * len(errors)
            for index, (position, _) in enumerate(done):
                place[position] = index
            indices = pa.array(place, pa.int64())
            for name, column in output_columns(self.runtime.task, [result for _, result in done]).items():
                table = table.append_column(name, column.take(indices))
        return table


def image_item(value: str | bytes) -> Any:
    """One image-column value as an image input: bytes as they are, a ``data:image/`` URL as it
    is, any other string a file path (the command line's ``--image-field`` reads them alike)."""
    from pathlib import Path

    return value if isinstance(value, bytes) or value.startswith("data:image/") else Path(value)


def output_columns(task: str, results: Sequence[np.ndarray | dict[str, np.ndarray]]) -> dict[str, pa.Array]:
    """Arrow columns of :meth:`Runtime.encode` results (:func:`~poolrunner.core.files.to_arrow`):
    ``embedding`` for ``embed``, one column per named output (``embed&token_classify``), else ``output``."""
    if isinstance(results[0], dict):
        return {name: to_arrow([result[name] for result in results]) for name in results[0]}  # type: ignore[index]
    return {"embedding" if task == "embed" else "output": to_arrow(results)}  # type: ignore[arg-type]
