"""Error answers: OpenAI's shape everywhere, ``{"error": {"message", "type", "param", "code"}}``,
except on the routes of Text Embeddings Inference's API, which answer TEI's own shape.

OpenAI's ``code`` is the HTTP status, as vLLM sends it; ``type`` is OpenAI's name for the class of
error. TEI's shape is ``{"error": "...", "error_type": "Validation"}``, the status following from
the type as in TEI (:data:`TEI_STATUS`); TEI's routes use :class:`TeiRoute`, which answers every
error they raise in that shape, including the body validation FastAPI does before the route runs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal, get_args

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic_core.core_schema import ErrorType
from starlette.exceptions import HTTPException
from starlette.responses import Response

from poolrunner.core.errors import (
    InvalidRequestError,
    LoopClosedError,
    NonFiniteOutputError,
    PromptTooLongError,
    QueueFullError,
    StepFailedError,
    UnsupportedTaskError,
)
from poolrunner.core.validators import shown

logger = logging.getLogger("poolrunner.core.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "request_timeout",
    413: "request_too_large",
    422: "unprocessable_entity",
    431: "request_too_large",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An answer other than 200 that a route decides on (a wrong model name, too many inputs)."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class ErrorDetail(pydantic.BaseModel):
    """What went wrong, in OpenAI's fields (:class:`ErrorAnswer`)."""

    message: str
    type: str = pydantic.Field(description="OpenAI's class of error: invalid_request_error, not_found_error, ...")
    param: str | None = pydantic.Field(description="The request field at fault, when one is")
    code: int = pydantic.Field(description="The HTTP status, as vLLM sends it")


class ErrorAnswer(pydantic.BaseModel):
    """OpenAI's error body (:func:`error_body`), documented as every non-TEI route's 4xx and 5xx."""

    error: ErrorDetail


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """:class:`ErrorAnswer` as a dict: ``type`` from :data:`ERROR_TYPES`."""
    detail = ErrorDetail(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param, code=status)
    return ErrorAnswer(error=detail).model_dump()


