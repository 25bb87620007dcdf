"""Triton's model repository extension: `POST /v2/repository/index`, `.../models/{m}/load` and `.../unload`.

The index lists every model the server knows, one row per version, with its state: READY, LOADING (a load is
reading and warming it up), UNLOADING (replaced or unloaded, finishing its last requests) or UNAVAILABLE with
the reason (failed to load, unloaded, worker died).

Load and unload need `--model-control explicit` (403 otherwise, like Triton outside explicit mode). A load
rescans the model's files in the model directory: new or changed versions load and warm up while the loaded
ones keep serving; then the new ones take new requests, and each replaced version finishes the requests that
hold it (streams included) before it is released. A version that fails to load is UNAVAILABLE with the reason
and the answer is 400; whatever served before keeps serving. Loads and unloads of one model run one at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.base.bodies import JSON, read_body, require_media
from service.base.errors import ServiceError, error_responses
from service.base.jsonio import check_size, dumps, loads
from service.base.kserve_codec import bad
from service.engine.engine_errors import ShuttingDown
from service.engine.registry import Files, fingerprint, load_versions, scan
from service.engine.runtime import ModelRuntime, Runtimes

router = APIRouter(tags=["kserve-v2"])
READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def index_rows(runtimes: Runtimes) -> list[dict[str, str]]:
    rows = []
    for name in runtimes.names():
        served = runtimes.versions.get(name, {})
        failed = runtimes.unavailable.get(name, {})
        loading = runtimes.loading.get(name, set())
        draining = {rt.version for rt in runtimes.draining if rt.name == name}
        for v in sorted({*served, *failed, *loading, *draining}):
            state, reason = UNAVAILABLE, failed.get(v, "")
            if v in loading:
                state = LOADING
                reason = "loading and warming up" + ("; the loaded version serves meanwhile" if v in served else "")
            elif v in served:
                problem = served[v].problem
                state, reason = (UNAVAILABLE, problem) if problem else (READY, "")
                if v in failed and not problem:
                    reason = f"the last load failed ({failed[v]}); the version loaded before serves"
            elif v in draining:
                state, reason = UNLOADING, "finishing its in-flight requests"
            rows.append({"name": name, "version": str(v), "state": state, "reason": reason})
    return rows


async def _query(request: Request, runtimes: Runtimes, allowed: tuple[str, ...]) -> dict[str, Any]:
    require_media(request, (JSON,))  # no text/plain or form: what a foreign page could send without asking
    body = await read_body(request, runtimes.settings.max_json_bytes)
    if not body.strip():
        return {}
    check_size(len(body), runtimes.settings.max_json_bytes)
    query = loads(body, "request body")
    if not isinstance(query, dict) or set(query) - set(allowed):
        raise bad(f"body must be an object with only {', '.join(allowed)}")
    return query


@router.post("/v2/repository/index", responses=error_responses(True, (400, 413, 415)),
             summary="Every model and version the server knows, its state (READY, LOADING, UNLOADING, UNAVAILABLE) "
             "and why it is not ready (Triton's model repository extension)")
async def repository_index(request: Request) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    query = await _query(request, runtimes, ("ready",))
    if not isinstance(query.get("ready", False), bool):
        raise bad("body must be an object with an optional boolean 'ready'")
    rows = index_rows(runtimes)
    if query.get("ready"):
        rows = [r for r in rows if r["state"] == READY]
    return _json(rows)


def _enabled(runtimes: Runtimes) -> None:
    if runtimes.settings.model_control != "explicit":
        raise ServiceError(403, "model control is disabled: start the server with --model-control explicit "
                           "(MULTIMAX_SERVE_MODEL_CONTROL=explicit) to load and unload models",
                           code="model_control_disabled")


async def _serialized(runtimes: Runtimes, name: str, action: Action) -> dict[str, Any]:
    """`action` on `name`, after the model's earlier loads and unloads; it completes even if the client leaves
    (a half-done swap would leave a loaded version unserved)."""
    async def locked() -> dict[str, Any]:
        async with runtimes.locks.setdefault(name, asyncio.Lock()):
            return await action(runtimes, name)

    return await asyncio.shield(locked())


def _unchanged(rt: ModelRuntime, files: Files) -> bool:
    try:
        return rt.entry.fingerprint == fingerprint(files)
    except OSError:
        return False


async def load(runtimes: Runtimes, name: str) -> dict[str, Any]:
    """(Re)load `name` from the model directory; raises ServiceError (4xx) when a version fails to load."""
    settings = runtimes.settings
    if not runtimes.ready:
        raise ServiceError(503, "server is not started or shutting down", code="shutting_down")
    found = await asyncio.to_thread(scan, settings.model_dir)
    versions = found.get(name)
    if not versions:
        raise ServiceError(404, f"no model {name!r} in the model directory (a file {name}.onnx/.pt/.engine/.plan or "
                           f"a directory {name}/<version>/model.*)", code="model_not_found", param="model")
    current = runtimes.versions.get(name, {})
    wanted = {v: f for v, f in versions.items() if v not in current or not _unchanged(current[v], f)}
    runtimes.loading[name] = set(wanted)
    try:
        loaded, failed = await asyncio.to_thread(load_versions, name, wanted, settings)
    finally:
        del runtimes.loading[name]
    new = {v: rt for v, rt in current.items() if v in versions}  # versions gone from the directory are unloaded
    fresh = {v: runtimes.runtime_of(entry) for v, entry in loaded.items()}
    try:
        for rt in fresh.values():
            runtimes.start_runtime(rt)
    except ShuttingDown:  # the server began shutting down while the files loaded
        await asyncio.gather(*(runtimes.release(rt, wait=False) for rt in fresh.values()))
        raise
    new.update(fresh)
    retired = [rt for v, rt in current.items() if new.get(v) is not rt]
    runtimes.versions[name] = dict(sorted(new.items()))
    unavailable = runtimes.unavailable.setdefault(name, {})
    for v in [*loaded, *[v for v in unavailable if v not in versions]]:
        unavailable.pop(v, None)  # loaded now, or gone from the directory
    unavailable.update(failed)
    if not unavailable:
        del runtimes.unavailable[name]
    runtimes.publish(name)
    for rt in retired:
        runtimes.release_later(rt)
    if failed:
        serving = ", ".join(map(str, runtimes.versions.get(name, {}))) or "none"
        raise ServiceError(400, f"failed to load {name}: " + "; ".join(f"version {v}: {why}" for v, why in
                                                                       failed.items()) +
                           f" (versions serving: {serving})", code="load_failed")
    return {"name": name, "versions": [str(v) for v in runtimes.versions[name]],
            "loaded": [str(v) for v in loaded]}


async def unload(runtimes: Runtimes, name: str) -> dict[str, Any]:
    current = runtimes.versions.get(name)
    if current is None:
        if name in runtimes.names():
            return {"name": name, "versions": []}  # already unloaded or never loaded: nothing to do (as Triton)
        raise ServiceError(404, f"model {name!r} not found", code="model_not_found", param="model")
    del runtimes.versions[name]
    runtimes.unavailable[name] = {v: "unloaded" for v in current}
    runtimes.publish(name)
    for rt in current.values():
        runtimes.release_later(rt)
    return {"name": name, "versions": []}


Action = Callable[[Runtimes, str], Awaitable[dict[str, Any]]]


async def _control(request: Request, name: str, action: Action) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    _enabled(runtimes)
    await _query(request, runtimes, ("parameters",))
    return _json(await _serialized(runtimes, name, action))


@router.post("/v2/repository/models/{name}/load", responses=error_responses(True, (400, 403, 404, 413, 415, 503)),
             summary="Load or reload a model from the model directory; new versions warm up, then take new "
             "requests while replaced ones finish theirs (needs --model-control explicit)")
async def load_model(name: str, request: Request) -> Response:
    return await _control(request, name, load)


@router.post("/v2/repository/models/{name}/unload", responses=error_responses(True, (400, 403, 404, 413, 415)),
             summary="Stop serving a model: it takes no new requests and is released after its in-flight ones "
             "(needs --model-control explicit)")
async def unload_model(name: str, request: Request) -> Response:
    return await _control(request, name, unload)
