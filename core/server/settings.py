"""What ``poolrunner serve`` is told beyond the model: its name, its key and its limits."""

from __future__ import annotations

from collections.abc import Sequence

from attrs import Attribute, field, frozen

from poolrunner.core.server.admission import default_budget
from poolrunner.core.validators import check_seconds, one_of, positive_int

SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's ``--scheduling-policy``: first come first served (a request's ``priority`` must be 0 or
absent), or ``priority`` (lower runs first, within :data:`MAX_PRIORITY`)."""
MAX_PRIORITY = 1000
"""The largest ``|priority|`` a request may ask for under priority scheduling."""


def served_names(names: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``served_model_name`` as a tuple of distinct names in order (``None`` stays ``None``).

    :raises ValueError: for an empty list or an empty (or non-string) name.
    """
    if names is None:
        return None
    names = (names,) if isinstance(names, str) else tuple(names)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"served_model_name must be one or more non-empty names, got {list(names)!r}")
    return tuple(dict.fromkeys(names))


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""The names of this machine as a loopback client sends them in ``Host``."""


def host_names(names: Sequence[str] | None) -> tuple[str, ...] | None:
    """``allowed_hosts`` as a tuple of lower-case names; ``None`` or a ``*`` among them: any host.

    :raises ValueError: for an empty list or an empty name.
    """
    if names is None:
        return None
    names = tuple(name.strip().lower() for name in names)
    if not names or not all(names):
        raise ValueError(f"allowed_hosts must be one or more host names, got {list(names)!r}")
    return None if "*" in names else names


def optional_truncation(_instance: object, attribute: Attribute, value: int | None) -> None:
    """:raises ValueError: unless ``value`` is ``None``, -1 or a positive integer."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1)):
        raise ValueError(f"{attribute.name} must be -1 (the model maximum) or a positive number of tokens, "
                         f"got {value!r}")


def non_negative_seconds(_instance: object, attribute: Attribute, value: float) -> None:
    """:raises InvalidRequestError: (a ``ValueError``) for a negative, infinite or NaN number of seconds."""
    check_seconds(attribute.name, value, zero=True)


def check_token_id_inputs(_instance: object, _attribute: object, spec: str | None) -> None:
    """:raises ValueError: unless ``spec`` is ``None`` or names a tiktoken encoding in tiktoken's
    cache (:func:`~poolrunner.core.server.tiktoken_inputs.load_encoding`, which loads it once)."""
    if spec is not None:
        from poolrunner.core.server.tiktoken_inputs import load_encoding  # FastAPI's: the CLI reads this module

        load_encoding(spec)


def check_api_key(_instance: object, _attribute: object, key: str | None) -> None:
    """A key that is set must be usable: an empty one would leave the server open, one with
    surrounding whitespace (a newline read from a file) would lock every client out. The key
    itself is never put in the message.

    :raises ValueError: for an empty or whitespace-only key, or one with leading or trailing whitespace.
    """
    if key is None:
        return
    if not key.strip():
        raise ValueError("the API key is empty or only whitespace, which would leave the server open to anyone; "
                         "set a key, or leave --api-key and POOLRUNNER_API_KEY unset for an open server")
    if key != key.strip():
        raise ValueError("the API key has leading or trailing whitespace (a newline read from a file?), which no "
                         "client sends, so every request would be refused; strip it")


