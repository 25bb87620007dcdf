"""A Hugging Face model folder served from its onnxruntime-genai export, made on first load and cached (issue 40).

A `ForCausalLM` folder served as it is runs on PyTorch at about 0.6 of the speed of its `python -m export DIR -o OUT`
folder on ONNX Runtime. So, under `--folder-export auto` with `--backend auto` or `onnxruntime`, the registry asks
`cached_export` for the folder's export: validated against PyTorch by the exporter, kept in `--export-cache` under a
key of what it was made from, and reused by every later load. Layout of the cache:

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
import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from service.base.config import Settings

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1  # bump when what this module asks of the export (its arguments, files) changes
PRECISION = "fp32"  # the export's default: greedy text identical to PyTorch's
MANIFEST = "export.json"
REPORT = "validation.json"  # export.genai_folder.REPORT_FILE (service/ does not import export/)
HASHES = "file-hashes.json"
TMP = ".tmp-"
HEARTBEAT_S = 30.0  # a log line at least this often while an export runs
# --folder-export-timeout-s auto: the 125M-parameter Llama's 499 MB exported and validated in 88 s on 2 shared
# cores (0.18 s a MB); a floor for small folders and about 5x that rate for large ones
TIMEOUT_FLOOR_S = 600.0
TIMEOUT_S_PER_MB = 1.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
DOC_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".pdf")
DOC_STEMS = ("README", "LICENSE", "NOTICE", "USE_POLICY")
# what the export and its validation run; a new version may write another graph or judge it otherwise
PACKAGES = ("multimax-serve", "torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime", "onnxruntime-gpu",
            "onnxruntime-genai", "tokenizers", "safetensors", "numpy")
ROOT = Path(__file__).resolve().parents[2]  # the directory holding models/, plugins/, export/ (checkout or wheel)


def exports_folders(settings: Settings) -> bool:
    """Whether Hugging Face folders are served from their export: `--backend torch` asks for PyTorch itself."""
    return settings.folder_export == "auto" and settings.backend in ("auto", "onnxruntime")


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


@dataclass
class ExportRun:
    """What one `python -m export` run gave: its exit code, its report (validation.json), what it printed last."""

    code: int
    report: dict[str, Any] | None
    seconds: float
    tail: list[str] = field(default_factory=list)
    timed_out: float | None = None  # the limit it ran past (it was then stopped)

    @property
    def passed(self) -> bool:
        return self.code == 0 and self.report is not None and bool(self.report.get("passed"))

    @property
    def reason(self) -> str:
        if self.timed_out is not None:
            return (f"the export ran past its limit of {self.timed_out:.0f} s and was stopped "
                    "(--folder-export-timeout-s)")
        if self.code < 0:
            try:
                return f"the export was killed by {signal.Signals(-self.code).name}"
            except ValueError:
                return f"the export was killed by signal {-self.code}"
        if self.report is not None and not self.report.get("passed"):
            problems = [str(p) for p in self.report.get("problems", [])][:3]
            return "validation failed: " + ("; ".join(problems) or str(self.report.get("verdict")))
        said = next((line for line in reversed(self.tail) if line.startswith("error:")), None)
        last = said or (self.tail[-1] if self.tail else "no output")
        return f"python -m export exited with {self.code}: {last[:300]}"

    @property
    def lasting(self) -> bool:
        """A failure worth recording: the export ran to its end and said no, or ran past its limit (recorded with
        the limit: a load with a longer one tries again). A signal, a person's ^C or an out-of-memory kill, is tried
        again next time."""
        return self.code > 0 or self.timed_out is not None


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


def cached_export(label: str, source: Path, settings: Settings) -> CachedExport | None:
    """The validated export of the Hugging Face folder `source` (named `label` in the log), from the cache or made
    now; None when there is none (the export failed, now or before, or the cache is unusable): the log says why, and
    the caller serves the folder itself."""
    cache = settings.export_cache
    try:
        cache.mkdir(parents=True, exist_ok=True)
        key, inputs = export_key(source, cache, label)
        size = sum(p.stat().st_size for p in content_files(source))
        limit = timeout_for(settings, size)
        found = _ready(cache / key, key)
        if found is None and _failure(cache, key, label, limit) is None:
            with _locked(cache / f"{key}.lock", f"{label}: waiting for another process exporting it ({cache / key})"):
                # another process (or thread) may have finished, or failed, while this one waited
                found = _ready(cache / key, key)
                if found is None and _failure(cache, key, label, limit) is None:
                    return _export(label, source, key, inputs, settings, size, limit)
    except OSError as exc:
        log.warning("%s: the export cache %s is unusable (%s); serving the folder on PyTorch", label, cache, exc)
        return None
    if found is not None:
        log.info("%s: serving its cached export %s (made %s, %s)", label, found.folder,
                 found.manifest.get("exported_at"), found.manifest.get("verdict"))
    return found


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


def _failure(cache: Path, key: str, label: str, limit: float | None) -> dict[str, Any] | None:
    """The recorded failure of the key's export, if it still holds: one that ran past a shorter limit than this
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
    return failed


