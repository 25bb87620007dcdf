"""A Hugging Face model folder served from its onnxruntime-genai export, made on first load and cached (issue 40).

A `ForCausalLM` folder served as it is runs on PyTorch at about 0.6 of the speed of its `python -m export DIR -o OUT`
folder on ONNX Runtime. So, under `--folder-export auto` or `wait` with `--backend auto` or `onnxruntime`, the
registry asks for the folder's export (`lookup` at load, then `export_outcome` in the background under auto,
service.engine.background_export; before the model answers under wait): validated against PyTorch by the
exporter, kept in `--export-cache` under a key of what it was made from, and reused by every later load.
Layout of the cache:

    <key>/               a validated export: the onnxruntime-genai folder, its validation.json and MANIFEST
    <key>.failed.json    an export of that key that failed: not tried again (delete the file to retry)
    <key>.lock           taken (fcntl.flock) while the key is exported: processes and threads export a key once
    .tmp-<key>-*/        an export in progress; one left by a crash is removed by the next export of the key
    file-hashes.json     each hashed file's digest by (path, size, mtime, ctime, inode): a restart reads no weights

The key hashes the folder's files (every regular file but dotfiles and docs: config, weights, tokenizer, chat
template, generation config), the export code (export/, models/, plugins/ sources), the versions of the packages the
export and its validation run (torch, onnx, onnxscript, onnxruntime, onnxruntime-genai, ...) and MANIFEST_FORMAT.
An entry is written in a temporary directory of the cache and renamed into place once it passed; one whose files do
not match its manifest is never used (it is made again).

The export runs as `python -m export SOURCE -o DIR` in a child process, not through export.pipeline in this one:
service/ may not import export/ (the two are peers, tests/project/test_architecture.py), the exporter's memory (the
PyTorch model, the traced graph, the validation's reference: 750 MB for the 1.3M-parameter demo LLM) goes back to
the system before the server loads the export, and a crash in it (onnxruntime, an out-of-memory kill) costs the
export, not the server. Its progress lines become log lines; its verdict is its report's (validation.json).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from service.base.config import Settings
from service.engine import export_process
from service.engine.export_process import REPORT, ExportRun

__all__ = ["REPORT", "CachedExport", "ExportRun", "cached_export", "discard", "export_outcome", "exports_folders",
           "lookup", "run_export"]

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1  # bump when what this module asks of the export (its arguments, files) changes
PRECISION = "fp32"  # the export's default: greedy text identical to PyTorch's
MANIFEST = "export.json"
HASHES = "file-hashes.json"
TMP = ".tmp-"
# --folder-export-timeout-s auto: the 125M-parameter Llama's 499 MB exported and validated in 88 s on 2 shared
# cores (0.18 s a MB); a floor for small folders and about 5x that rate for large ones
TIMEOUT_FLOOR_S = 600.0
TIMEOUT_S_PER_MB = 1.0
DOC_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".pdf")
DOC_STEMS = ("README", "LICENSE", "NOTICE", "USE_POLICY")
# what the export and its validation run; a new version may write another graph or judge it otherwise
PACKAGES = ("multimax-serve", "torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "onnxruntime-gpu",
            "onnxruntime-genai", "tokenizers", "safetensors", "numpy")
ROOT = Path(__file__).resolve().parents[2]  # the directory holding models/, plugins/, export/ (checkout or wheel)


def exports_folders(settings: Settings) -> bool:
    """Whether Hugging Face folders are served from their export (made in the background under auto, before the
    model answers under wait): `--backend torch` asks for PyTorch itself."""
    return settings.folder_export in ("auto", "wait") and settings.backend in ("auto", "onnxruntime")


@dataclass
class CachedExport:
    """A validated export in the cache."""

    folder: Path
    key: str
    manifest: dict[str, Any]
    made: bool = False  # exported by this load (else reused)

    def describe(self, source: str) -> dict[str, Any]:
        """What a model card says of it (no path): served from the cached export of the folder `source`."""
        return {"artifact": "onnxruntime-genai folder, exported on first load and cached",
                "source": source, "source_format": "huggingface-folder", "key": self.key,
                "exported_at": self.manifest.get("exported_at"), "export_seconds": self.manifest.get("seconds"),
                "validation": self.manifest.get("verdict"), "reused": not self.made}


# ---- the key ----------------------------------------------------------------------------------------------------


def content_files(folder: Path) -> list[Path]:
    """The folder's files that an export reads or may read: every regular file but dotfiles and documents."""
    def is_doc(path: Path) -> bool:
        return path.suffix.lower() in DOC_SUFFIXES or path.name.upper().startswith(DOC_STEMS)
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and not is_doc(p))