async def send_error(send: Callable[[dict[str, Any]], Awaitable[None]], status: int, message: str,
                     headers: Sequence[tuple[bytes, bytes]] = (), tei_error_type: TeiErrorType | None = None) -> None:
    """Answer :func:`error_body` as JSON through an ASGI ``send``, with ``headers`` besides the
    content type and length: for the layers below FastAPI's exception handlers (the middleware,
    the connection cap, Ray Serve's proxies). With ``tei_error_type``, TEI's body instead
    (``{"error", "error_type"}``, for TEI's own routes), the status unchanged."""
    answer = (error_response(status, message) if tei_error_type is None
              else tei_error_response(TeiError(tei_error_type, message, status=status)))
    body = answer.body  # serialized as every other error
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def install_handlers(app: FastAPI) -> None:
    """Map poolrunner's errors, FastAPI's validation errors and Starlette's HTTP errors."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, public_text(request, str(exc)), exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, *_describe(exc.errors(), request))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        answer = error_response(exc.status_code, _routing_detail(request, exc) or _http_detail(exc))
        answer.headers.update(exc.headers or {})  # a 405's Allow
        return answer

    for bad_input in (InvalidRequestError, UnsupportedTaskError):
        app.add_exception_handler(bad_input, _status_handler(400))
    @app.exception_handler(PromptTooLongError)
    async def prompt_too_long(request: Request, exc: PromptTooLongError) -> JSONResponse:
        return error_response(400, public_text(request, f"{exc}, or ask the operator for --truncate-prompt-tokens "
                                                        "(the default of clients that cannot send it)"),
                              exc.param or "truncate_prompt_tokens")

    app.add_exception_handler(NonFiniteOutputError, _status_handler(422))

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        answer = error_response(429, public_text(request, str(exc)))
        answer.headers["Retry-After"] = "1"  # a second: the queue drains a step at a time
        return answer

    app.add_exception_handler(LoopClosedError, _status_handler(503))

    @app.exception_handler(StepFailedError)
    async def step_failed(request: Request, exc: StepFailedError) -> JSONResponse:
        return error_response(500, step_failure_text(request, exc))


def _status_handler(status: int):
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return error_response(status, public_text(request, str(exc)), getattr(exc, "param", None))

    return handle


def step_failure_text(request: Request | None, exc: StepFailedError) -> str:
    """Log a failed engine step's cause under the request's id and return the client's text: the
    id only, since the cause (an exception's text) may hold paths or other clients' data."""
    request_id = request.scope.get("state", {}).get("request_id", "?") if request is not None else "?"
    logger.error("the engine step running request %s failed", request_id, exc_info=exc.__cause__ or exc)
    return f"the engine step running this request failed (request id {request_id}); the server logged the cause"


def _routing_detail(request: Request, exc: HTTPException) -> str | None:
    """Starlette's bare "Not Found" / "Method Not Allowed" as a sentence naming the method and
    path, and for a 405 the methods the path takes; ``None`` for any other HTTP error."""
    path = shown(request.url.path)
    if exc.status_code == 404 and exc.detail == "Not Found":
        return f"no route {request.method} {path}: the routes are listed at /docs"
    if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
        return f"{path} takes {exc.headers['Allow']}, not {request.method}"
    return None


def _http_detail(exc: HTTPException) -> str:
    """An HTTP error's text. FastAPI answers a body that Python's JSON parser refuses for other than
    its syntax (not UTF-8, nested too deeply, an integer of too many digits) with a 400 that does not
    say why: say it, as for malformed JSON."""
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return (f"the request body holds an integer of more than {sys.get_int_max_str_digits():,} digits, more than "
                "its JSON can be read with")
    if exc.status_code == 400 and isinstance(cause, ValueError | RecursionError):
        return f"the request body is not valid JSON: {cause}"
    return str(exc.detail)


EXTRA_FIELDS_HINT = "a field this server does not know is refused; --allow-extra-fields drops such fields instead"
"""Said after a body's unknown field: clients written for a server that ignores them (vLLM's way)
work once the operator allows it."""


def _describe(errors: Any, request: Request | None) -> tuple[str, str | None]:
    """One sentence per pydantic error, naming the field: ``body.input: Input should be ...``; for
    a body that was not read as JSON, the content type it came with (:func:`_not_json`)."""
    errors = list(errors)
    if not errors:
        return "invalid request", None
    if (not_json := _not_json(errors[0], request)) is not None:
        return not_json, None
    if errors[0].get("type") == "json_invalid":
        reason = errors[0].get("ctx", {}).get("error", "parse error")
        position = next((part for part in errors[0].get("loc", ()) if isinstance(part, int)), None)
        where = "" if position is None else f" (at character {position})"
        return f"the request body is not valid JSON: {reason}{where}", None
    lines, fields = [], []
    for error in errors[:5]:
        location = ".".join(_location(error))
        fields.append(location)
        lines.append(f"{location or 'body'}: {error.get('msg')}{_given(error, location)}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    if any(error.get("type") == "extra_forbidden" and len(_location(error)) == 1
           for error in errors):  # a field of the body itself: the ones --allow-extra-fields drops
        more += f" ({EXTRA_FIELDS_HINT})"
    return "; ".join(lines) + more, fields[0].split(".")[0] or None


def _location(error: dict[str, Any]) -> list[str]:
    """Where in the body pydantic's ``error`` is: its ``loc`` without FastAPI's leading ``body``."""
    return [str(part) for part in error.get("loc", ()) if part != "body"]


_PYDANTIC_ERRORS = frozenset(get_args(ErrorType)) - {"missing", "extra_forbidden", "value_error", "assertion_error"}
"""pydantic's own refusals of a value, whose messages do not repeat it (``Input should be a valid
integer``); the server's own messages (custom error types, validators' ``ValueError``) name it."""


def _given(error: dict[str, Any], location: str) -> str:
    """What the client sent where pydantic itself refused a value of one piece (a number, a
    string, a boolean, null), as the server's other messages show a value (:func:`shown`: cut
    short, a lone surrogate escaped): ``, got nan``; nothing for a missing or unknown field, a
    list or object, or a message of the server's own. A missing body says so."""
    kind, value = error.get("type"), error.get("input")
    if kind == "missing" and not location:
        return " (the request has no body: send a JSON object)"
    if kind not in _PYDANTIC_ERRORS or not (value is None or isinstance(value, str | int | float | bool)):
        return ""
    return f", got {shown(value)}"


def _not_json(error: dict[str, Any], request: Request | None) -> str | None:
    """FastAPI reads a body as JSON only under a JSON content type (``application/json``, or
    ``+json``); under another (``curl -d``'s form encoding, ``text/plain``) or none, the route's
    model gets the raw bytes and pydantic's error does not say why. Say it, naming the type."""
    if error.get("loc") != ("body",) or not isinstance(error.get("input"), bytes) or request is None:
        return None
    content_type = request.headers.get("content-type")
    sent = f"it came with Content-Type: {content_type}" if content_type else "it came without a Content-Type header"
    return f"the request body is read as JSON only when sent with Content-Type: application/json; {sent}"


# --------------------------------------------------------------------------- TEI's shape

TeiErrorType = Literal["Validation", "Tokenizer", "Backend", "Overloaded", "Empty", "Unhealthy"]

