"""The model directory: which files become which served models, on which backend.

A model is a file stem. `x.onnx` runs on ONNX Runtime, `x.engine`/`x.plan` on TensorRT, `x.pt` on
PyTorch. When several exist for one stem, `--backend` picks; `auto` prefers ONNX, then the checkpoint,
then an engine (an engine carries no metadata, so a sibling .onnx/.pt or `x.json` must describe it).
A file that fails to load or to validate (unreadable, truncated, metadata the server cannot use, a config
that does not describe the weights) is skipped with one log line and its reason is kept: it is listed
as UNAVAILABLE by `POST /v2/repository/index` and `multimax_model_ready` is 0 for it. One broken model
never keeps the others offline.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from pathlib import Path

from models import registry as architectures
from models.checkpoint import Checkpoint
from models.onnx_contract import OnnxMetadata, meta_key, proto_props, read_metadata
from service.base.config import Settings
from service.base.errors import without_paths
from service.engine.backends.base import Backend, BackendUnavailable
from service.engine.entry import Failed, Loaded, ModelEntry
from service.engine.export_status import PENDING
from service.engine.folder_export import exports_folders
from service.engine.model_folders import HF_FOLDER, folder_files, folder_kind, load_exported, load_folder_entry
from service.engine.tasks import served
from service.engine.warmup import warm_up

log = logging.getLogger(__name__)

SUFFIXES = {".onnx": "onnxruntime", ".pt": "torch", ".engine": "tensorrt", ".plan": "tensorrt"}
FOLDER_BACKENDS = {"hf-folder": "torch", "genai-folder": "onnxruntime"}
AUTO_ORDER = ("onnxruntime", "torch", "tensorrt")
MAX_SIDECAR_BYTES = 16 * 1024 * 1024  # an engine's labels and preprocessing: far below this


class RegistryError(RuntimeError):
    """The directory cannot be served at all (one line for the user)."""


Files = dict[str, Path]  # backend kind -> file of one model version
DEFAULT_VERSION = 1  # a plain file `name.onnx` is version 1 of `name`


def _kinds(paths: list[Path], stem: str) -> Files:
    """backend kind -> file among `paths` named `stem.<suffix>`."""
    files: Files = {}
    for path in paths:
        kind = SUFFIXES.get(path.suffix)
        if kind and path.stem == stem and path.is_file():
            files.setdefault(kind, path)
    return files


def _folder(path: Path) -> Files:
    """A model folder (Hugging Face or onnxruntime-genai, service.engine.model_folders) as {backend kind: folder}."""
    kind = folder_kind(path)
    if kind is None:
        return {}
    return {FOLDER_BACKENDS[kind]: path}


def _versions(directory: Path) -> dict[int, Files]:
    """Triton's layout: `name/<number>/model.onnx` (or .pt/.engine/.plan, side files such as model.json beside).
    A version is written without leading zeros: `01` beside `1` would be the same version twice, one of them
    silently dropped, so `01` (or `007`) is ignored with a warning naming the directory to rename."""
    found: dict[int, Files] = {}
    for sub in sorted(directory.iterdir()):
        if not (sub.is_dir() and sub.name.isascii() and sub.name.isdigit() and int(sub.name) > 0):
            continue
        files = _folder(sub) or _kinds(sorted(sub.iterdir()), "model")
        if not files:
            continue
        if sub.name != str(int(sub.name)):
            clash = " (and clashes with the version directory beside it)" if (directory / str(int(sub.name))).is_dir() \
                else ""
            log.warning("%s/%s: ignored: a version directory is a number without leading zeros, rename it to %d%s",
                        directory.name, sub.name, int(sub.name), clash)
            continue
        found[int(sub.name)] = files
    return dict(sorted(found.items()))


def scan(model_dir: Path) -> dict[str, dict[int, Files]]:
    """name -> version -> {backend kind: file}, in name order. A plain file `x.onnx` is version 1 of `x`; a
    directory `x/` with numbered subdirectories holds x's versions (it wins over plain `x.*` files)."""
    if not model_dir.is_dir():
        raise RegistryError(f"model directory {model_dir} does not exist or is not a directory")
    entries = sorted(model_dir.iterdir())
    found = {path.name: versions for path in entries if path.is_dir() and (versions := _versions(path))}
    for path in entries:  # a model folder itself: version 1 of its name
        if path.name not in found and (files := _folder(path)):
            found[path.name] = {DEFAULT_VERSION: files}
    versioned = set(found)
    for path in entries:
        kind = SUFFIXES.get(path.suffix)
        if not kind or not path.is_file():
            continue
        if path.stem in versioned:
            log.warning("%s: ignored, %s/ holds the versions of %s", path.name, path.stem, path.stem)
            continue
        found.setdefault(path.stem, {}).setdefault(DEFAULT_VERSION, {}).setdefault(kind, path)
    return dict(sorted(found.items()))


def choose(files: dict[str, Path], wanted: str) -> str | None:
    if wanted != "auto" and wanted in files:
        return wanted
    return next((k for k in AUTO_ORDER if k in files and (k != "tensorrt" or wanted in ("auto", "tensorrt"))), None)


