"""The Ray Data UDF: an actor that holds one :class:`~poolrunner.core.runtime.Runtime` and turns
each batch of input rows into Arrow output columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from poolrunner.core.config import RuntimeConfig
from poolrunner.core.errors import InvalidRequestError

PATH_COLUMN = "path"
"""The column Ray Data's readers add with ``include_paths=True``: the row's input file."""


class RuntimeActor:
    """Loads the model once per actor; each call runs :meth:`Runtime.encode` on one batch.

    :param config: The runtime's settings.
    :param plugins: Plugin objects registered beside the built-ins and entry points.
    :param request_options: Keyword arguments of :meth:`~poolrunner.core.runtime.Runtime.encode`.
    :param text_field: The column holding the input texts.
    :param id_field: A column passed through to the output; ``None``: ``id`` when the input has one.
    """

    def __init__(
        self, config: RuntimeConfig, plugins: Sequence[object], request_options: Mapping[str, Any], text_field: str,
        id_field: str | None,
    ) -> None:
        from poolrunner.core.runtime import Runtime

        self.runtime = Runtime.from_config(config, plugins=plugins)
        self.request_options = dict(request_options)
        self.text_field = text_field
        self.id_field = id_field

    def __call__(self, batch: pa.Table) -> pa.Table:
        """``[path, id?, outputs...]`` for a batch of input rows, in row order."""
        texts = self._texts(batch)
        columns: dict[str, pa.Array | pa.ChunkedArray] = {PATH_COLUMN: batch.column(PATH_COLUMN)}
        id_field = self.id_field or ("id" if "id" in batch.column_names else None)
        if id_field is not None:
            if id_field not in batch.column_names:
                raise InvalidRequestError(f"{_where(batch)}: no id column {id_field!r} (columns: "
                                          f"{', '.join(_data_columns(batch))})")
            columns[id_field] = batch.column(id_field)
        if texts:
            columns.update(output_columns(self.runtime.task, self.runtime.encode(texts, **self.request_options)))
        return pa.table(columns)

    def _texts(self, batch: pa.Table) -> list[str]:
        if self.text_field not in batch.column_names:
            raise InvalidRequestError(f"{_where(batch)}: no text column {self.text_field!r} (columns: "
                                      f"{', '.join(_data_columns(batch))}); name it with text_field / --text-field")
        texts = batch.column(self.text_field).to_pylist()
        for row, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidRequestError(f"{_where(batch, row)}: {self.text_field!r} is "
                                          f"{type(text).__name__}, not a string")
        return texts


def output_columns(task: str, results: Sequence[np.ndarray | dict[str, np.ndarray]]) -> dict[str, pa.Array]:
    """Arrow columns of :meth:`Runtime.encode` results: ``embedding`` for ``embed``, one column per
    named output (``embed&token_classify``), else ``output``."""
    if isinstance(results[0], dict):
        return {name: to_arrow([result[name] for result in results]) for name in results[0]}  # type: ignore[index]
    return {"embedding" if task == "embed" else "output": to_arrow(results)}  # type: ignore[arg-type]


def to_arrow(arrays: Sequence[np.ndarray]) -> pa.Array:
    """float32 rows as Arrow: equal ``[d]`` rows as ``fixed_size_list<float>[d]``, ragged ``[k_i]``
    rows as ``list<float>``, ``[k_i, m]`` rows as ``list<fixed_size_list<float>[m]>``."""
    first = arrays[0]
    flat = pa.array(np.concatenate([np.asarray(a, dtype=np.float32).reshape(-1) for a in arrays]))
    if first.ndim == 1 and all(a.shape == first.shape for a in arrays):
        return pa.FixedSizeListArray.from_arrays(flat, first.shape[0])
    offsets = pa.array(np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32))
    if all(a.ndim == 1 for a in arrays):
        return pa.ListArray.from_arrays(offsets, flat)
    widths = {a.shape[1:] for a in arrays}
    if len(widths) != 1 or first.ndim != 2:
        raise ValueError(f"cannot store results of shapes {sorted({a.shape for a in arrays})} in one column")
    return pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(flat, first.shape[1]))


def _data_columns(batch: pa.Table) -> list[str]:
    return [repr(name) for name in batch.column_names if name != PATH_COLUMN]


def _where(batch: pa.Table, row: int | None = None) -> str:
    paths = batch.column(PATH_COLUMN)
    return str(paths[0 if row is None else row])
