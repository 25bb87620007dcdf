"""service/ in layers: every module has one, and no module imports one above its own.

Bottom to top:
  base       what every layer shares: settings, metrics, request context, logs, tracing, health, the
             request-error vocabulary (service.errors: ServiceError, the OpenAI / KServe error bodies) and the
             wire formats (request bodies, bounded JSON, KServe V2 tensors)
  engine     runs models: backends, runtimes, the dynamic batcher, the text scheduler, the sampler, the KV cache,
             the detokenizers, model loading and checks; it raises its own errors (service.engine_errors) and
             knows no web framework
  protocols  what a request means: OpenAI, KServe V2, classification, model control; they call the engine and
             answer its errors with statuses (service.engine_status)
  edge       the HTTP server around them: the app, middleware, auth, cross-site checks, access log, slow clients,
             error handlers, the docs pages, the CLIs (and Ray Serve's replica, which wraps the app)

A new module must be given its layer here (the test names it), so that where it sits is a decision; a module of a
listed package (service.backends, service.ray, service.tasks) has its package's layer unless listed itself.
Entries marked "(when present)" are modules other branches of this wave add.
"""

from __future__ import annotations

import ast
from pathlib import Path

from service.engine_errors import Cancelled, DeadlineExceeded, ModelFailed, QueueFull, ShuttingDown, TooLarge
from service.engine_status import http_error

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("base", "engine", "protocols", "edge")

LAYER = {
    # base
    "service": "base",
    "service.access_config": "base",
    "service.config": "base",
    "service.context": "base",
    "service.errors": "base",
    "service.health": "base",
    "service.logs": "base",
    "service.metrics": "base",
    "service.pngcheck": "base",
    "service.tracing": "base",
    "service.bodies": "base",  # wire formats shared by the protocols and the task modules: request bodies,
    "service.jsonio": "base",  # bounded JSON,
    "service.kserve_codec": "base",  # KServe V2 tensors (pure numpy)
    # engine
    "service.backends": "engine",
    "service.backends.base": "engine",
    "service.backends.checks": "engine",
    "service.backends.onnxruntime": "engine",
    "service.backends.probe": "engine",
    "service.backends.tensorrt": "engine",
    "service.backends.torch": "engine",
    "service.batcher": "engine",
    "service.decoding": "engine",
    "service.detokenizer": "engine",  # incremental detokenization of HF tokenizers (when present)
    "service.hf_text": "engine",  # (when present) Hugging Face tokenizers
    "service.jpeg": "engine",  # (when present) JPEG decoding for service.vision
    "service.model_folders": "engine",  # (when present) loading model folders
    "service.engine_errors": "engine",
    "service.entry": "engine",
    "service.generation": "engine",  # the old names of scheduler, sampler and text_detok, re-exported
    "service.kvcache": "engine",
    "service.registry": "engine",
    "service.runtime": "engine",
    "service.sampler": "engine",
    "service.scheduler": "engine",
    "service.text_detok": "engine",
    "service.vision": "engine",
    "service.tasks": "engine",  # (when present) per-task validation, checks, warm-up, runtime and codec
    "service.warmup": "engine",
    # protocols
    "service.chat_api": "protocols",  # (when present)
    "service.chat_template": "protocols",  # (when present)
    "service.choices": "protocols",
    "service.classify": "protocols",
    "service.control": "protocols",
    "service.endpoint": "protocols",
    "service.engine_status": "protocols",
    "service.fields": "protocols",  # (when present) request fields' status
    "service.kserve": "protocols",
    "service.lifecycle": "protocols",
    "service.openai_api": "protocols",
    "service.stream_steps": "protocols",  # (when present) one stream event per decode step
    "service.structured": "protocols",  # (when present) request formats -> the sampler's logits processors
    # edge
    "service.__main__": "edge",
    "service.access": "edge",
    "service.app": "edge",
    "service.auth": "edge",
    "service.crosssite": "edge",
    "service.docs": "edge",
    "service.handlers": "edge",
    "service.middleware": "edge",
    "service.slowclient": "edge",
    "service.ray": "edge",
    "service.ray.__main__": "edge",
    "service.ray.app": "edge",
    "service.ray.metrics": "edge",
    "service.ray.options": "edge",
    "service.ray.replica": "edge",
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
        mine = _layer_of(name)  # a package's layer is its modules' (service.backends.*), unless one is listed
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
    # batcher and scheduler answer with service.engine_errors; statuses are the protocols' business
    modules = sources()
    for name in ("service.batcher", "service.scheduler", "service.sampler", "service.kvcache", "service.text_detok",
                 "service.engine_errors"):
        assert "service.errors" not in imports(modules[name], name), name


def test_an_upward_import_is_caught() -> None:
    modules = sources()
    planted = dict(modules)
    planted["service.batcher"] += "\nfrom service.openai_api import CompletionRequest\n"
    planted["service.kvcache"] += "\nimport fastapi\n"
    planted["service.errors"] += "\nfrom service import runtime\n"
    planted["service.lonely"] = "x = 1\n"
    planted["service.ray.options"] += "\nfrom ..scheduler import TextScheduler\n"  # relative: resolved, allowed
    planted["service.backends"] += "\nfrom .. import classify\n"
    assert violations(planted) == [
        "service.backends (engine) imports service.classify (protocols)",
        "service.batcher (engine) imports service.openai_api (protocols)",
        "service.batcher (engine) imports service.openai_api.CompletionRequest (protocols)",
        "service.errors (base) imports service.runtime (engine)",
        "service.kvcache (engine) imports the web framework fastapi",
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
