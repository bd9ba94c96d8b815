"""The server's refusals: `APIError`, an HTTP status with OpenAI's error object, and the
engine's own errors (a refused submit, an aborted request) as one.
"""

from __future__ import annotations

import re
from typing import Any

from kvstrata.core.errors import ConfigError, KvstrataError
from kvstrata.engine.params import RequestOutput, RequestRejected

_FIELD_OF_MESSAGE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*)=")


class APIError(Exception):
    """A request answered with `status` and OpenAI's error object (`body`), whose message
    is one line naming the field, the value and what is accepted."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        message = " ".join(str(message).split())  # one line, always
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {key: getattr(self, key) for key in ("message", "type", "param", "code")}}


def field_of(message: str) -> str | None:
    """The field a kvstrata one-line error names (`<field>=<value> is invalid: ...`)."""
    match = _FIELD_OF_MESSAGE.match(message)
    return match.group(1) if match else None


def invalid(field: str, value: Any, accepted: str, code: str = "invalid_value") -> APIError:
    """A 400 naming `field`, its value and what is accepted (ConfigError's wording)."""
    return APIError(400, str(ConfigError.field(field, value, accepted)), param=field, code=code)


def engine_error(exc: BaseException) -> APIError:
    """The HTTP answer to an exception raised by Engine.submit / Engine.stream."""
    message = str(exc)
    if isinstance(exc, RequestRejected):
        return APIError(400, message, param=field_of(message), code="request_rejected")
    if isinstance(exc, ConfigError):
        return APIError(400, message, param=field_of(message), code="invalid_value")
    if isinstance(exc, KvstrataError):  # EngineStopped: "the engine is shut down"
        return APIError(503, f"{message}: this server cannot take requests", code="unavailable")
    return APIError(500, f"{type(exc).__name__}: {message}", code="internal_error")


def aborted_error(out: RequestOutput, stopping: bool = False) -> APIError:
    """The HTTP answer to a request the engine ended with "abort" (not the client's)."""
    if stopping:
        return APIError(
            503, "the server is shutting down: the request was stopped", code="unavailable"
        )
    if out.error is None or out.error.startswith("the engine stopped"):
        why = out.error or "the engine shut down"
        return APIError(503, f"{why} before the request finished", code="unavailable")
    return APIError(500, f"the engine gave up on the request: {out.error}", code="engine_error")