def checkpoint_metadata(ckpt: Checkpoint) -> OnnxMetadata:
    """The fields an exported file would carry, from a checkpoint (its spec included)."""
    return OnnxMetadata(arch=ckpt.arch, config=dict(ckpt.config), labels=ckpt.labels, preprocess=ckpt.preprocess,
                        tokenizer=ckpt.tokenizer, spec=ckpt.spec().to_dict())


def _engine_metadata(name: str, files: Files) -> OnnxMetadata:
    sidecar = files["tensorrt"].with_suffix(".json")  # x.json beside x.engine; model.json in a version directory
    if sidecar.is_file():
        if sidecar.stat().st_size > MAX_SIDECAR_BYTES:
            raise BackendUnavailable(f"{sidecar.name}: more than {MAX_SIDECAR_BYTES} bytes of metadata")
        return OnnxMetadata.from_dict(json.loads(sidecar.read_text()))
    if "onnxruntime" in files:
        import onnx

        return read_metadata(proto_props(onnx.load(str(files["onnxruntime"]), load_external_data=False)))
    if "torch" in files:
        from models.checkpoint import parse, read_file

        ckpt, _ = parse(read_file(files["torch"]), str(files["torch"]))
        return checkpoint_metadata(ckpt)
    stem = files["tensorrt"].stem
    raise BackendUnavailable(f"{name}: an engine needs {stem}.onnx, {stem}.pt or {stem}.json beside it for its "
                             "labels and preprocessing")


def load_model(name: str, kind: str, files: dict[str, Path], settings: Settings) -> ModelEntry:
    path = files[kind]
    if path.is_dir():
        entry = load_folder_entry(name, folder_kind(path) or "", path, settings)
        try:
            validate(entry, path.name)
        except BaseException:
            entry.backend.close()
            raise
        return entry
    if kind == "onnxruntime":
        from service.engine.backends.onnxruntime import OnnxRuntimeBackend

        ort_backend = OnnxRuntimeBackend(path, settings.intra_op_threads, settings.inter_op_threads,
                                         settings.ort_providers, settings.ort_spinning)
        meta = ort_backend.metadata
        backend: Backend = ort_backend
    elif kind == "torch":
        from service.engine.backends.torch import TorchBackend

        torch_backend = TorchBackend(path, settings.device, settings.torch_compile, settings.intra_op_threads)
        meta = checkpoint_metadata(torch_backend.checkpoint)
        backend = torch_backend
    else:
        from service.engine.backends.tensorrt import TensorRTBackend

        meta = _engine_metadata(name, files)
        backend = TensorRTBackend(path, str(meta.arch), settings.trt_plugin_lib)
    arch = meta.arch
    try:
        if arch is None or (meta.spec is None and arch not in architectures.names()):
            raise BackendUnavailable(f"{path.name}: no {meta_key('arch')} metadata (got {arch!r}); not a MultiMax "
                                     "export?")
        try:
            spec = architectures.read_spec(meta)  # the spec key, or the legacy keys of an older file
        except ValueError as exc:
            raise BackendUnavailable(f"{path.name}: unusable model description: {exc}") from None
        task = spec.TASK
        served_task = served(task)
        if not isinstance(backend, served_task.backend):
            raise BackendUnavailable(f"{path.name}: the {backend.kind} backend does not run {task} models")
        carried = vars(meta)  # OnnxMetadata's fields by name (the task table names the ones it needs)
        missing = [field for field in served_task.metadata if not carried[field]]
        if missing:
            raise BackendUnavailable(f"{path.name}: a {task} model needs {' and '.join(missing)} metadata; the file "
                                     "has none")
    except BaseException:
        backend.close()
        raise
    entry = ModelEntry(name, arch, backend, dict(meta.config), spec, served_task, meta.labels, meta.preprocess,
                       tokenizer_entry=meta.tokenizer)
    try:
        validate(entry, path.name)
    except BaseException:
        backend.close()
        raise
    return entry


def validate(entry: ModelEntry, source: str) -> None:
    """Everything a request will rely on, checked now: preprocessing, tokenizer, labels (the entry becomes its
    task's model, `entry.model`), the description's sizes against what the backend really computes (a mismatch
    would otherwise fail every request)."""
    entry.model = entry.served.load(entry, source)
    entry.model.check_io(source)


def load_registry(settings: Settings) -> dict[str, ModelEntry]:
    """Every servable model in settings.model_dir (restricted to settings.models if given), its latest version."""
    return {name: versions[max(versions)] for name, versions in load_models(settings)[0].items()}


def _one_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return text or type(exc).__name__


def fingerprint(files: Files) -> tuple[tuple[str, int, int], ...]:
    """What identifies a version's files on disk (a repository load reloads a version whose files changed)."""
    paths = [p for path in sorted(files.values()) for p in (folder_files(path) if path.is_dir() else [path])]
    stats = [(str(path), path.stat()) for path in paths]
    return tuple((name, st.st_mtime_ns, st.st_size) for name, st in stats)


