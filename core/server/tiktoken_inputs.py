"""Token ids of OpenAI's tokenizer as ``/v1/embeddings`` inputs (``--token-id-inputs tiktoken:NAME``).

OpenAI's embeddings API takes token ids of OpenAI's tokenizer (tiktoken's ``cl100k_base`` for
``text-embedding-3-small``, ``-3-large`` and ``text-embedding-ada-002``), and some clients send
nothing else: LangChain's ``OpenAIEmbeddings`` at its defaults (``check_embedding_ctx_length``
true) encodes each text with tiktoken (``encode_ordinary``), cuts the ids into lists of
``embedding_ctx_length`` (8191) and sends the lists; when a text made several, it averages their
vectors weighted by each list's length and normalizes the mean (``langchain_openai.embeddings.base``).
A model reads its own token ids, so such lists are other tokens: a wrong vector, or a 400.

With the setting each list is decoded with the named encoding back to its UTF-8 text, which the
model's tokenizer then tokenizes as any text: the vector is the one the text itself gets. With
``token_id_chunk_length`` (LangChain's 8191) a list of exactly that many ids is continued by the
next one: the lists are joined (as bytes: a cut may fall inside a character) into one text,
embedded once, and every list of it answered with that vector, which LangChain's weighted mean
of equal unit vectors returns unchanged. A client that cuts texts to that many ids and sends
others after them in one request would have them joined, so that part is opt-in.

The encoding is read only from tiktoken's cache (``TIKTOKEN_CACHE_DIR``, else
``DATA_GYM_CACHE_DIR``, else ``<tmp>/data-gym-cache``, where tiktoken keeps the file it downloads
as the SHA-1 of its URL), checked against tiktoken's SHA-256: poolrunner never downloads.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attrs import frozen

from poolrunner.core.frontend.requests import Input, is_token_ids
from poolrunner.core.server.errors import ApiError

SETTING = "--token-id-inputs tiktoken:cl100k_base (env POOLRUNNER_TOKEN_ID_INPUTS)"
"""How errors name the setting."""

ENCODINGS = {
    "cl100k_base": ("https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
                    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "o200k_base": ("https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
                   "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
}
"""The encodings served: each one's file URL and SHA-256, as ``tiktoken_ext.openai_public`` has them."""

OPENAI_EMBEDDING_MODELS = frozenset({"text-embedding-3-small", "text-embedding-3-large", "text-embedding-ada-002"})
"""OpenAI's embedding models, whose token ids are ``cl100k_base``'s: a token-id request naming one
comes from an OpenAI client's tokenizer."""


def encoding_name(spec: str) -> str:
    """The encoding ``spec`` (``tiktoken:NAME``) names.

    :raises ValueError: for another form, or an encoding not in :data:`ENCODINGS`.
    """
    kind, _, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind != "tiktoken" or name not in ENCODINGS:
        raise ValueError(f"token_id_inputs (--token-id-inputs) must be tiktoken:NAME with NAME one of "
                         f"{sorted(ENCODINGS)}, got {spec!r}")
    return name


def cache_file(name: str) -> Path | None:
    """Where tiktoken caches encoding ``name``'s file; ``None`` when ``TIKTOKEN_CACHE_DIR`` is empty
    (tiktoken's switch for no cache)."""
    folder = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if folder == "":
        return None
    folder = folder or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return Path(folder) / hashlib.sha1(ENCODINGS[name][0].encode()).hexdigest()


@functools.cache
def load_encoding(spec: str) -> Any:
    """The ``tiktoken.Encoding`` ``spec`` names, read from tiktoken's cache, never downloaded.

    :raises ValueError: for a bad ``spec`` (:func:`encoding_name`), tiktoken not installed, or the
        encoding's file missing from the cache or not tiktoken's (SHA-256), naming ``TIKTOKEN_CACHE_DIR``.
    """
    name = encoding_name(spec)
    try:
        import tiktoken
    except ImportError:
        raise ValueError("token_id_inputs needs tiktoken: pip install 'poolrunner[tiktoken]'") from None
    path = cache_file(name)
    how = (f"poolrunner never downloads it: copy the cache folder of a machine where tiktoken.get_encoding"
           f"({name!r}) ran (its file {ENCODINGS[name][0].rsplit('/', 1)[1]} is kept as {path and path.name}) and "
           "point TIKTOKEN_CACHE_DIR at it")
    if path is None or not path.is_file():
        raise ValueError(f"tiktoken's {name} encoding is not in tiktoken's cache "
                         f"({path or 'TIKTOKEN_CACHE_DIR is empty: no cache'}); {how}")
    if hashlib.sha256(path.read_bytes()).hexdigest() != ENCODINGS[name][1]:
        raise ValueError(f"{path} is not tiktoken's {name} file (its SHA-256 differs); {how}")
    return tiktoken.get_encoding(name)  # reads the file just checked: tiktoken fetches only on a miss