@frozen(kw_only=True)
class ServerSettings:
    """Settings of one server app; the defaults are those of ``poolrunner serve``.

    :ivar served_model_name: The names clients may pass as ``model`` (a name, or several as vLLM's
        ``--served-model-name`` takes them: aliases of the one model); answers report the first,
        ``/v1/models`` lists each. Kept as a tuple. ``None``: the model folder's name
        (``all-MiniLM-L6-v2`` for the default model). For an app of one runtime only: several
        models each carry their own names (:class:`~poolrunner.core.server.models.ServedModel`).
    :ivar api_key: When set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``;
        empty, whitespace-only or padded with whitespace is refused (:func:`check_api_key`).
    :ivar max_inputs_per_request: Most inputs (texts, token-id lists, documents) in one request
        (OpenAI's embeddings limit is 2048, which OpenAI clients batch up to; TEI's 32 would refuse
        them); more is a 400.
    :ivar max_request_bytes: Largest accepted request body, bytes (TEI's ``--payload-limit``,
        2,000,000); larger is a 413. It bounds the text one request makes the server read.
    :ivar max_waiting_requests: Most inputs queued or running in the engine at once, over all
        clients; a request that would pass it is answered 429 at once, or 413 when it alone needs
        more engine requests than this (a bi-encoder's score: each distinct text; a long input:
        each window), which no wait would make fit.
    :ivar max_output_values: Most values (tokens x hidden size) the per-token outputs of one
        request may hold (``token_embed``, ``token_classify``); more is a 413, before any work: a
        request of 2,048 long inputs would otherwise make the server build gigabytes of JSON.
    :ivar max_output_values_in_flight: Most per-token output values held by all requests at once,
        over every model of the server, from admission until the answer is sent
        (:class:`~poolrunner.core.server.admission.OutputBudget`); a request that would pass it
        waits, first come first served. ``None`` (the default): a quarter of the machine's
        memory at 48 bytes a value (:func:`~poolrunner.core.server.admission.default_budget`),
        at least ``max_output_values``; set, it must be at least ``max_output_values``.
    :ivar drain_timeout: Seconds that requests in flight get to finish after SIGTERM (finite, >= 0).
    :ivar scheduling_policy: One of :data:`SCHEDULING_POLICIES`, vLLM's ``--scheduling-policy``:
        under ``fcfs`` (the default) a request asking for a ``priority`` other than 0 is a 400, so
        no client can push its work ahead of others' unless the operator allows it.
    :ivar auto_truncate: TEI's ``--auto-truncate``, on by default as in TEI: TEI's routes
        (``/embed``, ``/predict``...) keep the model maximum of tokens of an over-long input when
        the request does not say ``truncate`` (TEI clients such as Chroma's send none and cannot
        recover from the error); off, such an input is a 422 unless the request asks for
        ``truncate: true``.
    :ivar allow_extra_fields: Accept request bodies with fields the endpoint does not know, and
        log them (vLLM's behaviour) instead of answering a 400 naming the field.
    :ivar allowed_origins: Origins whose browser pages may call the API (CORS; ``*`` for any);
        empty: no CORS headers, as TEI and vLLM by default.
    :ivar allow_runtime_lora: Serve ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
        (behind the API key, when set); off: they answer 404 (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
    :ivar allowed_hosts: The ``Host`` header values (names or addresses, without the port;
        ``*.example.com`` for its subdomains) a request may carry; another is a 400, which stops a
        DNS-rebinding page from reaching a key-less local server. ``None`` (the default here) or
        ``("*",)``: any; ``poolrunner serve`` defaults to :data:`LOOPBACK_HOSTS` when it listens on a
        loopback address.
    :ivar any_model_name: A single-model server answers a request whatever its ``model`` names
        (TEI's behaviour), so clients' default names (``text-embedding-3-small``, Cohere's
        ``rerank-v3.5``, infinity's ``default/not-specified``) reach it; the first unknown name is
        logged once. Off (vLLM's behaviour), an unknown name is a 404 naming this setting.
    :ivar truncate_prompt_tokens: The ``truncate_prompt_tokens`` of an OpenAI, vLLM, Jina or
        Cohere body that sets none (-1: the model maximum; ``None``, the default as in vLLM: an
        over-long input is a 400), for clients that cannot send the field (Chroma's and
        Haystack's OpenAI embedders). TEI's routes follow ``auto_truncate`` instead.
    :ivar token_id_inputs: ``tiktoken:NAME`` (``cl100k_base``: OpenAI's embedding models'): the
        token-id lists of ``/v1/embeddings`` are that tiktoken encoding's ids (OpenAI clients', e.g.
        LangChain's ``OpenAIEmbeddings`` at its defaults), decoded to their text, which the model's
        tokenizer tokenizes (:mod:`~poolrunner.core.server.tiktoken_inputs`); the encoding must be in
        tiktoken's cache (``TIKTOKEN_CACHE_DIR``), checked here. ``None`` (default): they are the
        model's ids, and lists that look like tiktoken's are a 400 naming this setting.
    :ivar token_id_chunk_length: With :attr:`token_id_inputs`, a list of exactly this many ids is
        continued by the next list (LangChain cuts a text into lists of ``embedding_ctx_length``,
        8191): the lists are embedded as one text and each answered with its vector. ``None``
        (default): each list is its own text, as OpenAI's API reads them.
    :ivar protect_metrics: ``/metrics`` needs the API key too; by default it is open, as TEI and
        vLLM leave it to the network.
    """

    served_model_name: tuple[str, ...] | None = field(default=None, converter=served_names)
    api_key: str | None = field(default=None, validator=check_api_key)
    max_inputs_per_request: int = field(default=2048, validator=positive_int)
    max_request_bytes: int = field(default=2_000_000, validator=positive_int)
    max_waiting_requests: int = field(default=8192, validator=positive_int)
    max_output_values: int = field(default=1 << 24, validator=positive_int)
    max_output_values_in_flight: int | None = field(default=None, validator=positive_int)
    drain_timeout: float = field(default=30.0, validator=non_negative_seconds)
    scheduling_policy: str = field(default="fcfs", validator=one_of(SCHEDULING_POLICIES))
    auto_truncate: bool = True
    allow_extra_fields: bool = False
    allowed_origins: tuple[str, ...] = field(default=(), converter=tuple)
    protect_metrics: bool = False
    allow_runtime_lora: bool = False
    any_model_name: bool = False
    truncate_prompt_tokens: int | None = field(default=None, validator=optional_truncation)
    allowed_hosts: tuple[str, ...] | None = field(default=None, converter=host_names)
    token_id_inputs: str | None = field(default=None, validator=check_token_id_inputs)
    token_id_chunk_length: int | None = field(default=None, validator=positive_int)

    def __attrs_post_init__(self) -> None:
        if self.max_inputs_per_request > self.max_waiting_requests:
            raise ValueError(
                f"max_inputs_per_request ({self.max_inputs_per_request}) is larger than "
                f"max_waiting_requests ({self.max_waiting_requests}): such a request could never be queued"
            )
        if self.token_id_chunk_length is not None and self.token_id_inputs is None:
            raise ValueError("token_id_chunk_length joins lists of tiktoken ids: it needs token_id_inputs")
        if self.max_output_values_in_flight is not None and self.max_output_values_in_flight < self.max_output_values:
            raise ValueError(
                f"max_output_values_in_flight ({self.max_output_values_in_flight}) is smaller than max_output_values "
                f"({self.max_output_values}): a request within the one could never fit the other"
            )

    @property
    def output_budget(self) -> int:
        """``max_output_values_in_flight``, or its default for this machine."""
        if self.max_output_values_in_flight is not None:
            return self.max_output_values_in_flight
        return default_budget(self.max_output_values)

