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

The server runs as a subprocess (`python -m service`, started and stopped by `benchmarks.server`), the load
generator in this process: the load tester's HTTP client (`benchmarks.loadtest.client`, aiohttp with
keep-alive connections), whose CPU per request competes with the server's where both share a few cores.
Results go to stdout and, with -o, JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.loadtest.client import Sample, execute, make_session
from benchmarks.loadtest.stats import percentile
from benchmarks.loadtest.workloads import JSON, RequestSpec
from benchmarks.server import running
from models.demo import DEMO_DIR

SECTIONS = ("overhead", "batching", "generation", "decode", "starvation")


Make = Callable[[int], RequestSpec]  # request i of a load


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": ms(percentile(values, 50)), "p90_ms": ms(percentile(values, 90)),
            "p99_ms": ms(percentile(values, 99)), "mean_ms": ms(statistics.fmean(values)) if values else float("nan"),
            "n": len(values)}


def served(*args: str) -> contextlib.AbstractContextManager[str]:
    """`python -m service ARGS` on a free port; its log goes to a file (a storm's warnings could fill a pipe)."""
    return running(*args, ready_timeout=180, output=tempfile.TemporaryFile("w+"))


def _ok(sample: Sample) -> Sample:
    if sample.outcome != "ok":
        raise RuntimeError(f"request failed: {sample.outcome} (status {sample.status}) {sample.error or ''}")
    return sample


async def closed_loop(url: str, concurrency: int, seconds: float, make: Make, warmup: float = 1.0) -> dict[str, Any]:
    """`concurrency` clients each sending the next request as soon as the last answered; counts the answers
    that arrived inside the measured window (after `warmup`)."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    done = 0
    async with make_session(concurrency, timeout_s=300) as session:
        start = time.perf_counter()
        begin, end = start + warmup, start + warmup + seconds

        async def client(i: int) -> None:
            nonlocal done
            n = 0
            while time.perf_counter() < end:
                sample = await execute(session, url, make(i * 1_000_003 + n), n)
                n += 1
                if begin <= sample.done <= end:  # throughput: every answer inside the window (also those sent before)
                    if sample.outcome == "ok":
                        done += 1
                        if sample.sent >= begin:  # latency: requests wholly inside the window
                            latencies.append(sample.service_time)
                    else:
                        key = str(sample.status or sample.outcome)
                        errors[key] = errors.get(key, 0) + 1

        await asyncio.gather(*(client(i) for i in range(concurrency)))
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
    from service.engine.backends.onnxruntime import OnnxRuntimeBackend
    from service.engine.vision import Preprocess, load_and_preprocess

    backend = OnnxRuntimeBackend(model_path)
    spec = Preprocess.from_metadata(backend.metadata["preprocess"])
    return np.stack([load_and_preprocess(b, spec, 10**8, 1) for b in blobs])


def direct(model_path: Path, rows: np.ndarray, batch: int, seconds: float) -> dict[str, Any]:
    """The same onnxruntime session the server builds (same options, providers), called in a loop."""
    from service.engine.backends.onnxruntime import OnnxRuntimeBackend

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
    from service.engine.backends.onnxruntime import OnnxRuntimeBackend
    from service.engine.vision import Preprocess, load_and_preprocess

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


def _raw_request(name: str, blobs: list[bytes], mime: str) -> Make:
    specs = [RequestSpec("POST", f"/v1/models/{name}/classify?top_k=1", b, {"Content-Type": mime}) for b in blobs]
    return lambda i: specs[i % len(specs)]


def _kserve_request(name: str, rows: np.ndarray, per_request: int) -> Make:
    x = np.ascontiguousarray(np.concatenate([rows] * (per_request // len(rows) + 1))[:per_request])
    head = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
    body = head + x.tobytes()
    headers = {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}

    spec = RequestSpec("POST", f"/v2/models/{name}/infer", body, headers)
    return lambda i: spec


def single_latency(url: str, make: Make, n: int) -> dict[str, Any]:
    """One request at a time, the server idle in between (2 ms pauses): client-side latency and the
    server's own Server-Timing split."""
    async def run() -> tuple[list[float], list[float]]:
        total, compute = [], []
        async with make_session(1, timeout_s=60) as session:
            for i in range(n + 20):
                sample = _ok(await execute(session, url, make(i), i))
                if i >= 20:
                    total.append(sample.service_time)
                    compute.append(sample.server_timing["compute"] / 1000)
                await asyncio.sleep(0.002)
        return total, compute

    total, compute = asyncio.run(run())
    # Paired per request: what HTTP, decoding, queueing and the rest add to that request's own model call.
    added = [t - c for t, c in zip(total, compute, strict=True)]
    return {"http": summary(total), "server_timing_compute": summary(compute), "added_over_own_compute": summary(added)}


