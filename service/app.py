"""`create_app(settings)`: the FastAPI application, its middleware, routes and model lifecycle."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import Response

from service import classify, control, kserve, openai_api
from service.config import Settings
from service.docs import install_docs
from service.endpoint import labelled_routes
from service.handlers import install_handlers
from service.metrics import Metrics
from service.middleware import BodyLimit, GraceExpiry, ServerTiming
from service.registry import load_models
from service.runtime import Runtimes

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Load every model of settings.model_dir now (errors surface before a port is bound); the batchers and
    decode loops start with the app's lifespan and drain when it ends."""
    settings = settings or Settings()
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

    app = FastAPI(
        docs_url=None,  # served by service.docs from local assets (the defaults load a CDN)
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
    app.include_router(classify.router)
    app.include_router(kserve.router)
    app.include_router(control.router)
    app.state.model_routes = labelled_routes(openai_api.router, classify.router, kserve.router)

    @app.get("/metrics", tags=["monitoring"], response_class=Response, summary="Prometheus metrics (text format)")
    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    # Outermost first: Server-Timing sees every response, including a 413 from the body limit.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(ServerTiming)
    app.add_middleware(GraceExpiry)
    return app
