"""service/ in layers: every module has one, and no module imports one above its own.

Bottom to top:
  base       what every layer shares: settings, metrics, request context, logs, tracing, health, the
             request-error vocabulary (service.base.errors: ServiceError, the OpenAI / KServe error bodies) and the
             wire formats (request bodies, bounded JSON, KServe V2 tensors)
  engine     runs models: backends, runtimes, the dynamic batcher, the text scheduler, the sampler, the KV cache,
             the detokenizers, model loading and checks; it raises its own errors (service.engine.engine_errors) and
             knows no web framework
  protocols  what a request means: OpenAI, KServe V2, classification, model control; they call the engine and
             answer its errors with statuses (service.protocols.engine_status)
  edge       the HTTP server around them: the app, middleware, auth, cross-site checks, access log, slow clients,
             error handlers, the docs pages, the CLIs (and Ray Serve's replica, which wraps the app)

A new module must be given its layer here (the test names it), so that where it sits is a decision; a module of a
listed package (service.engine.backends, service.ray, service.engine.tasks) has its package's layer unless listed itself.
Entries marked "(when present)" are modules other branches of this wave add.
"""

from __future__ import annotations

import ast
from pathlib import Path

from service.engine.engine_errors import Cancelled, DeadlineExceeded, ModelFailed, QueueFull, ShuttingDown, TooLarge
from service.protocols.engine_status import http_error

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("base", "engine", "protocols", "edge")

LAYER = {
    # base
    "service": "base",
    "service.base.access_config": "base",
    "service.base.config": "base",
    "service.base.context": "base",
    "service.base.errors": "base",
    "service.base.health": "base",
    "service.base.logs": "base",
    "service.base.metrics": "base",
    "service.base.pngcheck": "base",
    "service.base.tracing": "base",
    "service.base.bodies": "base",  # wire formats shared by the protocols and the task modules: request bodies,
    "service.base.jsonio": "base",  # bounded JSON,
    "service.base.kserve_codec": "base",  # KServe V2 tensors (pure numpy)
    # engine
    "service.engine.backends": "engine",
    "service.engine.backends.base": "engine",
    "service.engine.backends.checks": "engine",
    "service.engine.backends.onnxruntime": "engine",
    "service.engine.backends.probe": "engine",
    "service.engine.backends.tensorrt": "engine",
    "service.engine.backends.torch": "engine",
    "service.engine.batcher": "engine",
    "service.engine.decoding": "engine",
    "service.engine.detokenizer": "engine",  # incremental detokenization of HF tokenizers (when present)
    "service.engine.hf_text": "engine",  # (when present) Hugging Face tokenizers
    "service.engine.jpeg": "engine",  # (when present) JPEG decoding for service.engine.vision
    "service.engine.model_folders": "engine",  # (when present) loading model folders
    "service.engine.engine_errors": "engine",
    "service.engine.entry": "engine",
    "service.engine.generation": "engine",  # the old names of scheduler, sampler and text_detok, re-exported
    "service.engine.kvcache": "engine",
    "service.engine.registry": "engine",
    "service.engine.runtime": "engine",
    "service.engine.sampler": "engine",
    "service.engine.scheduler": "engine",
    "service.engine.text_detok": "engine",
    "service.engine.vision": "engine",
    "service.engine.tasks": "engine",  # (when present) per-task validation, checks, warm-up, runtime and codec
    "service.engine.warmup": "engine",
    # protocols
    "service.protocols.chat_api": "protocols",  # (when present)
    "service.protocols.chat_template": "protocols",  # (when present)
    "service.protocols.choices": "protocols",
    "service.protocols.classify": "protocols",
    "service.protocols.control": "protocols",
    "service.protocols.endpoint": "protocols",
    "service.protocols.engine_status": "protocols",
    "service.protocols.fields": "protocols",  # (when present) request fields' status
    "service.protocols.kserve": "protocols",
    "service.protocols.lifecycle": "protocols",
    "service.protocols.openai_api": "protocols",
    "service.protocols.stream_steps": "protocols",  # (when present) one stream event per decode step
    "service.protocols.structured": "protocols",  # (when present) request formats -> the sampler's logits processors
    # edge
    "service.__main__": "edge",
    "service.access": "edge",
    "service.edge.app": "edge",
    "service.edge.auth": "edge",
    "service.edge.crosssite": "edge",
    "service.edge.docs": "edge",
    "service.edge.handlers": "edge",
    "service.edge.middleware": "edge",
    "service.edge.slowclient": "edge",
    "service.ray": "edge",
    "service.edge.ray.__main__": "edge",
    "service.edge.ray.app": "edge",
    "service.edge.ray.metrics": "edge",
    "service.edge.ray.options": "edge",
    "service.edge.ray.replica": "edge",
}
WEB_FRAMEWORKS = ("fastapi", "starlette", "pydantic", "uvicorn")


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


PACKAGES = {_name(p) for p in (ROOT / "service").rglob("__init__.py")}


def sources() -> dict[str, str]:
    return {_name(p): p.read_text() for p in sorted((ROOT / "service").rglob("*.py"))}


def imports(source: str, module: str) -> set[str]:
    """What `source` (of `module`) imports: `from a import b` counts as a and a.b (b may be a module:
    `from service import kvcache`)."""
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


def _layer_of(imported: str) -> str | None:
    while imported:
        if imported in LAYER:
            return LAYER[imported]
        imported = imported.rpartition(".")[0]
    return None


def violations(modules: dict[str, str]) -> list[str]:
    bad = []
    for name, source in modules.items():
        mine = _layer_of(name)  # a package's layer is its modules' (service.engine.backends.*), unless one is listed
        if mine is None or (name not in LAYER and name.count(".") == 1):
            bad.append(f"{name} has no layer: add it to LAYER in {Path(__file__).name}")
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
    # batcher and scheduler answer with service.engine.engine_errors; statuses are the protocols' business
    modules = sources()
    for name in ("service.engine.batcher", "service.engine.scheduler", "service.engine.sampler", "service.engine.kvcache", "service.engine.text_detok",
                 "service.engine.engine_errors"):
        assert "service.base.errors" not in imports(modules[name], name), name


def test_an_upward_import_is_caught() -> None:
    modules = sources()
    planted = dict(modules)
    planted["service.engine.batcher"] += "\nfrom service.protocols.openai_api import CompletionRequest\n"
    planted["service.engine.kvcache"] += "\nimport fastapi\n"
    planted["service.base.errors"] += "\nfrom service import runtime\n"
    planted["service.lonely"] = "x = 1\n"
    planted["service.edge.ray.options"] += "\nfrom ..scheduler import TextScheduler\n"  # relative: resolved, allowed
    planted["service.engine.backends"] += "\nfrom .. import classify\n"
    assert violations(planted) == [
        "service.engine.backends (engine) imports service.protocols.classify (protocols)",
        "service.engine.batcher (engine) imports service.protocols.openai_api (protocols)",
        "service.engine.batcher (engine) imports service.protocols.openai_api.CompletionRequest (protocols)",
        "service.base.errors (base) imports service.engine.runtime (engine)",
        "service.engine.kvcache (engine) imports the web framework fastapi",
        "service.lonely has no layer: add it to LAYER in test_service_layers.py",
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
