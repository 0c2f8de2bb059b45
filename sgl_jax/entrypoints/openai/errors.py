"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sgl_jax.entrypoints.openai.protocol import FieldError, UnsupportedFieldError


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, named by its JSON path."""
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {error['msg']}",
                        code="invalid_json")
    cause = error.get("ctx", {}).get("error")
    path = [str(part) for part in error["loc"] if not _is_union_tag(part)]
    if isinstance(cause, FieldError):  # the field, within the object that was checked
        code = ("unsupported_parameter" if isinstance(cause, UnsupportedFieldError)
                else "invalid_value")
        return APIError(400, str(cause), param=".".join([*path, cause.field]), code=code)
    param = ".".join(path) or None
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = f"unknown field '{param}'"
        return APIError(400, message, param=param, code="unknown_parameter")
    if error["type"] == "missing":
        return APIError(400, f"'{param}' is required", param=param, code="missing_parameter")
    return APIError(400, f"{param}: {message}" if param else message, param=param,
                    code="invalid_value")


def _is_union_tag(part: str | int) -> bool:
    """pydantic names the union member that failed ('str', 'list[TextPart]') in the path."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict",
                                               "none") or "[" in part)
