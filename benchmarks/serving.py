"""`python -m benchmarks.serving`: the service's benchmarks, each measured side by side in one run.

  overhead    classification images/s through HTTP at saturation vs the same onnxruntime session called
              directly with the same batch policy (batches of max_batch_size); single-request p50 latency
              through HTTP vs the raw session call
  batching    images/s at concurrency 16 with dynamic batching (max batch 16) vs without (max batch 1)
  generation  tokens/s at 1, 4 and 16 concurrent streams; time to first token and inter-token latency
  decode      decode step time at 16 and at 256 tokens of context (KV cache), on a randomly initialised
              gpt-lm-6 with block_size 512 (the demo text model's context is only 128)
  starvation  inter-token latency of one admitted stream, idle vs during a storm of requests that all get
              429 (alternating rounds; the figure is the median of the per-round ratios)

The server runs as a subprocess (`python -m service`), the load generator in this process: a minimal
HTTP/1.1 keep-alive client on asyncio streams, because a full HTTP client library costs about as much CPU
per request as the server does and both share the same cores. Results go to stdout and, with -o, JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

SECTIONS = ("overhead", "batching", "generation", "decode", "starvation")


# ---- a minimal HTTP/1.1 client -----------------------------------------------------------------------------


class Conn:
    """One keep-alive connection; `request` returns (status, headers, body), `stream` yields chunks."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> Conn:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _send(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        assert self.writer is not None
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    async def _head(self) -> tuple[int, dict[str, str]]:
        assert self.reader is not None
        status = int((await self.reader.readline()).split()[1])
        headers: dict[str, str] = {}
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                return status, headers
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        self._send(method, path, body, headers or {})
        status, head = await self._head()
        assert self.reader is not None
        if "content-length" in head:
            return status, head, await self.reader.readexactly(int(head["content-length"]))
        chunks = [c async for c in self._chunks()]
        return status, head, b"".join(chunks)

    async def _chunks(self) -> Any:
        assert self.reader is not None
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            if size == 0:
                await self.reader.readline()
                return
            data = await self.reader.readexactly(size)
            await self.reader.readline()
            yield data

    async def sse(self, path: str, body: bytes) -> Any:
        """POST and yield (arrival time, parsed event) for each `data:` event of a chunked SSE response."""
        self._send("POST", path, body, {"Content-Type": "application/json"})
        status, _ = await self._head()
        if status != 200:
            raise RuntimeError(f"status {status}")
        buffer = b""
        async for chunk in self._chunks():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    yield time.perf_counter(), event[6:]


# ---- statistics --------------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": ms(pct(values, 50)), "p90_ms": ms(pct(values, 90)), "p99_ms": ms(pct(values, 99)),
            "mean_ms": ms(statistics.fmean(values)) if values else float("nan"), "n": len(values)}


