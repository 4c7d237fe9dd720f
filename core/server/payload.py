"""How arrays travel in an answer: JSON lists, base64, or vLLM's ``bytes`` body with its
``metadata`` header; float element type (``embed_dtype``) and byte order (``endianness``) as vLLM
writes them."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
"""The integer type whose bits stand for a float type numpy lacks."""


def array_bytes(array: np.ndarray, embed_dtype: str = "float32", endianness: str = "native") -> bytes:
    """The array's row-major bytes in ``endianness`` order (``native``: the server's): float
    arrays as ``embed_dtype`` (rounded to nearest, as ``torch.Tensor.to`` rounds), int8 / uint8
    arrays (quantized embeddings) as they are, other integer arrays as int64."""
    if np.issubdtype(array.dtype, np.integer):
        data = np.ascontiguousarray(array if array.dtype in (np.int8, np.uint8) else array.astype(np.int64))
    else:
        dtype = _FLOAT_DTYPES[embed_dtype]
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(dtype)
        data = tensor.view(_BITS.get(dtype, dtype)).numpy()
    order = sys.byteorder if endianness == "native" else endianness
    if order != sys.byteorder and data.dtype.itemsize > 1:
        data = data.byteswap()
    return data.tobytes()


def encode_array(array: np.ndarray, encoding_format: str, embed_dtype: str = "float32",
                 endianness: str = "native", *, lists: bool = True) -> Any:
    """Nested lists (integer arrays as ints, floats as float32 values whatever ``embed_dtype``),
    or the base64 of :func:`array_bytes`; with ``lists=False`` the array itself instead of lists,
    for :func:`json_body` to write."""
    if encoding_format == "base64":
        return base64.b64encode(array_bytes(array, embed_dtype, endianness)).decode("ascii")
    return array.tolist() if lists else array


def json_body(content: Any) -> bytes:
    """``content`` as JSON bytes, written as Starlette's ``JSONResponse`` writes them (compact,
    UTF-8, NaN refused with ``ValueError``), its numpy arrays as nested lists (:func:`_rows`).

    An array becomes Python lists one row at a time, each freed once written: a big per-token
    answer never exists as lists of Python floats (about 32 bytes a value) all at once, and the
    interpreter may switch threads between rows, so the event loop keeps answering while a
    worker thread writes (:func:`json_response`).
    """
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_rows).encode()


def _rows(value: Any) -> Any:
    """``json.dumps``'s ``default``: a 1-d (or 0-d) array as a list of Python numbers, a deeper one
    as the list of its rows (each written by a further call).

    :raises TypeError: for anything else, as ``json.dumps`` does.
    """
    if isinstance(value, np.ndarray):
        return value.tolist() if value.ndim <= 1 else list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


async def json_response(content: Any) -> Response:
    """A JSON answer of ``content`` (:func:`json_body`), written in a worker thread: a big
    answer does not hold the event loop (``/health``, other clients) while it is written."""
    return Response(await run_in_threadpool(json_body, content), media_type="application/json")


def payload_dtype(array: np.ndarray, embed_dtype: str, precision: str = "float32") -> str:
    """The element type ``bytes`` metadata names for ``array``: ``embed_dtype`` for floats, the
    ``precision`` of a quantized embedding, ``int64`` for other integer outputs."""
    if not np.issubdtype(array.dtype, np.integer):
        return embed_dtype
    return precision if precision != "float32" else "int64"


def bytes_response(arrays: Sequence[np.ndarray], *, embed_dtype: str, endianness: str, metadata: bool,
                   response_id: str, created: int, model: str, num_tokens: int,
                   precision: str = "float32") -> Response:
    """vLLM's ``encoding_format="bytes"`` answer: an ``application/octet-stream`` body of every
    array's bytes (:func:`array_bytes`) in input order, and a ``metadata`` header, the JSON of
    ``{id, created, model, data, usage}`` whose ``data`` gives each array's ``index``,
    ``embed_dtype``, ``endianness``, ``start`` and ``end`` (byte offsets) and ``shape``;
    ``bytes_only`` (``metadata=False``) sends the body alone."""
    chunks, items, offset = [], [], 0
    for index, array in enumerate(arrays):
        chunk = array_bytes(array, embed_dtype, endianness)
        items.append({"index": index, "embed_dtype": payload_dtype(array, embed_dtype, precision),
                      "endianness": endianness, "start": offset, "end": offset + len(chunk),
                      "shape": list(array.shape)})
        chunks.append(chunk)
        offset += len(chunk)
    headers = None
    if metadata:
        headers = {"metadata": json.dumps({
            "id": response_id, "created": created, "model": model, "data": items,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        })}
    return Response(b"".join(chunks), media_type="application/octet-stream", headers=headers)