FOREIGN_IDS_HINT = ("token ids are read as this model's own; an OpenAI client's tiktoken ids (LangChain's "
                    f"OpenAIEmbeddings at its defaults sends cl100k_base's) need the server's {SETTING}")
"""What a 400 for token ids that look like tiktoken's adds."""


@frozen
class Decoded:
    """A body's inputs with the token-id lists decoded to texts.

    :ivar inputs: The inputs to embed: texts as sent, each (joined) id list as its text.
    :ivar owners: For each input the body sent, the index in :attr:`inputs` of its text: its
        answer is that one's vector.
    """

    inputs: list[Input]
    owners: list[int]

    def answers(self, outputs: Sequence[Any]) -> list[Any]:
        """``outputs`` (one per :attr:`inputs`) as one per input sent."""
        return [outputs[owner] for owner in self.owners]


def read_inputs(settings: Any, model: str | None, items: Sequence[Input]) -> Decoded:
    """``items`` of a ``/v1/embeddings`` body as ``settings`` (a ``ServerSettings``) reads token ids:
    decoded with its :attr:`token_id_inputs` encoding (:func:`decode_inputs`), else as they are.

    :raises ApiError: 400 naming the setting when it is off and the body's ``model`` is one of
        :data:`OPENAI_EMBEDDING_MODELS` (an alias of this model) with token ids among ``items``; as
        :func:`decode_inputs`.
    """
    if settings.token_id_inputs is not None:
        return decode_inputs(load_encoding(settings.token_id_inputs), items, settings.token_id_chunk_length)
    if model in OPENAI_EMBEDDING_MODELS and any(is_token_ids(item) for item in items):
        raise ApiError(400, f"the request names OpenAI's {model} and sends token ids: {FOREIGN_IDS_HINT}",
                       param="input")
    return Decoded(inputs=list(items), owners=list(range(len(items))))


def decode_inputs(encoding: Any, items: Sequence[Input], chunk_length: int | None) -> Decoded:
    """``items`` with each token-id list decoded by ``encoding``; with ``chunk_length``, a list of
    exactly that many ids and the lists after it, up to one that is shorter, are one text.

    :raises ApiError: 400 for an id the encoding does not have, or lists whose bytes are not UTF-8
        text (a cut inside a character that no following list completes), naming the input.
    """
    inputs: list[Input] = []
    owners: list[int] = []
    pending: list[bytes] = []  # the lists of the text being joined
    for index, item in enumerate(items):
        if not is_token_ids(item):
            inputs.append(item)
            owners.append(len(inputs) - 1)
            continue
        pending.append(_bytes(encoding, item, index))
        owners.append(len(inputs))
        following = index + 1 < len(items) and is_token_ids(items[index + 1])
        if not (chunk_length and len(item) == chunk_length and following):
            inputs.append(_text(b"".join(pending), index - len(pending) + 1, index))
            pending = []
    return Decoded(inputs=inputs, owners=owners)


def _bytes(encoding: Any, ids: Sequence[int], index: int) -> bytes:
    try:
        return encoding.decode_bytes([int(token) for token in ids])
    except (KeyError, OverflowError):  # an id it lacks (cl100k_base has gaps), or a negative one
        bad = next(token for token in ids if not _is_token(encoding, int(token)))
    raise ApiError(400, f"input[{index}]: token id {bad} is not a token of tiktoken's {encoding.name} "
                        f"(token ids are read as {encoding.name}'s, --token-id-inputs)", param="input")


def _is_token(encoding: Any, token: int) -> bool:
    try:
        encoding.decode_single_token_bytes(token)
    except (KeyError, OverflowError):
        return False
    return True


def _text(data: bytes, first: int, last: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"input[{first}]" if first == last else f"input[{first}..{last}] (joined)"
        raise ApiError(400, f"{where}: the token ids decode to bytes that are not UTF-8 text ({exc.reason} at byte "
                            f"{exc.start}): send a text's whole token ids", param="input") from None
