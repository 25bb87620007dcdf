"""service/ in layers: every module sits in its layer's package, and no module imports one above its own.

Bottom to top, one package each:
  service/base/       what every layer shares: settings, metrics, request context, logs, tracing, health, the
                      request-error vocabulary (service.base.errors: ServiceError, the OpenAI / KServe error
                      bodies) and the wire formats (request bodies, bounded JSON, KServe V2 tensors)
  service/engine/     runs models: backends, runtimes, the dynamic batcher, the text scheduler, the sampler, the KV
                      cache, the detokenizers, model loading and checks, the per-task modules (tasks/); it raises
                      its own errors (service.engine.engine_errors) and knows no web framework
  service/protocols/  what a request means: OpenAI, KServe V2, classification, model control; they call the
                      engine and answer its errors with statuses (service.protocols.engine_status)
  service/edge/       the HTTP server around them: the app, middleware, auth, cross-site checks, access log, slow
                      clients, error handlers, the docs pages (and Ray Serve's replica, ray/, which wraps the app)

A module's layer is the package it sits in, so where a new module goes is a decision made by its path. Directly
under service/ are only service/__init__ (base: empty), the CLI service/__main__ (edge) and service/ray/, the
documented names `python -m service.ray` / `service.ray:build` kept as a shim onto service.edge.ray (edge).
"""

from __future__ import annotations

import ast
from pathlib import Path

from service.engine.engine_errors import Cancelled, DeadlineExceeded, ModelFailed, QueueFull, ShuttingDown, TooLarge
from service.protocols.engine_status import http_error
from tests.paths import ROOT

ORDER = ("base", "engine", "protocols", "edge")
# the only modules outside the layer packages, and their layers
TOP = {"service": "base", "service.__main__": "edge", "service.ray": "edge", "service.ray.__main__": "edge"}
WEB_FRAMEWORKS = ("fastapi", "starlette", "pydantic", "uvicorn")


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


PACKAGES = {_name(p) for p in (ROOT / "service").rglob("__init__.py")}


def sources() -> dict[str, str]:
    return {_name(p): p.read_text() for p in sorted((ROOT / "service").rglob("*.py"))}


def imports(source: str, module: str) -> set[str]:
    """What `source` (of `module`) imports: `from a import b` counts as a and a.b (b may be a module:
    `from service.engine.text import batch`)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package (a package's __init__ is its own package)
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if module in PACKAGES else 0)
                base = ".".join([*parts[:keep], *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def _layer_of(module: str) -> str | None:
    """The layer of a module of service/ (or of a name inside one): its layer package, or TOP's entry."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ORDER:
        return parts[1]
    while len(parts) > 1:  # service.ray.__main__, service.ray.build; not service.lonely -> service
        if ".".join(parts) in TOP:
            return TOP[".".join(parts)]
        parts.pop()
    return TOP.get(module)


def violations(modules: dict[str, str]) -> list[str]:
    bad = []
    for name, source in modules.items():
        mine = _layer_of(name)
        if mine is None:  # directly under service/, outside the layer packages
            bad.append(f"{name} has no layer: move it into service/{{{','.join(ORDER)}}}/")
            continue
        here = ORDER.index(mine)
        for imported in sorted(imports(source, name)):
            if not imported.startswith("service"):
                if mine == "engine" and imported.split(".")[0] in WEB_FRAMEWORKS:
                    bad.append(f"{name} (engine) imports the web framework {imported}")
                continue
            layer = _layer_of(imported)
            if layer is not None and ORDER.index(layer) > here:
                bad.append(f"{name} ({mine}) imports {imported} ({layer})")
    return bad


def test_every_service_module_has_a_layer_and_imports_none_above_it() -> None:
    assert violations(sources()) == []


def test_the_engine_raises_no_http_errors() -> None:
    # the engine answers with service.engine.engine_errors; statuses are the protocols' business
    modules = sources()
    engine = [name for name in modules if name.startswith("service.engine.text")]
    engine += ["service.engine.batcher", "service.engine.engine_errors"]
    assert "service.engine.text.scheduler" in engine
    for name in engine:
        assert "service.base.errors" not in imports(modules[name], name), name


def test_the_layer_is_the_package() -> None:
    assert [_layer_of(m) for m in ("service.base.errors", "service.engine.backends.torch", "service.protocols",
                                   "service.edge.app.create_app", "service.__main__", "service.ray.__main__",
                                   "service", "service.lonely", "models.gpt")] == [
        "base", "engine", "protocols", "edge", "edge", "edge", "base", None, None]
    assert {_layer_of(m) for m in sources()} == {*ORDER}  # no module outside the packages (and TOP)


def test_an_upward_import_is_caught() -> None:
    modules = sources()
    planted = dict(modules)
    planted["service.engine.batcher"] += "\nfrom service.protocols.openai_api import CompletionRequest\n"
    planted["service.engine.text.batch"] += "\nimport fastapi\n"
    planted["service.base.errors"] += "\nfrom service.engine import runtime\n"
    planted["service.lonely"] = "x = 1\n"  # directly under service/: no layer
    planted["service.edge.ray.options"] += "\nfrom ...engine.scheduler import TextScheduler\n"  # relative, allowed
    planted["service.engine.backends"] += "\nfrom ...protocols import classify\n"  # relative, from a package
    assert violations(planted) == [
        "service.base.errors (base) imports service.engine (engine)",
        "service.base.errors (base) imports service.engine.runtime (engine)",
        "service.engine.backends (engine) imports service.protocols (protocols)",
        "service.engine.backends (engine) imports service.protocols.classify (protocols)",
        "service.engine.batcher (engine) imports service.protocols.openai_api (protocols)",
        "service.engine.batcher (engine) imports service.protocols.openai_api.CompletionRequest (protocols)",
        "service.engine.text.batch (engine) imports the web framework fastapi",
        "service.lonely has no layer: move it into service/{base,engine,protocols,edge}/",
    ]


def test_the_edge_answers_each_engine_error_as_the_engine_did_before() -> None:
    # status, body code, Retry-After and the requests counter's outcome label, as when the engine raised them
    cases = [
        (QueueFull("model m has 3 requests queued; retry later", 7), 429, "queue_full", {"Retry-After": "7"},
         "rejected"),
        (ShuttingDown(), 503, "shutting_down", {}, "rejected"),
        (DeadlineExceeded("deadline exceeded while queued"), 504, "deadline_exceeded", {}, "timeout"),
        (Cancelled("client disconnected"), 499, "client_disconnected", {}, "cancelled"),
        (TooLarge("9 inputs in one request exceed the model's max batch size 8"), 400, "batch_too_large", {},
         "invalid_input"),
        (ModelFailed("model failed on this input: RuntimeError"), 500, "model_error", {}, "error"),
    ]
    for exc, status, code, headers, outcome in cases:
        error = http_error(exc)
        assert (error.status, error.code, error.headers, error.outcome, error.message) == (
            status, code, headers, outcome, exc.message)
    assert ShuttingDown().message == "server is shutting down"