def _export(label: str, source: Path, key: str, inputs: dict[str, Any], settings: Settings, size: int,
            limit: float | None) -> CachedExport | None:
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
        run = run_export(label, source, work / "export", settings, limit)
        if not run.passed:
            if run.lasting:
                _write_json(cache / f"{key}.failed.json",
                            {"key": key, "source": label, "reason": run.reason, "exit_code": run.code,
                             "failed_at": _now(), "seconds": round(run.seconds, 1), "output": run.tail[-10:],
                             "inputs": inputs} | ({} if run.timed_out is None else {"timeout_s": run.timed_out}))
            log.warning("%s: not exported (%s) after %.1f s; serving the folder on PyTorch%s", label, run.reason,
                        run.seconds, f". Recorded in {cache / (key + '.failed.json')}: later loads of this content "
                        "skip the export (delete the file to try again)" if run.lasting else "")
            return None
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


# ---- the export, in a child process ----------------------------------------------------------------------------


def export_command(source: Path, out: Path, settings: Settings) -> list[str]:
    """`python -m export SOURCE -o OUT` with progress (parsed by run_export); PyTorch threads as the server's."""
    threads = ["--threads", str(settings.intra_op_threads)] if settings.intra_op_threads else []
    return [sys.executable, "-m", "export", str(source.resolve()), "-o", str(out), *threads]


def run_export(label: str, source: Path, out: Path, settings: Settings, limit: float | None = None) -> ExportRun:
    """Run the export of `source` into the new folder `out`, logging its steps as they start and a line every
    HEARTBEAT_S while one lasts. It is stopped, with whatever it started (its own process group), when it runs past
    `limit` seconds or the server stops meanwhile (^C); on Linux it also dies with the server (a SIGKILL of the
    server leaves no export running on)."""
    start = time.monotonic()
    progress = _Progress(label, start)
    timed_out = None
    with open(out.parent / "export.log", "wb") as summary:  # the exporter's summary; the report has it all
        proc = subprocess.Popen(export_command(source, out, settings), stdin=subprocess.DEVNULL, stdout=summary,
                                stderr=subprocess.PIPE, cwd=out.parent, start_new_session=True,
                                preexec_fn=_dies_with(os.getpid()))
        assert proc.stderr is not None
        reader = threading.Thread(target=progress.read, args=(proc.stderr,), name=f"export {label}", daemon=True)
        reader.start()
        try:
            while True:
                left = None if limit is None else limit - (time.monotonic() - start)
                if left is not None and left <= 0:
                    timed_out = limit
                    log.warning("%s: the export ran past its limit of %.0f s (%s); stopping it", label, limit,
                                progress.step or "starting")
                    _stop(proc)
                    code = proc.returncode
                    break
                try:
                    code = proc.wait(timeout=HEARTBEAT_S if left is None else min(HEARTBEAT_S, left))
                    break
                except subprocess.TimeoutExpired:
                    log.info("%s: exporting: %s, %.0f s so far", label, progress.step or "starting",
                             time.monotonic() - start)
        except BaseException:
            _stop(proc)
            raise
        reader.join(10)
    report = None if timed_out is not None else _read_json(out / REPORT) or None
    return ExportRun(code, report, time.monotonic() - start, list(progress.tail), timed_out)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The export and everything it started (its session's process group) killed, and reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _dies_with(parent: int) -> Callable[[], None] | None:
    """For the child, before it runs the export: the kernel kills it when the server dies (prctl PR_SET_PDEATHSIG,
    Linux; kept across exec; fired when the thread that started it ends, and that thread waits in run_export until
    the export has ended). The function is looked up here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the server died before the line above: nobody will kill this child
            os._exit(1)
    return set_parent_death_signal


class _Progress:
    """The exporter's progress lines (tqdm: `step: 00:05`, `step:  35%|...`, rewritten with \\r) as one log line per
    step; other lines are kept (the last 20) to say why an export failed."""

    STEP = re.compile(r"(.+?):\s+(?:\d+:\d\d\b|\d+%\|)")

    def __init__(self, label: str, start: float) -> None:
        self.label, self.start = label, start
        self.step = ""
        self.tail: deque[str] = deque(maxlen=20)

    def read(self, stream: IO[bytes]) -> None:
        pending = b""
        for chunk in iter(lambda: stream.read1(65536), b""):  # type: ignore[attr-defined]
            pending += chunk
            *pieces, pending = re.split(rb"[\r\n]", pending)
            for piece in pieces:
                self.line(piece.decode(errors="replace").strip())
        self.line(pending.decode(errors="replace").strip())

    def line(self, text: str) -> None:
        if not text:
            return
        match = self.STEP.match(text)
        if match is None:
            self.tail.append(text)
        elif match[1] != self.step:
            self.step = match[1]
            log.info("%s: exporting: %s (%.0f s)", self.label, self.step, time.monotonic() - self.start)


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
