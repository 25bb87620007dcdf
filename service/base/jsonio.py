"""Strict JSON in and out: what the server reads and writes is RFC 8259 JSON, never Python's extensions.

Reading: `NaN` / `Infinity` are refused, nesting deeper than Python's recursion limit is a 400 (not a
RecursionError), and bodies are bounded by `max_json_bytes` before parsing (checked by the callers),
so no parse can hold the event loop for long. Writing: a value that is not finite cannot be written;
`dumps` raises `NonFiniteOutput`, which endpoints turn into a clear error.
"""

from __future__ import annotations

import json
from typing import Any

from service.base.errors import ServiceError


class NonFiniteOutput(ValueError):
    """A response would hold NaN or Infinity, which JSON cannot carry."""


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(body: bytes | str, what: str = "body") -> Any:
    """Parsed JSON, or a 400 ServiceError saying why not."""
    try:
        return json.loads(body, parse_constant=_no_constants)
    except RecursionError:
        raise ServiceError(400, f"{what} is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ServiceError(400, f"{what} is not valid JSON: {exc}", code="invalid_json") from None


def check_size(size: int, limit: int, what: str = "JSON body") -> None:
    if size > limit:
        raise ServiceError(413, f"{what} of {size} bytes exceeds the limit of {limit} bytes (max_json_bytes)",
                           code="body_too_large")


def dumps(obj: Any) -> bytes:
    try:
        return json.dumps(obj, allow_nan=False).encode()
    except ValueError as exc:
        raise NonFiniteOutput(str(exc)) from None


def non_finite_error(what: str) -> ServiceError:
    """The model's output for this input is NaN or infinite (e.g. inputs near the float32 limit)."""
    return ServiceError(422, f"the model's output for this input is not finite ({what}); JSON cannot carry it",
                        code="non_finite_output")