def check_backend(settings: Settings) -> None:
    if settings.backend == "tensorrt":
        from plugins.trt_plugin import tensorrt_unavailable

        why = tensorrt_unavailable()
        if why:
            raise RegistryError(f"--backend tensorrt: {why}")


def load_version(name: str, version: int, files: Files, settings: Settings) -> ModelEntry:
    """One version of a model, loaded, validated and warmed up (raises with the reason it cannot be served)."""
    kind = choose(files, settings.backend)
    if kind is None:
        raise BackendUnavailable(f"no file for backend {settings.backend}")
    # issue 40: a Hugging Face folder "on torch" is exported for onnxruntime (folder_export) unless that is off
    exported = folder_kind(files[kind]) == HF_FOLDER and exports_folders(settings)
    if settings.backend not in ("auto", kind) and not exported:
        log.info("%s: no %s file, serving it with %s", name, settings.backend, kind)
    start = time.perf_counter()
    stamp = fingerprint(files)  # before reading: a file replaced meanwhile is seen as changed by the next load
    chosen = files[kind]
    size = sum(p.stat().st_size for p in folder_files(chosen)) if chosen.is_dir() else chosen.stat().st_size
    if size > settings.max_model_bytes:
        raise BackendUnavailable(f"{files[kind].name}: {size} bytes, more than --max-model-bytes "
                                 f"{settings.max_model_bytes}")
    entry = load_model(name, kind, files, settings)
    entry.version, entry.source, entry.fingerprint = version, files[kind], stamp
    loaded = time.perf_counter()
    try:
        calls = warm_up(entry, settings)
    except BaseException as exc:
        entry.backend.close()
        raise BackendUnavailable(f"warm-up failed: {_one_line(exc)}") from exc
    log.info("loaded %s version %d (%s, %s on %s) in %.2f s, warmed up with %d calls in %.2f s", name, version,
             entry.task, entry.backend.kind, entry.backend.provider, loaded - start, calls,
             time.perf_counter() - loaded)
    if entry.export is not None and entry.export.state == PENDING:  # issue 50: exported while it serves
        entry.export.make = functools.partial(exported_version, name, version, files[kind], stamp, settings)
        log.info("%s: serves on PyTorch now; its onnxruntime-genai export runs in the background once the server "
                 "starts (--folder-export wait makes it before the model answers)", name)
    return entry


def exported_version(name: str, version: int, source: Path, stamp: tuple[tuple[str, int, int], ...],
                     settings: Settings, stop: threading.Event) -> ModelEntry | str:
    """The Hugging Face folder `source`'s export as version `version` of `name`, made if the cache has none, loaded,
    validated and warmed up as load_version does; or why it cannot serve (service.engine.background_export)."""
    entry = load_exported(name, source, settings, stop)
    if isinstance(entry, str):
        return entry
    start = time.perf_counter()
    log.info("%s: checking and warming up its export (PyTorch serves meanwhile)", name)
    try:
        validate(entry, source.name)
        checked = time.perf_counter()
        calls = warm_up(entry, settings)
    except Exception as exc:  # the export made it through its validation, but not the server's own checks
        entry.backend.close()
        return f"its export does not serve: {_one_line(exc)}"
    log.info("%s: its export is checked in %.1f s and warmed up with %d calls in %.1f s", name, checked - start, calls,
             time.perf_counter() - checked)
    entry.version, entry.source, entry.fingerprint = version, source, stamp
    return entry


def load_versions(name: str, versions: dict[int, Files], settings: Settings) -> tuple[dict[int, ModelEntry],
                                                                                      dict[int, str]]:
    """(loaded versions, failed versions -> why) of one model."""
    entries: dict[int, ModelEntry] = {}
    failed: dict[int, str] = {}
    for version, files in versions.items():
        try:
            entries[version] = load_version(name, version, files, settings)
        except Exception as exc:  # whatever a bad file raises (MemoryError included), it costs one version only
            # The log (read by operators) has the whole line; the reason that readiness and the repository index
            # show (to any client) names files, never where they are.
            log.error("%s: not served: %s (version %d)", name, _one_line(exc), version)
            failed[version] = without_paths(_one_line(exc))
    return entries, failed


def load_models(settings: Settings) -> tuple[Loaded, Failed]:
    """(servable models, versions that failed -> why), for settings.model_dir (restricted to settings.models)."""
    found = scan(settings.model_dir)
    if settings.models:
        missing = [m for m in settings.models if m not in found]
        if missing:
            raise RegistryError(f"model(s) {', '.join(missing)} not found in {settings.model_dir} "
                                f"(found: {', '.join(found) or 'none'})")
        found = {m: found[m] for m in settings.models}
    check_backend(settings)
    entries: Loaded = {}
    skipped: Failed = {}
    for name, versions in found.items():
        loaded, failed = load_versions(name, versions, settings)
        if loaded:
            entries[name] = loaded
        if failed:
            skipped[name] = failed
    if not entries:
        raise RegistryError(f"no servable model in {settings.model_dir} (see the log for why)")
    return entries, skipped
