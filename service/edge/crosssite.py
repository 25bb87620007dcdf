"""Cross-site requests: a web page the operator visits must not drive a server it can reach (one on localhost).

A browser may send a POST to any origin without asking first (no CORS preflight) when its content type is
text/plain, a form or multipart; the page cannot read the answer, but the request has run: it unloaded a model
or took the model's time. Browsers mark every such request with an `Origin` header, which a page cannot forge
or remove. So a request that changes state or runs a model (any method but GET, HEAD, OPTIONS) and carries an
Origin is refused with 403 unless that origin is the server's own (its /docs page) or one the CORS configuration
allows. Requests without Origin (curl, the OpenAI and Triton clients, `curl -F` uploads) are not browsers'
cross-site requests and pass; the JSON routes refuse non-JSON content types on their own (service.base.bodies).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from service.base.errors import error_response, shown
from service.edge.middleware import HttpMiddleware
from service.protocols.endpoint import count_refused

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class CrossSiteGuard(HttpMiddleware):
    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...]) -> None:
        super().__init__(app)
        self.any_origin = "*" in allowed_origins
        self.allowed = frozenset(o.rstrip("/").lower() for o in allowed_origins)

    def allows(self, origin: str, scope: Scope) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if self.any_origin or origin in self.allowed:
            return True
        host = _header(scope, b"host")  # same origin: the page was served by this server (e.g. /docs)
        return host is not None and origin == f"{scope.get('scheme', 'http')}://{host.strip().lower()}"

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = _header(scope, b"origin")
        if origin is None or scope["method"] in SAFE_METHODS or self.allows(origin, scope):
            await self.app(scope, receive, send)
            return
        count_refused(scope.get("app"), scope, 403)
        message = (f"cross-origin request from {shown(origin)} refused: this route changes state or runs a model, "
                   "and that origin is not in --cors-allow-origins")
        response = error_response(scope["path"], 403, message, code="cross_origin_refused")
        await response(scope, receive, send)
