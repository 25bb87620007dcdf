"""Where the server compiles a request's grammar: first in a worker process, then on a thread of its own.

llguidance compiles grammars in native code; a hostile one overflowed its stack and took the whole server down
with SIGSEGV (issue 38), and a slow one would hold a thread for as long as it likes. So every grammar is judged
first by `service.protocols.grammar_worker` in one of a few persistent worker processes: a worker that dies on it
(or takes longer than `grammar_timeout_s`, and is killed) makes that request a 400, and the next request gets a
fresh worker; the server, its other requests and its streams never notice. Only a grammar the worker compiled
and probed is compiled in the server, on BUILD_STACK's thread (twice the worker's stack, so the same grammar
cannot overflow it).

The pool is shared by every app of a process with the same settings (`guard_for`) and closed at exit; the
workers also exit by themselves when the server's end of their pipe closes.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

from service.protocols.grammar_worker import WORKER_STACK, GrammarJob, GrammarRefused, TokenizerSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

BUILD_STACK = 2 * WORKER_STACK
MAX_ANSWER = 256 * 1024 * 1024  # bytes of one answer (a grammar as llguidance writes it)
VALIDATED_CACHE = 64  # grammars a guard remembers as judged (a client that repeats its schema skips the worker)
_ROOT = str(Path(__file__).resolve().parents[2])  # where `service` is imported from: the worker imports it too


class GrammarWorkerFailed(GrammarRefused):
    """The worker died on the grammar, or did not finish it in time."""


class _Worker:
    """One worker process and the two pipes to it."""

    def __init__(self) -> None:
        jobs_r, jobs_w = os.pipe()
        answers_r, answers_w = os.pipe()
        # `service` from where this server imports it, never from a `service/` folder in the working directory
        env = dict(os.environ, PYTHONSAFEPATH="1",
                   PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service.protocols.grammar_worker", str(jobs_r), str(answers_w)],
                pass_fds=(jobs_r, answers_w), stdin=subprocess.DEVNULL, env=env, close_fds=True)
        except BaseException:
            for fd in (jobs_r, jobs_w, answers_r, answers_w):
                os.close(fd)
            raise
        os.close(jobs_r)
        os.close(answers_w)
        self.jobs = Connection(jobs_w, readable=False)
        self.answers = Connection(answers_r, writable=False)
        self.tokenizers: set[str] = set()  # keys this worker has built (it may have dropped some since)

    def call(self, key: str, spec: TokenizerSpec, job: GrammarJob, timeout: float) -> tuple[Any, ...]:
        """The worker's answer; GrammarWorkerFailed (and the worker killed) if it dies or runs out of time."""
        end = time.monotonic() + timeout
        known = key in self.tokenizers
        self.jobs.send((key, None if known else spec, tuple(job)))
        answer = self._receive(end, job)
        if answer[0] == "need_tokenizer" and known:  # it dropped the tokenizer since: send it again
            self.jobs.send((key, spec, tuple(job)))
            answer = self._receive(end, job)
        self.tokenizers.add(key)
        return answer

    def _receive(self, end: float, job: GrammarJob) -> tuple[Any, ...]:
        try:
            if self.answers.poll(max(0.0, end - time.monotonic())):
                return tuple(json.loads(self.answers.recv_bytes(MAX_ANSWER)))
        except (EOFError, OSError):
            self.close()
            code = self.proc.returncode
            log.warning("grammar worker %d died (exit %s) compiling %s; a new one takes its place", self.proc.pid,
                        code, job.field)
            raise GrammarWorkerFailed(f"could not be compiled: the grammar compiler crashed on it (exit {code}); "
                                      "nothing else was affected") from None
        self.close()
        log.warning("grammar worker %d killed: %s took longer than its timeout", self.proc.pid, job.field)
        raise GrammarWorkerFailed("took too long to compile (grammar_timeout_s)")

    def close(self) -> None:
        """Idempotent: the pipes closed, the process killed if it still runs, and reaped."""
        for conn in (self.jobs, self.answers):
            conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class GrammarGuard:
    """A pool of grammar workers: `check` judges a grammar in one of them (blocking: call it off the loop)."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)  # started when first taken
        self._validated: OrderedDict[tuple[str, GrammarJob], str] = OrderedDict()
        self._lock = threading.Lock()
        self._all: list[_Worker] = []

    def check(self, job: GrammarJob, spec: TokenizerSpec) -> str:
        """The job's llguidance grammar, compiled and probed over the tokenizer in a worker; GrammarRefused (a
        GrammarWorkerFailed if the worker died or timed out) otherwise."""
        with self._lock:
            if (spec.key, job) in self._validated:
                self._validated.move_to_end((spec.key, job))
                return self._validated[spec.key, job]
        worker = self._idle.get()
        try:
            if worker is not None and worker.proc.poll() is not None:  # it died while idle (killed from outside)
                self._retire(worker)
                worker = None
            if worker is None:
                worker = _Worker()
                with self._lock:
                    self._all.append(worker)
            answer = worker.call(spec.key, spec, job, self.timeout_s)
        except GrammarWorkerFailed:  # it is closed already
            self._retire(worker)
            worker = None
            raise
        except OSError as exc:  # its pipe broke some other way
            self._retire(worker)
            worker = None
            raise GrammarWorkerFailed("could not be compiled: the grammar worker failed on it") from exc
        except BaseException:
            self._retire(worker)
            worker = None
            raise
        finally:
            self._idle.put(worker)
        if answer[0] != "ok":
            raise GrammarRefused(str(answer[-1]))
        grammar = str(answer[1])
        with self._lock:
            self._validated[spec.key, job] = grammar
            while len(self._validated) > VALIDATED_CACHE:
                self._validated.popitem(last=False)
        return grammar

    def _retire(self, worker: _Worker | None) -> None:
        if worker is None:
            return
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        worker.close()

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
        for worker in workers:
            worker.close()


_GUARDS: dict[tuple[int, float], GrammarGuard] = {}
_GUARDS_LOCK = threading.Lock()


def guard_for(workers: int, timeout_s: float) -> GrammarGuard:
    """The process's guard with these settings (created on first use)."""
    with _GUARDS_LOCK:
        guard = _GUARDS.get((workers, timeout_s))
        if guard is None:
            guard = _GUARDS[workers, timeout_s] = GrammarGuard(workers, timeout_s)
        return guard


@atexit.register
def close_all() -> None:
    with _GUARDS_LOCK:
        guards = list(_GUARDS.values())
        _GUARDS.clear()
    for guard in guards:
        guard.close()


_BUILDER: ThreadPoolExecutor | None = None
_BUILDER_LOCK = threading.Lock()


def builder() -> ThreadPoolExecutor:
    """The one thread the server compiles grammars on, with BUILD_STACK bytes of stack."""
    global _BUILDER
    with _BUILDER_LOCK:
        if _BUILDER is None:
            previous = threading.stack_size(BUILD_STACK)
            try:
                pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-build")
                pool.submit(lambda: None).result()  # its thread starts now, with this stack size
            finally:
                threading.stack_size(previous)
            _BUILDER = pool
        return _BUILDER


def on_build_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the build thread, waited for (from a thread that is not the event loop)."""
    return builder().submit(fn, *args).result()
