"""Drive a server: warm-up, then the measured phase, in a closed or an open loop; `run(LoadConfig) -> Result`.

Closed loop: `concurrency` workers, each sends its next request when its last one came back. Open loop: send
times are fixed up front (constant or Poisson) and each request starts at its time whether or not earlier ones
have returned; its latency counts from that scheduled time. A cap on requests in flight keeps a dead server
from exhausting sockets; requests that wait for it are counted, and their wait is part of their latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import resource
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from datetime import datetime, timezone
from typing import Any, TypeVar

import aiohttp

from benchmarks.loadtest.client import Sample, execute, make_session
from benchmarks.loadtest.config import ConfigError, LoadConfig
from benchmarks.loadtest.progress import LiveState, Progress
from benchmarks.loadtest.prom import Snapshot, diff_metrics, parse_metrics
from benchmarks.loadtest.schedule import bounded, send_offsets
from benchmarks.loadtest.stats import Recorder, Result
from benchmarks.loadtest.workloads import Workload, build_workload

Sink = Callable[[Sample], None]
T = TypeVar("T")
PREFLIGHT_TIMEOUT_S = 5.0
DEAD_SERVER_STREAK = 50


async def _get(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, bytes]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False) as resp:
        return resp.status, await resp.read()


async def preflight(session: aiohttp.ClientSession, base: str, cfg: LoadConfig) -> dict[str, Any] | None:
    """Fail fast (ConfigError) on a server that does not answer or does not serve the model; return the V2
    model metadata for the infer workload when the server has it."""
    try:
        status, body = await _get(session, f"{base}/v1/models", PREFLIGHT_TIMEOUT_S)
    except (aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError) as exc:
        raise ConfigError(f"cannot reach the server at {cfg.url}: {exc or type(exc).__name__}") from None
    if status in (401, 403):
        raise ConfigError(f"the server at {cfg.url} refused the credentials ({status}): "
                          + ("check --api-key" if cfg.api_key else "give --api-key"))
    ids: list[str] = []
    if status == 200:  # OpenAI's list format; anything else: no check
        with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
            ids = [str(m["id"]) for m in json.loads(body)["data"]]
    if ids and cfg.model_name not in ids:
        raise ConfigError(f"model {cfg.model_name!r} is not served at {cfg.url} (served: {', '.join(ids)})")
    if cfg.workload != "infer":
        return None
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError, ValueError):
        status, body = await _get(session, f"{base}/v2/models/{cfg.model_name}", PREFLIGHT_TIMEOUT_S)
        if status == 200:
            meta = json.loads(body)
            return meta if isinstance(meta, dict) else None
    return None


async def scrape(session: aiohttp.ClientSession, base: str, timeout_s: float) -> tuple[Snapshot | None, str | None]:
    try:
        status, body = await _get(session, f"{base}/metrics", timeout_s)
    except (aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError) as exc:
        return None, f"GET /metrics failed: {exc or type(exc).__name__}"
    if status != 200:
        return None, f"GET /metrics answered {status}"
    return parse_metrics(body.decode("utf-8", "replace")), None


class Phase:
    """One bounded stretch of load (the warm-up or the measured part)."""

    def __init__(self, cfg: LoadConfig, session: aiohttp.ClientSession, base: str, workload: Workload,
                 indices: Iterator[int], stop: asyncio.Event, sink: Sink | None) -> None:
        self.cfg, self.session, self.base, self.workload = cfg, session, base, workload
        self.indices, self.stop, self.sink = indices, stop, sink
        self.state = LiveState()
        self.dead_streak = 0  # consecutive timeouts / connection errors
        self.aborted: str | None = None

    def _record(self, sample: Sample) -> None:
        self.state.finished(sample.outcome == "ok", sample.latency)
        if sample.outcome in ("timeout", "connection"):
            self.dead_streak += 1
            if self.dead_streak >= DEAD_SERVER_STREAK and self.aborted is None:
                # A hung or vanished server would otherwise keep a count-bound run going for
                # requests x timeout / concurrency: stop sending, and say why.
                self.aborted = (f"stopped early: {self.dead_streak} requests in a row ended in timeouts or "
                                f"connection errors (last: {sample.error})")
                self.stop.set()
        else:
            self.dead_streak = 0
        if self.sink is not None:
            self.sink(sample)

    async def _one(self, index: int, scheduled: float | None) -> None:
        self.state.started()
        try:
            sample = await execute(self.session, self.base, self.workload.request(index), index, scheduled)
        except Exception as exc:  # a bug here must not stall the run: count it and go on
            now = time.perf_counter()
            sample = Sample(index, now if scheduled is None else scheduled, now, now, 0, "other",
                            error=f"{type(exc).__name__}: {exc}"[:200])
        self._record(sample)

    async def closed(self, duration_s: float | None, requests: int | None) -> None:
        deadline = math.inf if duration_s is None else time.perf_counter() + duration_s
        issued = 0

        async def worker() -> None:
            nonlocal issued
            while not self.stop.is_set() and time.perf_counter() < deadline:
                if requests is not None and issued >= requests:
                    return
                issued += 1  # claimed before the await: the workers together send exactly `requests`
                await self._one(next(self.indices), None)

        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency or 1)))

    async def open(self, duration_s: float | None, requests: int | None, seed: int) -> None:
        cfg = self.cfg
        assert cfg.rate is not None
        cap = asyncio.Semaphore(cfg.max_in_flight)
        tasks: set[asyncio.Task[None]] = set()

        async def one(index: int, scheduled: float) -> None:
            try:
                await self._one(index, scheduled)
            finally:
                cap.release()

        start = time.perf_counter()
        for offset in bounded(send_offsets(cfg.rate, cfg.poisson, seed), duration_s, requests):
            if self.stop.is_set():
                break
            scheduled = start + offset
            delay = scheduled - time.perf_counter()
            # Behind schedule (delay <= 0) it sends at once, but still yields so that responses are read in
            # between: a dispatcher that never yields starves them and falls further behind.
            await asyncio.sleep(delay if delay > 0 else 0)
            index = next(self.indices)
            if cap.locked():
                self.state.cap_hits += 1
                # Wait for a slot only as long as the request's own timeout, counted from its scheduled time:
                # past that it has failed for its user anyway. This bounds the run when the server hangs.
                budget = scheduled + cfg.timeout_s - time.perf_counter()
                try:
                    await asyncio.wait_for(cap.acquire(), max(budget, 0.0))
                except (TimeoutError, asyncio.TimeoutError):
                    now = time.perf_counter()
                    self.state.started()
                    self._record(Sample(index, scheduled, now, now, 0, "timeout",
                                        error="not sent: the in-flight cap stayed full for the whole timeout"))
                    continue
            else:
                await cap.acquire()
            task = asyncio.create_task(one(index, scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def run(self, duration_s: float | None, requests: int | None, seed: int, label: str,
                  progress: Progress | None) -> None:
        watcher = None
        if progress is not None:
            total = float(requests) if requests is not None else float(duration_s or 0)
            watcher = asyncio.create_task(progress.watch(label, self.state, total, requests is not None))
        try:
            if self.cfg.concurrency is not None:
                await self.closed(duration_s, requests)
            else:
                await self.open(duration_s, requests, seed)
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (Linux /proc/stat), to tell a busy neighbour."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def _generator_report(cfg: LoadConfig, state: LiveState, cpu_s: float, wall_s: float, machine_s: float | None,
                      result: Result) -> dict[str, Any]:
    cpu_pct = 100 * cpu_s / wall_s if wall_s > 0 else 0.0
    warnings = []
    if cpu_pct > 85:
        warnings.append(f"the load generator used {cpu_pct:.0f}% of a core: it may be the bottleneck")
    lag = result.send_lag_ms
    if cfg.mode == "open" and lag and lag["p99"] > 10:
        warnings.append(f"sends lagged their schedule (p99 {lag['p99']:.1f} ms): the offered rate was not kept")
    if state.cap_hits:
        warnings.append(f"the in-flight cap ({cfg.max_in_flight}) held back {state.cap_hits} sends; their wait "
                        "counts in their latency")
    loop = type(asyncio.get_running_loop())
    return {"cpu_s": round(cpu_s, 3), "cpu_percent": round(cpu_pct, 1), "max_in_flight": state.max_in_flight,
            "event_loop": f"{loop.__module__}.{loop.__qualname__}",
            "in_flight_cap": cfg.max_in_flight if cfg.mode == "open" else cfg.concurrency,
            "cap_hits": state.cap_hits,
            # CPU the whole machine used meanwhile (server, generator and anything else), in % of one core
            "machine_cpu_percent": None if machine_s is None else round(100 * machine_s / wall_s, 1),
            "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2), "warnings": warnings}


async def run_async(cfg: LoadConfig, progress: Progress | None = None) -> Result:
    cfg.validate()
    base = cfg.url.rstrip("/")
    connections = cfg.concurrency if cfg.concurrency is not None else cfg.max_in_flight
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handle_sigint = threading.current_thread() is threading.main_thread()
    if handle_sigint:  # Ctrl-C: stop sending, let in-flight requests finish, report what was measured
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        async with make_session(connections, cfg.timeout_s, cfg.api_key) as session:
            metadata = await preflight(session, base, cfg)
            workload = build_workload(cfg, metadata)
            indices = itertools.count()
            warm = Phase(cfg, session, base, workload, indices, stop, None)
            if cfg.warmup_s > 0:
                await warm.run(cfg.warmup_s, None, cfg.seed + 1, "warm-up", progress)
            before = after = None
            note = None
            if cfg.scrape_metrics:
                before, note = await scrape(session, base, PREFLIGHT_TIMEOUT_S)
            rec = Recorder(cfg)
            phase = Phase(cfg, session, base, workload, indices, stop, rec.add)
            started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
            cpu0, machine0, start = _cpu_s(), _machine_busy_s(), time.perf_counter()
            await phase.run(cfg.duration_s, cfg.requests, cfg.seed, "measure", progress)
            cpu_s, wall_s, machine1 = _cpu_s() - cpu0, time.perf_counter() - start, _machine_busy_s()
            machine_s = None if machine0 is None or machine1 is None else machine1 - machine0
            if before is not None:
                after, note = await scrape(session, base, PREFLIGHT_TIMEOUT_S)
    finally:
        if handle_sigint:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
    result = rec.result(start, started_at, {})
    result.generator = _generator_report(cfg, phase.state, cpu_s, wall_s, machine_s, result)
    if before is not None and after is not None:
        result.metrics_delta = diff_metrics(before, after)
    result.metrics_note = note
    if warm.aborted or phase.aborted:
        result.generator["warnings"].append(f"warm-up {warm.aborted}" if warm.aborted else str(phase.aborted))
    elif stop.is_set():
        result.generator["warnings"].append("interrupted: the run stopped early")
    return result


def run_coroutine(coro: Coroutine[Any, Any, T], event_loop: str = "auto") -> T:
    """Run `coro` to completion on a new event loop: uvloop for "uvloop", and for "auto" when it is installed
    (its timers and I/O cost less per request, so an open loop keeps its schedule at higher rates)."""
    if event_loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                coro.close()
                raise ConfigError("event loop uvloop: the uvloop package is not installed") from None
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


def run(cfg: LoadConfig, progress: Progress | None = None) -> Result:
    """Run one load test to its bound and return its result (blocking; starts its own event loop)."""
    return run_coroutine(run_async(cfg, progress), cfg.event_loop)
