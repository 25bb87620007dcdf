"""What the server knows about the request being handled, wherever the code runs on its behalf: its id, model
and endpoint (for log lines and error bodies) and its trace span. service.edge.access sets it for each request;
asyncio copies it into the tasks a request starts (streams included)."""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

HEADER = "x-request-id"
MAX_ID_LENGTH = 128
# Letters, digits and - _ . : / + = @: covers UUIDs, ULIDs, W3C trace ids, base64 and most proxies' formats,
# and nothing that could break a header or a log line.
_ID = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_ID_LENGTH}}}")
ID_RULE = f"1 to {MAX_ID_LENGTH} characters of A-Z a-z 0-9 . _ : / + = @ -"
AUTHENTICATED = "authenticated"  # scope state flag set by service.edge.auth: a valid key (or the server has none)


def authenticated(scope: Any) -> bool:
    """Whether the request carries a valid key, or the server needs none (then every client may know everything
    the API tells: /v1/models lists the models anyway). Here, below the protocols, so they can ask."""
    return bool(scope.get("state", {}).get(AUTHENTICATED, True))


@dataclass
class RequestContext:
    request_id: str
    model: str | None = None
    endpoint: str | None = None
    span: Any = None  # opentelemetry Span of the request, when tracing is on
    tracer: Any = None


CURRENT: ContextVar[RequestContext | None] = ContextVar("multimax_request", default=None)


def current() -> RequestContext | None:
    return CURRENT.get()


def current_id() -> str | None:
    ctx = CURRENT.get()
    return ctx.request_id if ctx is not None else None


def new_id() -> str:
    return uuid.uuid4().hex


def valid_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None
