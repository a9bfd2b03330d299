"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

| cause | status | type / code |
|---|---|---|
| malformed JSON, unknown or mistyped field, bad value, prompt past the context | 400 | invalid_request_error |
| unknown model | 404 | invalid_request_error / model_not_found |
| body over the size cap | 413 | invalid_request_error / request_too_large |
| admission queue full (``EngineOverloaded``) | 429 + Retry-After | rate_limit_error / engine_overloaded |
| starting, draining, or the engine died | 503 | server_error / engine_starting, engine_draining, engine_dead |
| this request failed inside the engine (e.g. out of memory) | 500 | server_error / request_failed |
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from ember.errors import (
    EngineDead,
    EngineDraining,
    EngineError,
    EngineOverloaded,
    InboxFull,
    InvalidRequest,
    RequestFailed,
)


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> Response:
        return Response(error_body(self), self.status, headers=self.headers, media_type="application/json")


def error_body(e: ApiError) -> bytes:
    return msgspec.json.encode(ErrorBody(ErrorDetail(message=e.message, type=e.type, param=e.param, code=e.code)))


def from_engine_error(exc: EngineError) -> ApiError:
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, InvalidRequest):
        return ApiError(400, msg, param=exc.param)
    if isinstance(exc, (EngineOverloaded, InboxFull)):
        retry = str(EngineOverloaded.retry_after_s)
        return ApiError(429, msg, "rate_limit_error", code="engine_overloaded", headers={"retry-after": retry})
    if isinstance(exc, EngineDraining):
        return ApiError(503, msg, "server_error", code="engine_draining")
    if isinstance(exc, EngineDead):
        return ApiError(503, msg, "server_error", code="engine_dead")
    if isinstance(exc, RequestFailed):
        return ApiError(500, msg, "server_error", code="request_failed")
    return ApiError(500, msg, "server_error", code=type(exc).__name__)
