"""Every error answer in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``code`` is the HTTP status, as vLLM sends it; ``type`` is OpenAI's name for the class of error.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from poolrunner.core.errors import (
    InvalidRequestError,
    LoopClosedError,
    QueueFullError,
    StepFailedError,
    UnsupportedTaskError,
)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
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


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def install_handlers(app: FastAPI) -> None:
    """Map poolrunner's errors, FastAPI's validation errors and Starlette's HTTP errors."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, *_describe(exc.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    for bad_input in (InvalidRequestError, UnsupportedTaskError):
        app.add_exception_handler(bad_input, _status_handler(400))
    app.add_exception_handler(QueueFullError, _status_handler(429))
    app.add_exception_handler(LoopClosedError, _status_handler(503))
    app.add_exception_handler(StepFailedError, _status_handler(500))


def _status_handler(status: int):
    async def handle(_request: Request, exc: Exception) -> JSONResponse:
        return error_response(status, str(exc))

    return handle


def _describe(errors: Any) -> tuple[str, str | None]:
    """One sentence per pydantic error, naming the field: ``body.input: Input should be ...``."""
    errors = list(errors)
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        return f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', 'parse error')}", None
    lines, fields = [], []
    for error in errors[:5]:
        location = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        fields.append(location)
        lines.append(f"{location or 'body'}: {error.get('msg')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(lines) + more, fields[0].split(".")[0] or None