def direct_latency(model_path: Path, blobs: list[bytes], n: int, preprocess: bool) -> dict[str, Any]:
    """The raw session call for one image (optionally with decode + preprocess), paced like single_latency."""
    from service.engine.backends.onnxruntime import OnnxRuntimeBackend
    from service.engine.vision import Preprocess, load_and_preprocess

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
    demo = DEMO_DIR
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
        with served("--model-dir", str(model_dir), "--models", name, "--max-batch-size", str(mbs)) as url:
            asyncio.run(closed_loop(url, conc, 1.0, _raw_request(name, blobs, mime), warmup=0.5))
            for _ in range(args.rounds):
                rounds["direct_batch16"].append(direct(path, rows, mbs, args.seconds)["images_per_s"])
                rounds["direct_batch16_with_decode"].append(
                    direct_with_preprocess(path, blobs, mbs, args.seconds)["images_per_s"])
                http = asyncio.run(closed_loop(url, conc, args.seconds, _raw_request(name, blobs, mime)))
                rounds["http_single_image"].append(http["requests_per_s"])
                res["http_single_image_last"] = http
                k = asyncio.run(closed_loop(url, k_conc, args.seconds, _kserve_request(name, rows, mbs)))
                rounds["http_kserve_batch16"].append(k["requests_per_s"] * mbs)
                res["http_kserve_batch16_last"] = k
            res["single_request"] = single_latency(url, _raw_request(name, blobs, mime), args.latency_requests)
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
    demo = DEMO_DIR
    blobs = digit_pngs()
    make = _raw_request("digits_multimax", blobs, "image/png")
    configs = {"batched": ("--max-batch-size", "16"), "batched_delay_2ms": ("--max-batch-size", "16",
                                                                            "--max-queue-delay-ms", "2"),
               "unbatched": ("--max-batch-size", "1")}
    out: dict[str, Any] = {"model": "digits_multimax", "concurrency": 16, "rounds": args.rounds}
    rates: dict[str, list[float]] = {k: [] for k in configs}
    with contextlib.ExitStack() as stack:
        urls = {k: stack.enter_context(served("--model-dir", str(demo), "--models", "digits_multimax", *v))
                for k, v in configs.items()}
        for _ in range(args.rounds):
            for label, url in urls.items():
                r = asyncio.run(closed_loop(url, 16, args.seconds, make))
                rates[label].append(r["requests_per_s"])
                out[f"{label}_last"] = r
    out["images_per_s_rounds"] = rates
    out["images_per_s"] = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    out["ratio"] = round(out["images_per_s"]["batched"] / out["images_per_s"]["unbatched"], 3)
    out["ratio_delay_2ms"] = round(out["images_per_s"]["batched_delay_2ms"] / out["images_per_s"]["unbatched"], 3)
    print(json.dumps({"batching": out["images_per_s"], "ratio": out["ratio"]}), flush=True)
    return out


# ---- generation --------------------------------------------------------------------------------------------


def _completion(model: str, prompt: str, max_tokens: int, stream: bool, **extra: Any) -> RequestSpec:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **extra}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return RequestSpec("POST", "/v1/completions", json.dumps(body).encode(), JSON, stream=stream,
                       max_tokens=max_tokens)


