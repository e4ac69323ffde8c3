"""Errors in OpenAI's shape, so OpenAI clients raise their own typed exceptions with our message.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}

The official ``openai`` client maps the HTTP status to its exception class (400
``BadRequestError``, 404 ``NotFoundError``, ...) and shows ``message``; ``param`` names the field
at fault and ``code`` is a stable machine-readable reason.
"""
from __future__ import annotations


class APIError(Exception):
    """A refused request: HTTP ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers  # e.g. a 429's Retry-After
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model, served: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist; this backbone serves '{served}'",
                    param="model", code="model_not_found")


def no_route(method: str, path: str) -> APIError:
    return APIError(404, f"no route {method} {path}", code="not_found")
