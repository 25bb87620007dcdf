"""One Ray Serve replica: the service's own FastAPI app (create_app), built inside the replica.

The app is built by `__serve_build_asgi_app__`, so each replica loads its models itself (nothing heavy is
pickled from the driver), and Ray runs the app's lifespan in the replica: startup starts the batchers and
decode loops, and after Ray's graceful drain (in-flight requests and streams finish) the lifespan shutdown
drains and stops them, exactly as uvicorn does for `python -m service`. Two things differ from that app:
GET /metrics answers for every replica (service.edge.ray.metrics), and Ray's health check fails when a model's
batcher or decode loop has died, so Ray replaces the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from ray import serve
from starlette.responses import Response

from service.base.config import Settings
from service.base.errors import error_response
from service.base.startup_gc import freeze_startup_objects
from service.edge.access import route_path
from service.edge.app import create_app
from service.edge.ray.metrics import snapshot
from service.engine.runtime import Runtimes

log = logging.getLogger(__name__)
FORGET_TIMEOUT_S = 2.0


class ServiceReplica:
    def __init__(self, settings: Settings, hub: Any, metrics_push_s: float) -> None:
        logging.getLogger("service").setLevel(settings.log_level.upper())
        self.settings = settings
        self.hub = hub  # DeploymentHandle of service.edge.ray.metrics.MetricsHub
        self.metrics_push_s = metrics_push_s
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.node, self.pid = socket.gethostname(), os.getpid()
        self.runtimes: Runtimes | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        # loads this replica's models; Ray's proxy puts X-Request-Id on every response (the client's or its own,
        # which it passes on to the replica): the app uses that id in its logs and error bodies, without a second
        # header. API keys, CORS and tracing are the app's own middleware, the same as in `python -m service`.
        app = create_app(self.settings, request_id_header=False)
        self.runtimes = app.state.runtimes
        freeze_startup_objects()  # as `python -m service` (service.base.startup_gc)
        _replace_route(app, "/metrics", self._deployment_metrics)
        own_lifespan = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
            async with own_lifespan(app) as state:
                pusher = asyncio.get_running_loop().create_task(self._push_forever(), name="metrics-push")
                try:
                    yield state
                finally:
                    pusher.cancel()
                    # Bounded: on a whole-application delete the hub may already be gone, and a handle call
                    # to a deleted deployment waits rather than fails.
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self._forget(), FORGET_TIMEOUT_S)

        app.router.lifespan_context = lifespan
        return app

    def check_health(self) -> None:
        """Ray calls this every health_check_period_s; raising marks the replica unhealthy and Ray replaces it."""
        dead = self.runtimes.dead_loops() if self.runtimes is not None else []
        if dead:
            raise RuntimeError(f"replica {self.replica}: the batcher or decode loop of {', '.join(dead)} has died")

    async def _forget(self) -> None:
        await self.hub.forget.remote(self.replica)

    async def _push(self) -> None:
        assert self.runtimes is not None
        await self.hub.push.remote(self.replica, self.node, self.pid, snapshot(self.runtimes.metrics.registry))

    async def _push_forever(self) -> None:
        while True:
            try:
                await self._push()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the hub restarting: the next push fills it in again
                log.warning("replica %s: sending metrics failed: %s", self.replica, exc)
            await asyncio.sleep(self.metrics_push_s)

    async def _deployment_metrics(self) -> Response:
        try:
            await self._push()  # this replica's numbers as of now; the others' are at most metrics_push_s old
            body, content_type = await self.hub.render.remote()
        except Exception as exc:
            # A page with only some replicas would read as a drop in every counter: better no page.
            log.warning("replica %s: metrics hub unavailable: %s", self.replica, exc)
            return error_response("/metrics", 503, "deployment metrics unavailable; retry", code="metrics_unavailable",
                                  headers={"Retry-After": "1"})
        return Response(body, media_type=content_type)


def _replace_route(app: FastAPI, path: str, endpoint: Any) -> None:
    routes = app.router.routes
    routes[:] = [r for r in routes if route_path(r) != path]
    app.add_api_route(path, endpoint, methods=["GET"], response_class=Response, tags=["monitoring"],
                      summary="Prometheus metrics of every replica of the deployment (text format)")


# serve.ingress with no app: Ray calls __serve_build_asgi_app__ in each replica after __init__.
ServiceIngress = serve.ingress()(ServiceReplica)