async def streams(url: str, concurrency: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    prompts = ["Return the", "If the file", "This module provides", "The default is"]
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    tokens = 0
    start = time.perf_counter()
    end = start + seconds

    async def client(session: Any, i: int) -> None:
        nonlocal tokens
        n = 0
        while time.perf_counter() < end:
            spec = _completion("text_multimax", prompts[(i + n) % len(prompts)], max_tokens, stream=True,
                               temperature=0.8, seed=i * 1000 + n)
            sample = _ok(await execute(session, url, spec, n))
            n += 1
            if sample.ttft is not None:
                ttft.append(sample.ttft)
            itl.extend(sample.itls or ())
            tokens += sample.output_tokens
            e2e.append(sample.service_time)

    async with make_session(concurrency, timeout_s=300) as session:
        await asyncio.gather(*(client(session, i) for i in range(concurrency)))
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": round(wall, 2),
            "requests": len(e2e), "ttft": summary(ttft), "itl": summary(itl), "e2e": summary(e2e)}


def bench_generation(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    demo = DEMO_DIR
    out: dict[str, Any] = {"model": "text_multimax", "max_tokens": args.max_tokens}
    with served("--model-dir", str(demo), "--models", "text_multimax", "--max-running-sequences", "16") as url:
        asyncio.run(streams(url, 2, 1.0, 8))  # warm-up
        for c in (1, 4, 16):
            out[f"c{c}"] = asyncio.run(streams(url, c, args.seconds, args.max_tokens))
            r = out[f"c{c}"]
            print(json.dumps({f"streams_{c}": {"tokens_per_s": round(r["tokens_per_s"], 1),
                                               "ttft_p50_ms": r["ttft"]["p50_ms"], "itl_p50_ms": r["itl"]["p50_ms"]}}),
                  flush=True)
    return out


# ---- starvation: an admitted stream during a storm of rejected requests --------------------------------------


STARVATION_MODEL = "text_long"


async def _stream_gaps(session: Any, url: str, max_tokens: int) -> tuple[list[float], int]:
    """The gaps between one greedy stream's token events, and how many tokens it generated."""
    sample = _ok(await execute(session, url, _completion(STARVATION_MODEL, "The", max_tokens, stream=True,
                                                        temperature=0), 0))
    return sample.itls or [], sample.output_tokens


async def _storm(session: Any, url: str, concurrency: int, until: asyncio.Future[Any]) -> dict[int, int]:
    """`concurrency` keep-alive clients sending completions as fast as answers come back, until `until` is done."""
    statuses: dict[int, int] = {}
    spec = _completion(STARVATION_MODEL, "storm", 8, stream=False)

    async def client() -> None:
        while not until.done():
            status = (await execute(session, url, spec, 0)).status
            statuses[status] = statuses.get(status, 0) + 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return statuses


async def _starvation_round(url: str, storm: int, max_tokens: int) -> dict[str, Any]:
    """One measured stream holds the only running slot and a second request the only waiting slot, so every
    request of the storm (if any) is refused with 429 while the measured stream decodes."""
    async with make_session(storm + 2, timeout_s=300) as session:
        measured = asyncio.ensure_future(_stream_gaps(session, url, max_tokens))
        await asyncio.sleep(0.3)
        filler = asyncio.ensure_future(execute(session, url, _completion(STARVATION_MODEL, "filler", 2, False), 0))
        await asyncio.sleep(0.1)
        storm_start = time.perf_counter()
        statuses = await _storm(session, url, storm, measured) if storm else {}
        storm_s = time.perf_counter() - storm_start
        gaps, tokens = await measured
        _ok(await filler)
    out = {"itl_mean_ms": ms(sum(gaps) / max(1, tokens - 1)), "event_gap_p90_ms": ms(percentile(gaps, 90)),
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
    with served("--model-dir", str(model_dir), "--max-running-sequences", "1", "--max-waiting-sequences", "1",
                "--intra-op-threads", "1") as url:
        asyncio.run(_starvation_round(url, 0, 8))  # warm-up
        for _ in range(args.rounds):
            idle = asyncio.run(_starvation_round(url, 0, args.max_tokens))
            storm = asyncio.run(_starvation_round(url, args.concurrency, args.max_tokens))
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
    from service.engine.backends.onnxruntime import OnnxRuntimeBackend
    from service.engine.backends.torch import TorchBackend

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
