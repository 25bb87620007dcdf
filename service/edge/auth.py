"""API keys: every request must carry `Authorization: Bearer <key>` with one of the server's keys, except the
routes on an explicit open list (health, readiness, metrics unless configured otherwise, the API docs).

A middleware, not a route dependency: routes added later (model control, anything new) are protected without
knowing about it. Keys are compared in constant time against every key (no early exit that would tell how
many keys there are or which one nearly matched) and never logged or echoed.
"""

from __future__ import annotations

import hmac
import re

from starlette.types import ASGIApp, Receive, Scope, Send

from service.base.context import AUTHENTICATED, authenticated  # noqa: F401  (authenticated: its old home)
from service.base.errors import error_response
from service.edge.docs import ASSETS_URL
from service.edge.middleware import HttpMiddleware
from service.protocols.endpoint import count_refused

HEALTH_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
MODEL_READY = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/ready")  # one model's readiness (a probe too)
METRICS_PATHS = frozenset({"/metrics"})
DOCS_PATHS = frozenset({"/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"})

class OpenPaths:
    """The routes that need no key."""

    def __init__(self, auth_health: bool, auth_metrics: bool) -> None:
        self.paths = set(DOCS_PATHS)  # the API description holds no data and no model names
        self.model_ready = not auth_health
        if not auth_health:
            self.paths |= HEALTH_PATHS
        if not auth_metrics:
            self.paths |= METRICS_PATHS

    def __contains__(self, path: str) -> bool:
        return (path in self.paths or path.startswith(ASSETS_URL + "/")
                or (self.model_ready and MODEL_READY.fullmatch(path) is not None))


def bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def key_matches(token: bytes, keys: tuple[bytes, ...]) -> bool:
    found = False
    for key in keys:  # all of them, always
        found |= hmac.compare_digest(token, key)
    return found


class ApiKeyAuth(HttpMiddleware):
    def __init__(self, app: ASGIApp, keys: tuple[str, ...], open_paths: OpenPaths) -> None:
        super().__init__(app)
        self.keys = tuple(k.encode() for k in keys)
        self.open_paths = open_paths

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = bearer_token(scope)
        valid = token is not None and key_matches(token, self.keys)
        # Open routes answer anyone, but say less to a client without a key (service.edge.auth.authenticated).
        scope.setdefault("state", {})[AUTHENTICATED] = valid
        if valid or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        # RFC 6750: no credentials -> just the challenge; wrong ones -> error="invalid_token".
        challenge = 'Bearer realm="multimax-serve"' + ('' if token is None else ', error="invalid_token"')
        message = ("missing API key: send the header `Authorization: Bearer <key>`" if token is None
                   else "invalid API key")
        count_refused(scope.get("app"), scope, 401)
        response = error_response(scope["path"], 401, message, code="invalid_api_key",
                                  headers={"WWW-Authenticate": challenge})
        await response(scope, receive, send)
