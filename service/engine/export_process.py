"""The folder export's child process (`python -m export SOURCE -o DIR`, service.engine.folder_export): started in its
own process group, its progress lines turned into log lines, stopped with everything it started when it runs past
its limit, when the server asks (`stop`: a shutdown, a model unloaded while its export runs in the background) or
when the server dies (PR_SET_PDEATHSIG), and its verdict read from its report (validation.json)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("service.engine.folder_export")  # one logger for the export's lines, as before the split

REPORT = "validation.json"  # export.genai_folder.REPORT_FILE (service/ does not import export/)
HEARTBEAT_S = 30.0  # a log line at least this often while an export runs
POLL_S = 0.5  # how soon a stop asked for by the server is seen
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class ExportRun:
    """What one `python -m export` run gave: its exit code, its report (validation.json), what it printed last."""

    code: int
    report: dict[str, Any] | None
    seconds: float
    tail: list[str] = field(default_factory=list)
    timed_out: float | None = None  # the limit it ran past (it was then stopped)
    stopped: bool = False  # stopped because the server asked (shutting down, the model unloaded)

    @property
    def passed(self) -> bool:
        return self.code == 0 and self.report is not None and bool(self.report.get("passed"))

    @property
    def reason(self) -> str:
        if self.timed_out is not None:
            return (f"the export ran past its limit of {self.timed_out:.0f} s and was stopped "
                    "(--folder-export-timeout-s)")
        if self.stopped:
            return "the export was stopped: the server is shutting down or the model was unloaded"
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
        the limit: a load with a longer one tries again). A signal, a person's ^C, an out-of-memory kill or a stop
        the server asked for is tried again next time."""
        return (self.code > 0 and not self.stopped) or self.timed_out is not None


def run(label: str, command: list[str], out: Path, limit: float | None = None,
        stop: threading.Event | None = None) -> ExportRun:
    """Run `command` (the export of a folder into the new folder `out`), logging its steps as they start and a line
    every HEARTBEAT_S while one lasts. It is stopped, with whatever it started (its own process group), when it runs
    past `limit` seconds, when `stop` is set or when the calling thread is interrupted (^C); on Linux it also dies
    with the server (a SIGKILL of the server leaves no export running on)."""
    start = time.monotonic()
    progress = _Progress(label, start)
    timed_out, stopped, beat = None, False, start
    with open(out.parent / "export.log", "wb") as summary:  # the exporter's summary; the report has it all
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=summary, stderr=subprocess.PIPE,
                                cwd=out.parent, start_new_session=True, preexec_fn=_dies_with(os.getpid()))
        assert proc.stderr is not None
        reader = threading.Thread(target=progress.read, args=(proc.stderr,), name=f"export {label}", daemon=True)
        reader.start()
        try:
            while True:
                now = time.monotonic()
                left = None if limit is None else limit - (now - start)
                if left is not None and left <= 0:
                    timed_out = limit
                    log.warning("%s: the export ran past its limit of %.0f s (%s); stopping it", label, limit,
                                progress.step or "starting")
                    break
                if stop is not None and stop.is_set():
                    stopped = True
                    log.info("%s: stopping its export (%s)", label, progress.step or "starting")
                    break
                if now - beat >= HEARTBEAT_S:
                    beat = now
                    log.info("%s: exporting: %s, %.0f s so far", label, progress.step or "starting", now - start)
                wait = min(HEARTBEAT_S if stop is None else POLL_S, HEARTBEAT_S - (now - beat))
                try:
                    code = proc.wait(timeout=max(0.01, wait if left is None else min(wait, left)))
                    break
                except subprocess.TimeoutExpired:
                    continue
            if timed_out is not None or stopped:
                _stop(proc)
                code = proc.returncode
        except BaseException:
            _stop(proc)
            raise
        reader.join(10)
    report = None if timed_out is not None or stopped else _read_report(out / REPORT)
    return ExportRun(code, report, time.monotonic() - start, list(progress.tail), timed_out, stopped)


def _read_report(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data else None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The export and everything it started (its session's process group) killed, and reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _dies_with(parent: int) -> Callable[[], None] | None:
    """For the child, before it runs the export: the kernel kills it when the server dies (prctl PR_SET_PDEATHSIG,
    Linux; kept across exec; fired when the thread that started it ends, and that thread waits in `run` until
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
