"""Every text of a JSON request is valid Unicode, checked once where the body enters.

JSON may carry lone surrogates (`"\\ud800"`), which Python's parser accepts but no UTF-8 can encode: a tokenizer,
llguidance (a guided_choice of them was a 500, UnicodeEncodeError) or a stop-string matcher would fail on them
far from the request. So the parsed body is searched once, before anything uses it, and a lone surrogate
anywhere in it (prompt, messages, stop, guided_*, a schema's strings and keys) is a 400 naming where it is.

A lone surrogate can only arrive as a `\\uD800`-`\\uDFFF` escape (raw UTF-8 cannot encode one), so a UTF-8 body
without such an escape is passed without walking it: the walk costs only the bodies that might hold one.
"""

from __future__ import annotations

import re
from typing import Any

from service.base.errors import ServiceError, bad_request

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PATH_DEPTH = 4  # an error names at most this many keys/indices of the path (a schema's path may be hostile)


def _shown_key(key: str) -> str | None:
    """A key as a path part: a short identifier only (a client's key may be long, or the surrogate itself)."""
    return key if len(key) <= 40 and key.isascii() and key.replace("_", "a").replace("-", "a").isalnum() else None


def _name(path: list[str]) -> str:
    return ".".join(path[:_PATH_DEPTH]) or "body"


def _bad(path: list[str]) -> ServiceError:
    where = _name(path)
    return bad_request(f"{where} is not valid Unicode (a lone surrogate, \\ud800-\\udfff, which UTF-8 cannot encode)",
                       where, code="invalid_unicode")


def find_lone_surrogate(value: Any) -> list[str] | None:
    """The path (keys and list indices) to the first string or key holding a lone surrogate, or None. Iterative:
    the body may be as deep as the parser allowed."""
    todo: list[tuple[Any, list[str]]] = [(value, [])]
    while todo:
        node, path = todo.pop()
        if isinstance(node, str):
            if not node.isascii() and _SURROGATE.search(node):
                return path
        elif isinstance(node, dict):
            for key, item in node.items():
                shown = _shown_key(key) if isinstance(key, str) else str(key)
                if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                    return path
                todo.append((item, [*path, shown] if shown is not None and len(path) < _PATH_DEPTH else path))
        elif isinstance(node, list):
            todo.extend((item, [*path, str(i)] if len(path) < _PATH_DEPTH else path)
                        for i, item in enumerate(node))
    return None


def check_text(body: bytes, parsed: Any) -> None:
    """400 naming the first place of `parsed` (the JSON of `body`) that holds a lone surrogate."""
    utf8 = b"\0" not in body[:4]  # UTF-16/32 JSON (the parser detects it) writes its escapes with NULs between
    if utf8 and not _SURROGATE_ESCAPE.search(body):
        return
    path = find_lone_surrogate(parsed)
    if path is not None:
        raise _bad(path)
