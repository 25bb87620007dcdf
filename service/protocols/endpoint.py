"""The bookkeeping every model endpoint shares, in one step: runtime lookup, request metrics (pending, duration,
outcome), the deadline, the disconnect watch and Server-Timing.

    @router.post("/v1/models/{name}/classify")
    @model_endpoint("classify")               # the route's label in the request metrics
    async def classify(name: str, request: Request) -> Response:
        async with model_call(request, name) as call:
            rt = call.runtime(name, VisionRuntime)
            ...
            result = await call.wait(rt.batcher.enqueue(rows, call.deadline(timeout)))
            call.timing(result.queue_s, result.compute_s)

The label is the route's own (set by `model_endpoint`), so a request refused before its endpoint ran (body too
large, invalid body) is counted under it too, without parsing the URL path.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import BaseRoute, Match, Route

from service.base.config import Settings
from service.base.context import current
from service.base.metrics import UNKNOWN_MODEL
from service.base.tracing import record_timing
from service.engine.runtime import ModelRuntime, R, Runtimes
from service.protocols.lifecycle import Tracker, deadline, outcome_of, tracked, unless_disconnected

T = TypeVar("T")
H = TypeVar("H", bound=ModelRuntime)
F = TypeVar("F", bound=Callable[..., Any])
LABELS: dict[Callable[..., Any], str] = {}  # route function of each model endpoint -> its label in the metrics


def model_endpoint(label: str) -> Callable[[F], F]:
    """Marks a route function as a model endpoint counted under `label` (placed below the route decorator)."""
    def mark(fn: F) -> F:
        LABELS[fn] = label
        return fn
    return mark


def label_of(endpoint: Any) -> str | None:
    """The metrics label of a route's endpoint, None for a route that is no model endpoint."""
    return LABELS.get(endpoint) if callable(endpoint) else None


class ModelCall:
    """One request to a model endpoint, while it is tracked."""

    def __init__(self, request: Request, runtimes: Runtimes, tracker: Tracker) -> None:
        self.request, self.runtimes, self.tracker = request, runtimes, tracker

    @property
    def settings(self) -> Settings:
        return self.runtimes.settings

    def runtime(self, name: str, kind: type[R], version: str | None = None) -> R:
        """The served model `name` (its latest version, or `version`), of the runtime type the endpoint needs
        (404 / 400 otherwise). The request holds it until it finishes: a replaced version drains before release."""
        return self.hold(self.runtimes.typed(name, kind, version))

    def hold(self, rt: H) -> H:
        """Keep `rt` from being released (by a repository load or unload) until this request finishes."""
        rt.acquire()
        self.tracker.on_finish.append(rt.release)
        return rt

    def deadline(self, requested_s: float | None = None) -> float:
        """When the request must be answered: the server's timeout, or the request's own if shorter."""
        return deadline(self.settings.request_timeout_s, requested_s)

    async def wait(self, work: Awaitable[T]) -> T:
        """`work`'s result; cancelled (and 499) if the client goes away first."""
        return await unless_disconnected(self.request, work)

    def timing(self, queue_s: float, compute_s: float) -> None:
        """What Server-Timing reports for this request (and its trace, as `queue` and `model` spans)."""
        self.request.state.timing.set(queue_s, compute_s)
        record_timing(queue_s, compute_s)


def labelled_routes(*routers: Any) -> list[BaseRoute]:
    """The model endpoints' routes of these routers (what `endpoint_of` matches a request against before routing)."""
    return [r for router in routers for r in router.routes if isinstance(r, Route) and label_of(r.endpoint)]


def endpoint_label(request: Request) -> str:
    label = label_of(request.scope.get("endpoint"))
    if label is None:
        raise RuntimeError(f"{request.url.path}: model_call outside a @model_endpoint route")
    return str(label)


@contextlib.asynccontextmanager
async def model_call(request: Request, model: str, *, finish: bool = True) -> AsyncIterator[ModelCall]:
    """Track the request under its model and the route's label; `finish=False`: a streaming endpoint finishes
    the tracker itself when its stream ends."""
    runtimes: Runtimes = request.app.state.runtimes
    ctx = current()
    if ctx is not None:  # for log lines and the trace
        ctx.model, ctx.endpoint = runtimes.label(model), endpoint_label(request)
    async with tracked(runtimes.metrics, runtimes.label(model), endpoint_label(request), finish=finish) as tracker:
        yield ModelCall(request, runtimes, tracker)


def endpoint_of(app: Starlette, scope: MutableMapping[str, Any], models: Any) -> tuple[str, str] | None:
    """(model label, endpoint label) of a model endpoint's request, for requests refused before it ran; the
    route is the one the router chose, or (before routing, in a middleware) the one it will choose."""
    endpoint, params = scope.get("endpoint"), scope.get("path_params") or {}
    if endpoint is None:
        routes: list[BaseRoute] = app.state.model_routes  # service.edge.app sets them
        matches = [route.matches(scope) for route in routes]
        # a full match, else a partial one (path right, method wrong: a 405 of that route)
        found = sorted((m for m in matches if m[0] != Match.NONE), key=lambda m: m[0] != Match.FULL)
        if found:
            endpoint, params = found[0][1].get("endpoint"), found[0][1].get("path_params") or {}
    label = label_of(endpoint)
    if label is None:
        return None
    name = params.get("name")  # completions name the model in the body, which could not be read
    return (name if isinstance(name, str) and name in models else UNKNOWN_MODEL), str(label)


def count_refused(app: Any, scope: MutableMapping[str, Any], status: int) -> None:
    """Count a request refused before its endpoint ran (body too large, body that fails validation); `app`: the
    server's (scope["app"]: service.edge.app sets its runtimes and model routes on its state), else nothing."""
    if not isinstance(app, Starlette):
        return
    runtimes: Runtimes = app.state.runtimes
    labels = endpoint_of(app, scope, runtimes.models)
    if labels is not None:
        # A request without a valid key (or from a foreign page) has not reached the model it names: counted
        # apart, under no model, so that nobody without a key can move a model's invalid_input series.
        model = UNKNOWN_MODEL if status in (401, 403) else labels[0]
        runtimes.metrics.requests.labels(model, labels[1], outcome_of(status)).inc()
