"""A Hugging Face folder exported while it serves (issue 50, `--folder-export auto`): the model answers on PyTorch as
soon as its weights are loaded; its export (service.engine.folder_export: the child process, its limit, the cache)
runs on a thread of its own, then the exported entry is loaded, validated and warmed up there, and switched in.

The switch is the repository API's reload (service.protocols.control): the exported entry gets a runtime of its own,
which takes the model's plain routes and its version's from then on; the PyTorch runtime keeps the requests that
hold it (a stream finishes on the backend it started on) and is released after the last one. Nothing is switched
when the version was replaced or unloaded meanwhile, or when the server is stopping. A failed export leaves the
model on PyTorch, said on its card (`serving`) and in `multimax_folder_export_state` / `multimax_folder_exports`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Protocol

from service.base.metrics import Metrics
from service.engine.engine_errors import ShuttingDown
from service.engine.entry import ModelEntry, ModelRuntime
from service.engine.export_status import FAILED, PASSED, PENDING, STATES, ExportStatus

log = logging.getLogger(__name__)


class Runtimes(Protocol):
    """What a switch uses of the server's runtimes (service.engine.runtime.Runtimes, which holds the exports: named
    here, not imported, so the two modules import in one direction only)."""

    metrics: Metrics
    versions: dict[str, dict[int, ModelRuntime]]
    locks: dict[str, asyncio.Lock]

    def runtime_of(self, entry: ModelEntry) -> ModelRuntime: ...
    def start_runtime(self, rt: ModelRuntime) -> None: ...
    async def release(self, rt: ModelRuntime, wait: bool = True) -> None: ...
    def release_later(self, rt: ModelRuntime) -> None: ...
    def publish(self, name: str) -> None: ...

JOIN_S = 10.0  # at shutdown: how long to wait for an export's thread (its child process is killed within 0.5 s)


def publish_state(metrics: Metrics, name: str, status: ExportStatus) -> None:
    """multimax_folder_export_state{model, state}: 1 for the state the model's export is in, 0 for the others."""
    def is_in(state: str) -> Callable[[], float]:
        return lambda: float(status.state == state)
    for state in STATES:
        metrics.folder_export_state.labels(name, state).set_function(is_in(state))


class BackgroundExports:
    """The exports running behind one server's served Hugging Face folders (its Runtimes holds one)."""

    def __init__(self, runtimes: Runtimes) -> None:
        self.runtimes = runtimes
        self.jobs: dict[ModelRuntime, _Job] = {}
        self._switches: set[asyncio.Task[None]] = set()

    def start(self, rt: ModelRuntime) -> None:
        """Start the export of `rt`'s folder, if it waits for one (on the event loop: the switch comes back here)."""
        status = rt.entry.export
        if status is None or status.state != PENDING or status.make is None or rt in self.jobs:
            return
        job = self.jobs[rt] = _Job(self, rt, status, asyncio.get_running_loop())
        status.begin()  # now: the card says "running" from the server's first answer
        job.thread.start()

    def cancel(self, rt: ModelRuntime) -> None:
        """`rt` is being released: its export, if one still runs, is stopped (nothing would take its result)."""
        job = self.jobs.pop(rt, None)
        if job is not None:
            job.stop.set()

    async def stop(self) -> None:
        """Stop every export (their child processes are killed) and wait for their threads, a while."""
        jobs = list(self.jobs.values())
        self.jobs.clear()
        for job in jobs:
            job.stop.set()
        for switch in self._switches:
            switch.cancel()
        await asyncio.gather(*(asyncio.to_thread(job.thread.join, JOIN_S) for job in jobs), *self._switches,
                             return_exceptions=True)

    def _done(self, job: _Job, entry: ModelEntry) -> None:
        """On the event loop: the exported entry is ready; switch to it."""
        task = asyncio.get_running_loop().create_task(self._switch(job, entry), name=f"switch-{job.rt.name}")
        self._switches.add(task)
        task.add_done_callback(self._switches.discard)

    async def _switch(self, job: _Job, made: ModelEntry) -> None:
        runtimes, old = self.runtimes, job.rt
        name, version = old.name, old.version
        left: ModelEntry | None = made  # closed at the end unless a runtime took it
        try:
            async with runtimes.locks.setdefault(name, asyncio.Lock()):  # after a repository load or unload of it
                if self.jobs.get(old) is not job or runtimes.versions.get(name, {}).get(version) is not old:
                    log.info("%s: its export is not switched in: the version was replaced or unloaded meanwhile",
                             name)
                    return
                new = runtimes.runtime_of(made)
                try:
                    runtimes.start_runtime(new)
                except ShuttingDown:  # the server began stopping meanwhile: nothing switched
                    left = None  # the runtime's release closes it
                    await runtimes.release(new, wait=False)
                    return
                runtimes.versions[name][version] = new
                job.status.switched()
                runtimes.publish(name)
                left = None
                runtimes.release_later(old)  # after the requests that hold it, streams included
        finally:
            if self.jobs.get(old) is job:
                del self.jobs[old]
            if left is not None:
                left.backend.close()
        metrics = runtimes.metrics
        metrics.folder_exports.labels(name, PASSED).inc()
        metrics.folder_export_switch.labels(name).set(job.status.switched_after_s or 0.0)
        log.info("%s: switched to its onnxruntime-genai export %.1f s after the export started; requests in flight "
                 "finish on PyTorch, which is released after them", name, job.status.switched_after_s or 0.0)


class _Job:
    """One folder's export on its own thread: `status.make(stop)` (service.engine.registry.exported_version)."""

    def __init__(self, owner: BackgroundExports, rt: ModelRuntime, status: ExportStatus,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.owner, self.rt, self.status, self.loop = owner, rt, status, loop
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"export-{rt.name}-{rt.version}", daemon=True)

    def _run(self) -> None:
        status, name = self.status, self.rt.name
        make = status.make
        assert make is not None
        status.make = None
        log.info("%s: exporting in the background; it serves on PyTorch meanwhile", name)
        try:
            made = make(self.stop)
        except Exception as exc:  # whatever the load of the export raises costs the export, never the server
            made = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        if isinstance(made, ModelEntry):
            made.export = status
        if self.stop.is_set():  # shutting down or unloaded: nothing takes it
            if isinstance(made, ModelEntry):
                made.backend.close()
            return
        if isinstance(made, str):
            status.fail(made)
            self.owner.runtimes.metrics.folder_exports.labels(name, FAILED).inc()
            log.warning("%s: its export failed (%s); it stays on PyTorch", name, made)
            return
        try:
            self.loop.call_soon_threadsafe(self.owner._done, self, made)
        except RuntimeError:  # the event loop has closed: the server is gone
            made.backend.close()