def _sha256(path: Path) -> str:
    """Streamed in 1 MiB blocks (hashlib releases the GIL on blocks this large); Python 3.10 has no file_digest."""
    digest, block = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(block):
            digest.update(view[:n])
    return digest.hexdigest()


def _stamp(st: os.stat_result) -> list[int]:
    # ctime and inode as well: a copy that keeps mtime (cp -p, rsync -t, tar) still changes them
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def file_digests(files: list[Path], cache: Path, label: str) -> dict[str, str]:
    """name -> sha256 of each file, from file-hashes.json where its stamp is unchanged, else read (once: the lock
    makes a second process starting at the same time wait for the first one's digests)."""
    with _locked(cache / (HASHES + ".lock")):
        listed = _read_json(cache / HASHES).get("files")
        known = {k: v for k, v in listed.items() if isinstance(v, list)} if isinstance(listed, dict) else {}
        out, fresh = {}, {}
        stats = {path: path.stat() for path in files}
        todo = [p for p in files if known.get(str(p.resolve()), [None])[:-1] != _stamp(stats[p])]
        if todo:
            log.info("%s: hashing %d file(s), %s, for the export cache key", label, len(todo),
                     _size(sum(stats[p].st_size for p in todo)))
        for path in files:
            name = str(path.resolve())
            if path in todo:
                digest = _sha256(path)
                if _stamp(path.stat()) == _stamp(stats[path]):  # unchanged while read: its digest may be kept
                    fresh[name] = [*_stamp(stats[path]), digest]
            else:
                digest = known[name][-1]
            out[path.name] = digest
        if fresh:
            kept = {k: v for k, v in known.items() if k not in fresh and Path(k).exists()}
            _write_json(cache / HASHES, {"version": 1, "files": {**kept, **fresh}})
        return out


@functools.cache
def code_identity() -> str:
    """A digest of the export's own code: export/ and plugins/ (Python, the fused ops' C++ sources), models/ (the
    architectures it traces; not models/training)."""
    digest = hashlib.sha256()
    for package, patterns in (("export", ("*.py",)), ("plugins", ("*.py", "ort_ops/src/*")), ("models", ("*.py",))):
        base = ROOT / package
        paths = {p for pattern in patterns for p in base.rglob(pattern) if p.is_file()}
        for path in sorted(p for p in paths if "training" not in p.relative_to(base).parts):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def package_versions() -> dict[str, str | None]:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    return {name: version(name) for name in PACKAGES}


def export_key(folder: Path, cache: Path, label: str) -> tuple[str, dict[str, Any]]:
    """(key, what it hashes) of the folder's export."""
    inputs = {"format": MANIFEST_FORMAT, "precision": PRECISION, "code": code_identity(),
              "versions": package_versions(), "files": file_digests(content_files(folder), cache, label)}
    text = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:32], inputs


# ---- the cache --------------------------------------------------------------------------------------------------


def cached_export(label: str, source: Path, settings: Settings,
                  stop: threading.Event | None = None) -> CachedExport | None:
    """The validated export of the Hugging Face folder `source` (named `label` in the log), from the cache or made
    now; None when there is none (the export failed, now or before, or the cache is unusable): the log says why, and
    the caller serves the folder itself."""
    found = export_outcome(label, source, settings, stop)
    return found if isinstance(found, CachedExport) else None


