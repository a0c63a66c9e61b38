"""The 400 every bad request field gets (OpenAI's error shape, naming the field), and the small
checks the request parsers share."""

from __future__ import annotations

import json
from typing import Any

SHOWN_CHARACTERS = 80  # of a bad value, echoed in its error


class BadRequest(Exception):
    """A request the server refuses: HTTP status, OpenAI error type, message, offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def shown(value: Any) -> str:
    """A bad value as JSON for an error message, cut short."""
    text = json.dumps(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS] + "..."


def same(value: Any, default: Any) -> bool:
    """JSON equality that keeps false apart from 0 and 1 apart from true."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value == default
    return type(value) is type(default) and value == default


def number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    """body[name] as a number within [low, high] (default when absent or null)."""
    value = body.get(name, default)
    if value is None:
        return default
    valid_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not valid_type:
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {shown(value)}", name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low:g} and {high:g}, got {shown(value)}", name)
    return value