# ---- server subprocess ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(*args: str) -> Iterator[int]:
    port = free_port()
    cmd = [sys.executable, "-m", "service", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
                    if b" 200 " in s.recv(100):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready")
            time.sleep(0.2)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def closed_loop(port: int, concurrency: int, seconds: float, make: Callable[[int], tuple[str, bytes, dict]],
                      warmup: float = 1.0) -> dict[str, Any]:
    """`concurrency` clients each sending the next request as soon as the last answered; counts the answers
    that arrived inside the measured window (after `warmup`)."""
    conns = [await Conn("127.0.0.1", port).open() for _ in range(concurrency)]
    start = time.perf_counter()
    begin, end = start + warmup, start + warmup + seconds
    latencies: list[float] = []
    errors: dict[int, int] = {}
    done = 0

    async def client(i: int, conn: Conn) -> None:
        nonlocal done
        n = 0
        while time.perf_counter() < end:
            path, body, headers = make(i * 1_000_003 + n)
            n += 1
            t0 = time.perf_counter()
            status, _, _ = await conn.request("POST", path, body, headers)
            t1 = time.perf_counter()
            if begin <= t1 <= end:  # throughput: every answer inside the window (also those sent before it)
                if status == 200:
                    done += 1
                    if t0 >= begin:  # latency: requests wholly inside the window
                        latencies.append(t1 - t0)
                else:
                    errors[status] = errors.get(status, 0) + 1

    await asyncio.gather(*(client(i, c) for i, c in enumerate(conns)))
    for c in conns:
        c.close()
    return {"requests_per_s": done / seconds, "latency": summary(latencies), "errors": errors}


# ---- classification --------------------------------------------------------------------------------------


def digit_pngs(n: int = 64) -> list[bytes]:
    from PIL import Image

    from models.training.vision import digits_split

    _, _, x, _ = digits_split(seed=0)
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray((x[i, 0].numpy() * 255).round().astype(np.uint8), "L").save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def photo_jpegs(n: int = 16, size: int = 256) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def build_deit_tiny(work: Path) -> Path:
    """A randomly initialised MultiMax DeiT-Tiny (224x224, 1000 classes) exported to ONNX (a realistic
    compute load per image, unlike the 32x32 demo)."""
    path = work / "deit_tiny_multimax.onnx"
    if path.exists():
        return path
    import torch

    from export.onnx_export import export_vision
    from models.checkpoint import IMAGENET_PREPROCESS, Checkpoint
    from models.deit import DeiT, DeiTConfig

    torch.manual_seed(0)
    config = DeiTConfig.from_preset("deit_tiny")
    model = DeiT(config).eval()
    ckpt = Checkpoint("deit", config.to_dict(), model.state_dict(), labels=[f"class_{i}" for i in range(1000)],
                      preprocess=IMAGENET_PREPROCESS)
    export_vision(model, ckpt, path)
    return path


def preprocess_all(model_path: Path, blobs: list[bytes]) -> np.ndarray:
    from service.backends.onnxruntime import OnnxRuntimeBackend
    from service.vision import Preprocess, load_and_preprocess

    backend = OnnxRuntimeBackend(model_path)
    spec = Preprocess.from_metadata(backend.metadata["preprocess"])
    return np.stack([load_and_preprocess(b, spec, 10**8, 1) for b in blobs])


def direct(model_path: Path, rows: np.ndarray, batch: int, seconds: float) -> dict[str, Any]:
    """The same onnxruntime session the server builds (same options, providers), called in a loop."""
    from service.backends.onnxruntime import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(model_path)
    x = np.concatenate([rows] * (batch // len(rows) + 1))[:batch]
    for _ in range(3):
        backend.run_vision(x)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        backend.run_vision(x)
        times.append(time.perf_counter() - t0)
    return {"images_per_s": batch * len(times) / sum(times), "call": summary(times), "batch": batch}


def direct_with_preprocess(model_path: Path, blobs: list[bytes], batch: int, seconds: float) -> dict[str, Any]:
    """Decode + preprocess (this process, one thread) then the session: what the server does minus HTTP."""
    from service.backends.onnxruntime import OnnxRuntimeBackend
    from service.vision import Preprocess, load_and_preprocess

    backend = OnnxRuntimeBackend(model_path)
    spec = Preprocess.from_metadata(backend.metadata["preprocess"])
    images, t0 = 0, time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < seconds:
        x = np.stack([load_and_preprocess(blobs[(i + j) % len(blobs)], spec, 10**8, 1) for j in range(batch)])
        backend.run_vision(x)
        images += batch
        i += batch
    return {"images_per_s": images / (time.perf_counter() - t0), "batch": batch}


def _raw_request(name: str, blobs: list[bytes], mime: str) -> Callable[[int], tuple[str, bytes, dict]]:
    def make(i: int) -> tuple[str, bytes, dict]:
        return f"/v1/models/{name}/classify?top_k=1", blobs[i % len(blobs)], {"Content-Type": mime}

    return make


def _kserve_request(name: str, rows: np.ndarray, per_request: int) -> Callable[[int], tuple[str, bytes, dict]]:
    x = np.ascontiguousarray(np.concatenate([rows] * (per_request // len(rows) + 1))[:per_request])
    head = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
    body = head + x.tobytes()
    headers = {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}

    def make(i: int) -> tuple[str, bytes, dict]:
        return f"/v2/models/{name}/infer", body, headers

    return make


def single_latency(port: int, make: Callable[[int], tuple[str, bytes, dict]], n: int) -> dict[str, Any]:
    """One request at a time, the server idle in between (2 ms pauses): client-side latency and the
    server's own Server-Timing split."""
    async def run() -> tuple[list[float], list[float]]:
        conn = await Conn("127.0.0.1", port).open()
        total, compute = [], []
        for i in range(n + 20):
            path, body, headers = make(i)
            t0 = time.perf_counter()
            status, head, _ = await conn.request("POST", path, body, headers)
            t1 = time.perf_counter()
            assert status == 200, status
            if i >= 20:
                total.append(t1 - t0)
                timing = dict(p.strip().split(";dur=") for p in head["server-timing"].split(","))
                compute.append(float(timing["compute"]) / 1000)
            await asyncio.sleep(0.002)
        conn.close()
        return total, compute

    total, compute = asyncio.run(run())
    # Paired per request: what HTTP, decoding, queueing and the rest add to that request's own model call.
    added = [t - c for t, c in zip(total, compute, strict=True)]
    return {"http": summary(total), "server_timing_compute": summary(compute), "added_over_own_compute": summary(added)}


def direct_latency(model_path: Path, blobs: list[bytes], n: int, preprocess: bool) -> dict[str, Any]:
    """The raw session call for one image (optionally with decode + preprocess), paced like single_latency."""
    from service.backends.onnxruntime import OnnxRuntimeBackend
    from service.vision import Preprocess, load_and_preprocess

    backend = OnnxRuntimeBackend(model_path)
    spec = Preprocess.from_metadata(backend.metadata["preprocess"])
    fixed = load_and_preprocess(blobs[0], spec, 10**8, 1)[None]
    times = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        x = load_and_preprocess(blobs[i % len(blobs)], spec, 10**8, 1)[None] if preprocess else fixed
        backend.run_vision(x)
        if i >= 20:
            times.append(time.perf_counter() - t0)
        time.sleep(0.002)
    return summary(times)


def bench_overhead(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Direct and HTTP measurements alternate in rounds against one running server, so that load from
    anything else on the machine hits both sides alike; each figure is the median over the rounds."""
    out: dict[str, Any] = {}
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    cases = [("digits_multimax", demo, digit_pngs(), "image/png")]
    if not args.quick:
        cases.append(("deit_tiny_multimax", build_deit_tiny(work).parent, photo_jpegs(), "image/jpeg"))
    mbs = 16
    for name, model_dir, blobs, mime in cases:
        path = model_dir / f"{name}.onnx"
        rows = preprocess_all(path, blobs)
        conc = args.concurrency
        k_conc = max(2, conc // mbs * 2)
        rounds: dict[str, list[float]] = {"direct_batch16": [], "direct_batch16_with_decode": [],
                                          "http_single_image": [], "http_kserve_batch16": []}
        res: dict[str, Any] = {"model": name, "max_batch_size": mbs, "rounds": args.rounds,
                               "seconds_per_point": args.seconds, "http_concurrency_single_image": conc,
                               "http_concurrency_kserve": k_conc}
        with server("--model-dir", str(model_dir), "--models", name, "--max-batch-size", str(mbs)) as port:
            asyncio.run(closed_loop(port, conc, 1.0, _raw_request(name, blobs, mime), warmup=0.5))
            for _ in range(args.rounds):
                rounds["direct_batch16"].append(direct(path, rows, mbs, args.seconds)["images_per_s"])
                rounds["direct_batch16_with_decode"].append(
                    direct_with_preprocess(path, blobs, mbs, args.seconds)["images_per_s"])
                http = asyncio.run(closed_loop(port, conc, args.seconds, _raw_request(name, blobs, mime)))
                rounds["http_single_image"].append(http["requests_per_s"])
                res["http_single_image_last"] = http
                k = asyncio.run(closed_loop(port, k_conc, args.seconds, _kserve_request(name, rows, mbs)))
                rounds["http_kserve_batch16"].append(k["requests_per_s"] * mbs)
                res["http_kserve_batch16_last"] = k
            res["single_request"] = single_latency(port, _raw_request(name, blobs, mime), args.latency_requests)
        res["direct_batch1_latency"] = direct_latency(path, blobs, args.latency_requests, preprocess=False)
        res["direct_batch1_with_decode_latency"] = direct_latency(path, blobs, args.latency_requests, preprocess=True)
        res["images_per_s_rounds"] = rounds
        res["images_per_s"] = {k: round(statistics.median(v), 1) for k, v in rounds.items()}
        base = res["images_per_s"]["direct_batch16"]
        res["ratio_single_image"] = round(res["images_per_s"]["http_single_image"] / base, 3)
        res["ratio_kserve_batch16"] = round(res["images_per_s"]["http_kserve_batch16"] / base, 3)
        res["ratio_single_image_vs_direct_with_decode"] = round(
            res["images_per_s"]["http_single_image"] / res["images_per_s"]["direct_batch16_with_decode"], 3)
        http_p50 = res["single_request"]["http"]["p50_ms"]
        res["added_p50_ms_over_compute"] = round(http_p50 - res["direct_batch1_latency"]["p50_ms"], 3)
        res["added_p50_ms_paired"] = res["single_request"]["added_over_own_compute"]["p50_ms"]
        res["added_p50_ms_over_decode_and_compute"] = round(
            http_p50 - res["direct_batch1_with_decode_latency"]["p50_ms"], 3)
        out[name] = res
        print(json.dumps({name: {k: res[k] for k in ("images_per_s", "ratio_single_image", "ratio_kserve_batch16",
                                                     "added_p50_ms_over_compute", "added_p50_ms_paired",
                                                     "added_p50_ms_over_decode_and_compute")}}), flush=True)
    return out


def bench_batching(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Concurrency 16, single images: dynamic batching (max batch 16; also with a 2 ms queue delay) against
    none (max batch 1). The servers run side by side and the measurements alternate in rounds."""
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    blobs = digit_pngs()
    make = _raw_request("digits_multimax", blobs, "image/png")
    configs = {"batched": ("--max-batch-size", "16"), "batched_delay_2ms": ("--max-batch-size", "16",
                                                                            "--max-queue-delay-ms", "2"),
               "unbatched": ("--max-batch-size", "1")}
    out: dict[str, Any] = {"model": "digits_multimax", "concurrency": 16, "rounds": args.rounds}
    rates: dict[str, list[float]] = {k: [] for k in configs}
    with contextlib.ExitStack() as stack:
        ports = {k: stack.enter_context(server("--model-dir", str(demo), "--models", "digits_multimax", *v))
                 for k, v in configs.items()}
        for _ in range(args.rounds):
            for label, port in ports.items():
                r = asyncio.run(closed_loop(port, 16, args.seconds, make))
                rates[label].append(r["requests_per_s"])
                out[f"{label}_last"] = r
    out["images_per_s_rounds"] = rates
    out["images_per_s"] = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    out["ratio"] = round(out["images_per_s"]["batched"] / out["images_per_s"]["unbatched"], 3)
    out["ratio_delay_2ms"] = round(out["images_per_s"]["batched_delay_2ms"] / out["images_per_s"]["unbatched"], 3)
    print(json.dumps({"batching": out["images_per_s"], "ratio": out["ratio"]}), flush=True)
    return out


# ---- generation --------------------------------------------------------------------------------------------


async def streams(port: int, concurrency: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    prompts = ["Return the", "If the file", "This module provides", "The default is"]
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    tokens = 0
    start = time.perf_counter()
    end = start + seconds

    async def client(i: int) -> None:
        nonlocal tokens
        conn = await Conn("127.0.0.1", port).open()
        n = 0
        while time.perf_counter() < end:
            body = json.dumps({"model": "text_multimax", "prompt": prompts[(i + n) % len(prompts)],
                               "max_tokens": max_tokens, "temperature": 0.8, "seed": i * 1000 + n,
                               "stream": True, "stream_options": {"include_usage": True}}).encode()
            n += 1
            t0 = time.perf_counter()
            last = None
            async for t, data in conn.sse("/v1/completions", body):
                if data == b"[DONE]":
                    continue  # read on to the end of the chunked body: the connection is reused
                event = json.loads(data)
                if event["choices"] and event["choices"][0]["text"]:
                    if last is None:
                        ttft.append(t - t0)
                    else:
                        itl.append(t - last)
                    last = t
                if event.get("usage"):
                    tokens += event["usage"]["completion_tokens"]
            e2e.append(time.perf_counter() - t0)
        conn.close()

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": round(wall, 2),
            "requests": len(e2e), "ttft": summary(ttft), "itl": summary(itl), "e2e": summary(e2e)}


def bench_generation(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    out: dict[str, Any] = {"model": "text_multimax", "max_tokens": args.max_tokens}
    with server("--model-dir", str(demo), "--models", "text_multimax", "--max-running-sequences", "16") as port:
        asyncio.run(streams(port, 2, 1.0, 8))  # warm-up
        for c in (1, 4, 16):
            out[f"c{c}"] = asyncio.run(streams(port, c, args.seconds, args.max_tokens))
            r = out[f"c{c}"]
            print(json.dumps({f"streams_{c}": {"tokens_per_s": round(r["tokens_per_s"], 1),
                                               "ttft_p50_ms": r["ttft"]["p50_ms"], "itl_p50_ms": r["itl"]["p50_ms"]}}),
                  flush=True)
    return out


# ---- starvation: an admitted stream during a storm of rejected requests --------------------------------------


STARVATION_MODEL = "text_long"


async def _stream_times(port: int, max_tokens: int) -> tuple[list[float], int]:
    """Arrival times of one greedy stream's SSE events, and how many tokens it generated."""
    conn = await Conn("127.0.0.1", port).open()
    body = json.dumps({"model": STARVATION_MODEL, "prompt": "The", "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    times, tokens = [], 0
    async for t, data in conn.sse("/v1/completions", body):
        if data == b"[DONE]":
            continue
        event = json.loads(data)
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if event["choices"] and event["choices"][0]["text"]:
            times.append(t)
    conn.close()
    return times, tokens


async def _storm(port: int, concurrency: int, until: asyncio.Future[Any]) -> dict[int, int]:
    """`concurrency` keep-alive clients sending completions as fast as answers come back, until `until` is done."""
    statuses: dict[int, int] = {}
    body = json.dumps({"model": STARVATION_MODEL, "prompt": "storm", "max_tokens": 8}).encode()

    async def client() -> None:
        conn = await Conn("127.0.0.1", port).open()
        while not until.done():
            status, _, _ = await conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            statuses[status] = statuses.get(status, 0) + 1
        conn.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return statuses


async def _starvation_round(port: int, storm: int, max_tokens: int) -> dict[str, Any]:
    """One measured stream holds the only running slot and a second request the only waiting slot, so every
    request of the storm (if any) is refused with 429 while the measured stream decodes."""
    measured = asyncio.ensure_future(_stream_times(port, max_tokens))
    await asyncio.sleep(0.3)
    conn = await Conn("127.0.0.1", port).open()
    filler_body = json.dumps({"model": STARVATION_MODEL, "prompt": "filler", "max_tokens": 2}).encode()
    filler = asyncio.ensure_future(conn.request("POST", "/v1/completions", filler_body,
                                                {"Content-Type": "application/json"}))
    await asyncio.sleep(0.1)
    storm_start = time.perf_counter()
    statuses = await _storm(port, storm, measured) if storm else {}
    storm_s = time.perf_counter() - storm_start
    times, tokens = await measured
    await filler
    conn.close()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    out = {"itl_mean_ms": ms((times[-1] - times[0]) / max(1, tokens - 1)), "event_gap_p90_ms": ms(pct(gaps, 90)),
           "tokens": tokens}
    if storm:
        out |= {"storm_statuses": statuses, "rejections_per_s": round(statuses.get(429, 0) / storm_s, 1)}
    return out


def bench_starvation(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Rounds alternate idle and storm; the ratio is taken per round and the median reported."""
    pt, onnx_path = build_long_gpt(work, export_onnx=True)
    model_file = onnx_path or pt  # the default backend (onnxruntime) where the export works
    model_dir = work / "starvation"
    model_dir.mkdir(exist_ok=True)
    for old in model_dir.iterdir():
        old.unlink()
    (model_dir / f"{STARVATION_MODEL}{model_file.suffix}").symlink_to(model_file.resolve())
    rounds = []
    with server("--model-dir", str(model_dir), "--max-running-sequences", "1", "--max-waiting-sequences", "1",
                "--intra-op-threads", "1") as port:
        asyncio.run(_stream_times(port, 8))  # warm-up
        for _ in range(args.rounds):
            idle = asyncio.run(_starvation_round(port, 0, args.max_tokens))
            storm = asyncio.run(_starvation_round(port, args.concurrency, args.max_tokens))
            row = {"idle": idle, "storm": storm, "ratio_mean": storm["itl_mean_ms"] / idle["itl_mean_ms"],
                   "ratio_p90": storm["event_gap_p90_ms"] / idle["event_gap_p90_ms"]}
            rounds.append(row)
            print(json.dumps({"starvation_round": row}), flush=True)
    backend = "onnxruntime" if model_file.suffix == ".onnx" else "PyTorch eager"
    out = {"model": f"gpt-lm-6 (random weights, block_size 512), {backend}, one intra-op thread", "rounds": rounds,
           "storm_clients": args.concurrency, "max_tokens": args.max_tokens,
           "itl_ratio_mean": statistics.median(r["ratio_mean"] for r in rounds),
           "itl_ratio_p90": statistics.median(r["ratio_p90"] for r in rounds)}
    print(json.dumps({"starvation": {k: round(out[k], 2) for k in ("itl_ratio_mean", "itl_ratio_p90")}}), flush=True)
    return out


# ---- decode step time vs context ----------------------------------------------------------------------------


def build_long_gpt(work: Path, export_onnx: bool) -> tuple[Path, Path | None]:
    import torch

    from models.checkpoint import Checkpoint, save_checkpoint
    from models.gpt import GPT, GPTConfig, set_paper_params
    from models.tokenizer import ByteTokenizer

    pt = work / "gpt_lm6_512.pt"
    onnx_path = work / "gpt_lm6_512.onnx"
    torch.manual_seed(0)
    config = GPTConfig.from_preset("gpt-lm-6", block_size=512)
    model = GPT(config).eval()
    set_paper_params(model)
    ckpt = Checkpoint("gpt", config.to_dict(), model.state_dict(), tokenizer=ByteTokenizer().to_dict())
    if not pt.exists():
        save_checkpoint(ckpt, pt)
    if export_onnx and not onnx_path.exists():
        try:
            from export.onnx_export import export_text
        except ImportError:
            return pt, None
        export_text(model, ckpt, onnx_path)
    return pt, (onnx_path if onnx_path.exists() else None)


def step_times(backend: Any, context: int, batch: int, steps: int) -> list[float]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (batch, context), dtype=np.int64)
    mask = np.ones((batch, context), np.int64)
    positions = np.broadcast_to(np.arange(context), (batch, context)).copy()
    _, past = backend.run_text(ids, mask, positions, backend.empty_past(batch))
    new = rng.integers(0, 256, (batch, 1), dtype=np.int64)
    mask1 = np.ones((batch, context + 1), np.int64)
    pos1 = np.full((batch, 1), context, np.int64)
    times = []
    for i in range(steps + 5):  # every step from the same `context`-long cache: the context stays fixed
        t0 = time.perf_counter()
        backend.run_text(new, mask1, pos1, past)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return times


def bench_decode(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from service.backends.onnxruntime import OnnxRuntimeBackend
    from service.backends.torch import TorchBackend

    pt, onnx_path = build_long_gpt(work, export_onnx=True)
    backends: dict[str, Any] = {"torch": TorchBackend(pt, device="cpu")}
    if onnx_path is not None:
        backends["onnxruntime"] = OnnxRuntimeBackend(onnx_path)
    out: dict[str, Any] = {"model": "random gpt-lm-6 (6 layers, 512 wide, 8 heads), block_size 512, paper MultiMax "
                                    "params"}
    for name, backend in backends.items():
        for batch in (1, 8):
            res = {ctx: summary(step_times(backend, ctx, batch, args.decode_steps)) for ctx in (16, 256)}
            res["ratio_p50"] = res[256]["p50_ms"] / res[16]["p50_ms"]
            out[f"{name}_batch{batch}"] = {f"context_{k}" if isinstance(k, int) else k: v for k, v in res.items()}
            print(json.dumps({f"decode_{name}_batch{batch}": {"ctx16_p50_ms": res[16]["p50_ms"],
                                                              "ctx256_p50_ms": res[256]["p50_ms"],
                                                              "ratio": round(res["ratio_p50"], 3)}}), flush=True)
    return out


# ---- main --------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import onnxruntime
    import torch

    return {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
            "load_average_at_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per load point")
    p.add_argument("--rounds", type=int, default=3, help="alternating direct/HTTP rounds for the overhead points")
    p.add_argument("--concurrency", type=int, default=32, help="clients for the saturation points")
    p.add_argument("--latency-requests", type=int, default=300, help="sequential requests for single-request p50")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens per generation request")
    p.add_argument("--decode-steps", type=int, default=50, help="timed decode steps per context length")
    p.add_argument("--quick", action="store_true", help="skip the DeiT-Tiny model (its export takes minutes)")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "multimax-serve-bench",
                   help="where generated benchmark models are kept between runs")
    p.add_argument("-o", "--output", type=Path, help="write all results as JSON here")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": environment(), "command": " ".join(["python -m benchmarks.serving",
                                                                                 *(argv or sys.argv[1:])])}
    runners = {"overhead": bench_overhead, "batching": bench_batching, "generation": bench_generation,
               "decode": bench_decode, "starvation": bench_starvation}
    for section in sections:
        t0 = time.perf_counter()
        results[section] = runners[section](args, args.work_dir)
        results[section]["section_seconds"] = round(time.perf_counter() - t0, 1)
    results["environment"]["load_average_at_end"] = os.getloadavg()
    text = json.dumps(results, indent=2, default=str)
    if args.output:
        args.output.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