def export_outcome(label: str, source: Path, settings: Settings,
                   stop: threading.Event | None = None) -> CachedExport | str:
    """cached_export's answer, or why there is none (a line for the model's card). `stop` ends an export running
    in the background (the server shuts down)."""
    cache = settings.export_cache
    try:
        cache.mkdir(parents=True, exist_ok=True)
        key, inputs = export_key(source, cache, label)
        size = sum(p.stat().st_size for p in content_files(source))
        limit = timeout_for(settings, size)
        found: CachedExport | str | None = _ready(cache / key, key)
        if found is None:
            found = _failure(cache, key, label, limit)
        if found is None:
            with _locked(cache / f"{key}.lock", f"{label}: waiting for another process exporting it ({cache / key})"):
                # another process (or thread) may have finished, or failed, while this one waited
                found = _ready(cache / key, key) or _failure(cache, key, label, limit)
                if found is None:
                    return _export(label, source, key, inputs, settings, size, limit, stop)
    except OSError as exc:
        log.warning("%s: the export cache %s is unusable (%s); serving the folder on PyTorch", label, cache, exc)
        return f"the export cache is unusable ({exc.strerror or type(exc).__name__})"
    if isinstance(found, CachedExport):
        log.info("%s: serving its cached export %s (made %s, %s)", label, found.folder,
                 found.manifest.get("exported_at"), found.manifest.get("verdict"))
    return found


def lookup(label: str, source: Path, settings: Settings) -> CachedExport | str | None:
    """What the cache holds for the folder now, without exporting: its validated export, why there is none (a
    recorded failure that still holds, an unusable cache) or None (no export yet: one may run). Reads no weights
    once their digests are in file-hashes.json."""
    cache = settings.export_cache
    try:
        cache.mkdir(parents=True, exist_ok=True)
        key, _ = export_key(source, cache, label)
        limit = timeout_for(settings, sum(p.stat().st_size for p in content_files(source)))
        found = _ready(cache / key, key)
        return found if found is not None else _failure(cache, key, label, limit)
    except OSError as exc:
        log.warning("%s: the export cache %s is unusable (%s); serving the folder on PyTorch", label, cache, exc)
        return f"the export cache is unusable ({exc.strerror or type(exc).__name__})"


def discard(export: CachedExport) -> None:
    """Remove an entry found damaged (onnxruntime cannot load it): the next `cached_export` makes it again."""
    with _locked(export.folder.with_name(f"{export.key}.lock")):
        _remove(export.folder)


def _ready(entry: Path, key: str) -> CachedExport | None:
    """The entry, if it is a complete, validated export of `key`: its manifest says so and every file it lists has
    the size it had when the export was published (a truncated or half-copied entry is not used)."""
    manifest = _read_json(entry / MANIFEST)
    files = manifest.get("files")
    if manifest.get("key") != key or manifest.get("passed") is not True or not isinstance(files, dict):
        return None
    for name, size in files.items():
        path = entry / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return CachedExport(entry, key, manifest)


def timeout_for(settings: Settings, size: int) -> float | None:
    """How long the export of a folder of `size` bytes (its content_files) may run (None: no limit): the option's
    seconds, or auto's by the size."""
    if settings.folder_export_timeout_s is not None:
        return settings.folder_export_timeout_s or None
    return TIMEOUT_FLOOR_S + TIMEOUT_S_PER_MB * size / 1e6


def _failure(cache: Path, key: str, label: str, limit: float | None) -> str | None:
    """Why the key's export failed, as recorded, if that still holds: one that ran past a shorter limit than this
    load's does not (the export is tried again)."""
    marker = cache / f"{key}.failed.json"
    failed = _read_json(marker)
    if not failed:
        return None
    ran_past = failed.get("timeout_s")
    if isinstance(ran_past, int | float) and (limit is None or limit > ran_past):
        log.info("%s: its export ran past %.0f s before; trying again with %s", label, ran_past,
                 "no limit" if limit is None else f"{limit:.0f} s")
        return None
    log.warning("%s: not exported: its export failed before (%s, %s); serving the folder on PyTorch. Delete %s to "
                "try again", label, failed.get("reason"), failed.get("failed_at"), marker)
    return (f"{failed.get('reason')} (at {failed.get('failed_at')}; recorded: delete {marker.name} in the export "
            "cache to try again)")


