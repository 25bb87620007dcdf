"""`create_app(settings)`: the FastAPI application, its middleware, routes and model lifecycle."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp

from service.base.config import Settings
from service.base.metrics import Metrics
from service.base.tracing import otlp_tracer_provider, tracer_of
from service.edge.access import RequestTracking
from service.edge.auth import ApiKeyAuth, OpenPaths
from service.edge.crosssite import CrossSiteGuard
from service.edge.docs import install_docs
from service.edge.handlers import install_handlers
from service.edge.middleware import BodyLimit, ContainErrors, GraceExpiry, ServerTiming
from service.engine.registry import load_models
from service.engine.runtime import Runtimes
from service.protocols import chat_api, classify, control, kserve, openai_api, tokenize_api
from service.protocols.endpoint import labelled_routes
from service.protocols.responses import routes as responses_routes
from service.protocols.responses.store import ResponseStore

# What browser code may read of a cross-origin response (CORS hides every other header from it).
EXPOSED_HEADERS = ("X-Request-Id", "Server-Timing", "Retry-After")

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, tracer_provider: Any = None,
               request_id_header: bool = True) -> FastAPI:
    """Load every model of settings.model_dir now (errors surface before a port is bound); the batchers and
    decode loops start with the app's lifespan and drain when it ends.
    `tracer_provider`: an OpenTelemetry TracerProvider (default: one exporting to settings.otlp_endpoint, if set).
    `request_id_header=False`: leave X-Request-Id on responses to a proxy that adds it (Ray Serve's)."""
    settings = settings or Settings()
    own_provider = tracer_provider is None and bool(settings.otlp_endpoint)
    if own_provider:
        tracer_provider = otlp_tracer_provider(settings.otlp_endpoint)
    metrics = Metrics()
    entries, skipped = load_models(settings)
    runtimes = Runtimes(entries, settings, metrics, skipped)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtimes.start()
        log.info("serving %s", ", ".join(f"{n} v{rt.version} ({rt.task}, {rt.entry.backend.kind})"
                                        for n, rt in runtimes.models.items()))
        try:
            yield
        finally:
            # Reached after uvicorn stopped accepting and in-flight requests finished (or the grace period ran out).
            await runtimes.stop()
            log.info("all models stopped")
            if own_provider:
                tracer_provider.shutdown()  # sends the spans still batched

    app = FastAPI(
        docs_url=None,  # served by service.edge.docs from local assets (the defaults load a CDN)
        redoc_url=None,
        title="multimax-serve",
        version="0.1.0",
        description="Image classification and text generation with MultiMax models: OpenAI-compatible "
        "completions, KServe V2 (Triton) inference, Prometheus metrics.",
        lifespan=lifespan,
    )
    app.state.runtimes = runtimes
    app.state.settings = settings
    install_handlers(app)
    install_docs(app)
    app.include_router(openai_api.router)
    app.include_router(chat_api.router)
    app.include_router(responses_routes.router)
    app.state.responses = ResponseStore()  # /v1/responses' kept responses (store, previous_response_id)
    app.include_router(tokenize_api.router)
    app.include_router(classify.router)
    app.include_router(kserve.router)
    app.include_router(control.router)
    app.state.model_routes = labelled_routes(openai_api.router, chat_api.router, responses_routes.router,
                                             tokenize_api.router, classify.router, kserve.router)

    @app.get("/metrics", tags=["monitoring"], response_class=Response, summary="Prometheus metrics (text format)")
    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    # Innermost first: an unhandled exception is a 500 that keeps the connection; Server-Timing sees every
    # response, including a 413 from the body limit.
    app.add_middleware(ContainErrors)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(ServerTiming)
    app.add_middleware(GraceExpiry)
    install_access(app, settings, tracer_provider, request_id_header)
    return app


def install_access(app: FastAPI, settings: Settings, tracer_provider: Any, request_id_header: bool) -> None:
    """API keys, then CORS outside them (a preflight carries no key; a 401 still needs CORS headers to be
    readable), then request ids, logs and traces outside everything, Starlette's error middleware included.
    Innermost, the cross-site guard: a foreign page's request that would change state or run a model is 403."""
    app.add_middleware(CrossSiteGuard, allowed_origins=settings.cors_allow_origins)
    if settings.api_keys:
        app.add_middleware(ApiKeyAuth, keys=settings.api_keys,
                           open_paths=OpenPaths(settings.auth_health, settings.auth_metrics))
    if settings.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_allow_origins),
                           allow_methods=list(settings.cors_allow_methods),
                           allow_headers=list(settings.cors_allow_headers),
                           allow_credentials=settings.cors_allow_credentials,
                           expose_headers=list(EXPOSED_HEADERS))
    build = app.build_middleware_stack
    tracer = tracer_of(tracer_provider)

    def build_with_tracking() -> ASGIApp:
        return RequestTracking(build(), tracer=tracer, log_requests=settings.access_log,
                               response_header=request_id_header)

    app.build_middleware_stack = build_with_tracking  # type: ignore[method-assign]
