"""ApiError: every error the API answers, in OpenAI's shape.

Owns the mapping from failures (msgspec validation; the engine's typed refusals, tl.core.request's
RequestError family, all in `from_request_error`) to status, type, param and code, and the
JSON body `{"error": {"message", "type", "param", "code"}}`. The engine decides whether a
request fits (its context, its queue); this module only says so in OpenAI's words.
Must not touch the engine. Tested through tests/serve/test_serve_app.py.
"""

from __future__ import annotations

import logging
import re
from typing import Protocol

import msgspec

from tl.core.async_engine import EngineError, EngineUnavailable, NoCapacity
from tl.core.request import ContextLengthError, QueueFullError, RequestError

log = logging.getLogger("serve")


class HasRequestId(Protocol):
    request_id: bytes


def log_server_error(out: HasRequestId, err: ApiError) -> None:
    """The one log line of a 5xx the server sends (as the status, or as a stream's error
    event): the request id, the status, the code and the cause; nothing for a 4xx. A 503 is the
    server's capacity or its stop speaking (a warning), anything else an error."""
    if err.status < 500:
        return
    level = logging.WARNING if err.status == 503 else logging.ERROR
    log.log(level, "request %s: %d %s: %s", out.request_id.decode("latin-1"), err.status, err.code, err.message)


class ErrorBody(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorDoc(msgspec.Struct, frozen=True):
    error: ErrorBody


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def doc(self) -> ErrorDoc:
        return ErrorDoc(ErrorBody(self.message, self.type, self.param, self.code))

    def body(self) -> bytes:
        return msgspec.json.encode(self.doc())

    def anthropic_doc(self) -> AnthropicErrorDoc:
        """The same error in Anthropic's shape (the /v1/messages routes)."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error")
        message = f"{self.param}: {self.message}" if self.param and self.param not in self.message else self.message
        return AnthropicErrorDoc("error", AnthropicError(kind, message))

    def anthropic_body(self) -> bytes:
        return msgspec.json.encode(self.anthropic_doc())


class AnthropicError(msgspec.Struct, frozen=True):
    type: str
    message: str


class AnthropicErrorDoc(msgspec.Struct, frozen=True):
    type: str  # "error"
    error: AnthropicError


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
"""Anthropic's error type for each status tl answers."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, what: str = "") -> ApiError:
    msg = f"{param} is not supported by this server" + (f": {what}" if what else "")
    return ApiError(422, msg, "invalid_request_error", param, "unsupported_parameter")


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist", "invalid_request_error", "model", "model_not_found")


def queue_full() -> ApiError:
    return ApiError(
        429,
        "The server's admission queue is full; retry shortly",
        "rate_limit_exceeded",
        None,
        "rate_limit_exceeded",
        ((b"retry-after", b"1"),),
    )


def no_capacity() -> ApiError:
    return ApiError(
        503,
        "No KV-cache capacity became free before the queue deadline",
        "server_error",
        None,
        "no_capacity",
        ((b"retry-after", b"1"),),
    )


def method_not_allowed(allowed: str) -> ApiError:
    return ApiError(
        405,
        f"Method not allowed; use {allowed}",
        "invalid_request_error",
        None,
        "method_not_allowed",
        ((b"allow", allowed.encode()),),
    )


def draining() -> ApiError:
    return ApiError(
        503,
        "The server is shutting down",
        "server_error",
        None,
        "server_shutting_down",
        ((b"retry-after", b"1"), (b"connection", b"close")),
    )


def loading() -> ApiError:
    """Any request before the model is loaded and compiled (serve/loading.py answers it)."""
    return ApiError(503, "The model is loading", "server_error", None, "model_loading", ((b"retry-after", b"5"),))


def aborted() -> ApiError:
    """A request the server aborted (the drain deadline, a shutdown)."""
    return ApiError(
        503,
        "The request was aborted (the server is shutting down)",
        "server_error",
        None,
        "aborted",
        ((b"retry-after", b"1"),),
    )


def constraint_failed(message: str) -> ApiError:
    """A constrained generation whose matcher refused a token mid-way (its output is not valid)."""
    return ApiError(500, message, "server_error", None, "structured_output_failed")


def internal(message: str = "Internal server error") -> ApiError:
    return ApiError(500, message, "server_error", None, "internal_error")


def unavailable(message: str) -> ApiError:
    """The engine can run no more steps (a multi-host group lost a process); the server exits."""
    return ApiError(
        503,
        f"The engine is unavailable: {message}",
        "server_error",
        None,
        "engine_unavailable",
        ((b"retry-after", b"1"), (b"connection", b"close")),
    )


def from_engine_error(err: EngineError) -> ApiError:
    """A failure while the request was live: 503 when the engine is gone for good or no
    capacity came in time (both retryable), else 500."""
    if isinstance(err, EngineUnavailable):
        return unavailable(str(err))
    if isinstance(err, NoCapacity):
        return no_capacity()
    return internal(str(err))


_AT_PATH = re.compile(r" - at `\$((?:\.[A-Za-z_0-9]+|\[\d+\])*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def from_decode_error(err: msgspec.DecodeError) -> ApiError:
    """msgspec's message -> 400 with `param` from its `- at $.a.b[0]` suffix or the missing field."""
    text = str(err)
    path = ""
    m = _AT_PATH.search(text)
    if m:
        path = m.group(1).lstrip(".")
        text = text[: m.start()]
    missing = _MISSING.search(text)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    if not isinstance(err, msgspec.ValidationError):
        return bad_request(f"Invalid JSON body: {text}")
    return bad_request(f"{text} at {path}" if path and not missing else text, param=path or None)


def from_request_error(err: RequestError, context_param: str | None = None) -> ApiError:
    """Errors tl.core.request and the engine raise at admission: a full queue is 429, the rest 400.
    context_param: the wire field a context-length refusal names (the engine's is its own
    field, max_tokens or input; a chat request without max_tokens names its messages)."""
    if isinstance(err, QueueFullError):
        return queue_full()
    if isinstance(err, ContextLengthError):
        return bad_request(str(err), param=context_param or err.param, code="context_length_exceeded")
    return bad_request(str(err), param=err.param, code=err.code)