def _export(label: str, source: Path, key: str, inputs: dict[str, Any], settings: Settings, size: int,
            limit: float | None, stop: threading.Event | None) -> CachedExport | str:
    """Export under the key's lock: in a temporary directory of the cache, renamed into place once validated."""
    cache = settings.export_cache
    entry = cache / key
    if entry.exists():
        log.warning("%s: the cached export %s is incomplete or damaged: exporting it again", label, entry)
        _remove(entry)
    for stale in cache.glob(f"{TMP}{key}-*"):  # left by an export that crashed (only the lock's holder writes them)
        shutil.rmtree(stale, ignore_errors=True)
    log.info("%s: exporting the Hugging Face folder (%s) to an onnxruntime-genai folder, validated against PyTorch, "
             "on first load; later loads reuse it (%s; --folder-export off serves the folder itself; limit %s)",
             label, _size(size), entry, "none" if limit is None else f"{limit:.0f} s")
    work = Path(tempfile.mkdtemp(prefix=f"{TMP}{key}-", dir=cache))
    try:
        run = run_export(label, source, work / "export", settings, limit, stop)
        if not run.passed:
            if run.lasting:
                _write_json(cache / f"{key}.failed.json",
                            {"key": key, "source": label, "reason": run.reason, "exit_code": run.code,
                             "failed_at": _now(), "seconds": round(run.seconds, 1), "output": run.tail[-10:],
                             "inputs": inputs} | ({} if run.timed_out is None else {"timeout_s": run.timed_out}))
            log.warning("%s: not exported (%s) after %.1f s; serving the folder on PyTorch%s", label, run.reason,
                        run.seconds, f". Recorded in {cache / (key + '.failed.json')}: later loads of this content "
                        "skip the export (delete the file to try again)" if run.lasting else "")
            return run.reason
        report = run.report or {}
        manifest = {"key": key, "passed": True, "verdict": report.get("verdict"), "source": label,
                    "architecture": _architecture(source), "exported_at": _now(), "seconds": round(run.seconds, 1),
                    "inputs": inputs}
        _publish(work / "export", entry, manifest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("%s: exported and validated in %.1f s (%s): %s", label, run.seconds, manifest["verdict"], entry)
    return CachedExport(entry, key, manifest, made=True)


def _publish(folder: Path, entry: Path, manifest: dict[str, Any]) -> None:
    """The manifest (with every file's size) written last, everything synced, then the folder renamed into place."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest["files"] = {str(p.relative_to(folder)): p.stat().st_size for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    for path in [*files, folder / MANIFEST]:
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    os.rename(folder, entry)
    _sync_dir(entry.parent)


# ---- the export, in a child process (service.engine.export_process) --------------------------------------------


def export_command(source: Path, out: Path, settings: Settings) -> list[str]:
    """`python -m export SOURCE -o OUT` with progress (parsed by export_process); PyTorch threads as the server's."""
    threads = ["--threads", str(settings.intra_op_threads)] if settings.intra_op_threads else []
    return [sys.executable, "-m", "export", str(source.resolve()), "-o", str(out), *threads]


def run_export(label: str, source: Path, out: Path, settings: Settings, limit: float | None = None,
               stop: threading.Event | None = None) -> ExportRun:
    """The export of `source` into the new folder `out`, in a child process (export_process.run: its limit, `stop`,
    its process group)."""
    return export_process.run(label, export_command(source, out, settings), out, limit, stop)


# ---- small helpers ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path, waiting: str | None = None) -> Iterator[None]:
    """An exclusive flock on `path`: between processes, and between threads of one (each open is its own)."""
    with open(path, "a+b") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                log.info("%s", waiting)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object, or {} for a file that is missing, unreadable or not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Written atomically (a temporary file beside it, renamed over it)."""
    fd, tmp = tempfile.mkstemp(prefix=TMP, dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(data, indent=2) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _remove(entry: Path) -> None:
    """Out of the way at once (renamed), then deleted."""
    if not entry.exists():
        return
    gone = Path(tempfile.mkdtemp(prefix=f"{TMP}{entry.name}-removed-", dir=entry.parent))
    entry.rename(gone / entry.name)
    shutil.rmtree(gone, ignore_errors=True)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _architecture(source: Path) -> str | None:
    architectures = _read_json(source / "config.json").get("architectures")
    return str(architectures[0]) if isinstance(architectures, list) and architectures else None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