TEI_STATUS: dict[str, int] = {
    "Validation": 422, "Tokenizer": 422, "Backend": 424, "Overloaded": 429, "Empty": 400, "Unhealthy": 503,
}
"""TEI's status for each ``error_type`` (its ``ErrorType`` -> ``StatusCode`` map)."""


class TeiErrorAnswer(pydantic.BaseModel):
    """TEI's error body (:func:`tei_error_response`), documented as TEI's routes' 4xx and 5xx."""

    error: str
    error_type: TeiErrorType


def documented_errors(answer: Any) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` naming ``answer`` (:class:`ErrorAnswer`, :class:`TeiErrorAnswer` or
    their union, on the routes TEI shares) as a route's error body. A ``4XX`` entry also keeps
    FastAPI from listing its own 422 ``HTTPValidationError``, which this server never answers."""
    shape = {ErrorAnswer: "OpenAI's", TeiErrorAnswer: "TEI's"}.get(answer, "OpenAI's, or TEI's for TEI's body,")
    return {"4XX": {"model": answer, "description": f"The request is refused: {shape} error body"},
            "5XX": {"model": answer, "description": f"The server cannot answer now: {shape} error body"}}


SHARED_WITH_TEI = documented_errors(ErrorAnswer | TeiErrorAnswer)
"""The error bodies of the routes that also take TEI's bodies (``/rerank``, ``/tokenize``, ``/invocations``)."""


class TeiError(Exception):
    """An error answered in TEI's shape.

    :param error_type: TEI's class of error; it sets the status unless ``status`` is given.
    :param status: Only for a status TEI does not derive from the type (413: the body is too large).
    """

    def __init__(self, error_type: TeiErrorType, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.status = status or TEI_STATUS[error_type]


def tei_error_response(error: TeiError, request: Request | None = None) -> JSONResponse:
    """``{"error": message, "error_type": type}`` with the error's status (the message as
    :func:`public_text` makes it, where a request is given)."""
    message = str(error) if request is None else public_text(request, str(error))
    return JSONResponse({"error": message, "error_type": error.error_type}, status_code=error.status)


def public_text(request: Request, text: str) -> str:
    """``text`` as a client may read it: the model's folder (a path on this machine, as the
    Python API names the model) replaced by the served model name."""
    router = getattr(request.app.state, "router", None)
    return router.public_text(text) if router is not None else text


def as_tei_error(exc: Exception, request: Request | None) -> TeiError | None:
    """What ``exc`` is in TEI's terms; ``None`` for an exception that is not a client's answer
    (a bug: the server's 500)."""
    if isinstance(exc, TeiError):
        return exc
    if isinstance(exc, RequestValidationError | pydantic.ValidationError):
        return TeiError("Validation", _describe(exc.errors(), request)[0])
    if isinstance(exc, UnsupportedTaskError):  # TEI: "model is not a re-ranker model" and its kin
        return TeiError("Backend", str(exc))
    if isinstance(exc, InvalidRequestError):
        return TeiError("Validation", str(exc))
    if isinstance(exc, QueueFullError):
        return TeiError("Overloaded", str(exc))
    if isinstance(exc, NonFiniteOutputError):  # TEI's inference failures are the backend's (424)
        return TeiError("Backend", str(exc))
    if isinstance(exc, StepFailedError):  # TEI: an inference failure is the backend's (424)
        return TeiError("Backend", step_failure_text(request, exc))
    if isinstance(exc, LoopClosedError):
        return TeiError("Unhealthy", str(exc))
    if isinstance(exc, ApiError):  # the service's own limits: not serving (503), else bad input (413: too large)
        return TeiError("Unhealthy" if exc.status == 503 else "Validation", str(exc),
                        status=exc.status if exc.status in (413, 499, 503) else None)
    if isinstance(exc, HTTPException):  # raised while FastAPI reads the body: over the size limit, or not JSON
        return TeiError("Validation", _http_detail(exc), status=exc.status_code if exc.status_code != 400 else None)
    return None


class TeiRoute(APIRoute):
    """A route that answers every error in TEI's shape (give it to TEI's ``APIRouter``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_in_tei_shape(request: Request) -> Response:
            return await in_tei_shape(request, handle(request))

        return handle_in_tei_shape


async def in_tei_shape(request: Request, answer: Awaitable[Any]) -> Any:
    """``answer`` awaited, a client's error in it answered in TEI's shape: for TEI's routes, and
    for TEI's bodies on the routes TEI shares with vLLM. A bug still propagates (a 500)."""
    try:
        return await answer
    except Exception as exc:
        error = as_tei_error(exc, request)
        if error is None:
            raise
        return tei_error_response(error, request)
