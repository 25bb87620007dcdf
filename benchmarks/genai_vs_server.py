"""Decode speed of one onnxruntime-genai folder four ways, side by side, same threads, interleaved rounds:

    genai   onnxruntime-genai's own loop on the folder: `og.Generator` for one stream, one batched `og.Generator`
            (equal-length prompts) for 4 and 16; `og.Engine` is checked for correct text with prompts of different
            lengths and used instead where it gives the Generator's text
    server  `python -m service --model-dir` on 127.0.0.1 serving the folder, N concurrent streamed /v1/completions
            (token-id prompts, greedy, ignore_eos, fixed max_tokens)
    direct  the server's backend (service.engine.model_folders.GenaiTextBackend over the same model.onnx) in a bare
            batched greedy loop: what the server's decode costs without HTTP, scheduler or sampler
    engine  the server's decode loop (service.engine.text.scheduler.TextScheduler: continuous batching, the sampler, the
            hand-off of each step's tokens to an event loop) over that backend in this process, without HTTP:
            server/engine is what the HTTP side costs, engine/direct what the scheduler costs

    base    with --base-tree TREE: the same server run from another source tree (e.g. main before a change), so a
            change's effect is measured side by side with the ratio server/base

Two workloads (--workload):
    equal   N streams, one request each, all sent at once, every one max_tokens long: a static batch's best case
            (the batched Generator has no row that finishes early)
    varied  N streams each sending requests back to back (a load tester's "concurrency N"), 4N requests in all,
            each asking for its own number of tokens (uniform in [max_tokens/4, max_tokens], seeded; prompts stay
            prompt-len long, since og.Generator batches only equal-length prompts). genai and direct serve them in
            static batches of N in arrival order, each running until its longest request is done (what a batched
            Generator can do); the server and the engine admit a request as soon as a stream sends it

    python -m benchmarks.genai_vs_server DIR [--threads 2] [--streams 1,4,16] [--rounds 3] [--max-tokens 64]
                                         [--workload equal|varied] [--base-tree TREE]

Each figure is output tokens/s over all streams (the tokens the requests asked for / wall time from the first send
to the last token), with time to first token (from each request's send) and inter-token latency (gaps between a
request's tokens; the server's are between its SSE events, one per decode step) p50/p99 beside it. The ratios are
medians of per-round ratios, so a slow moment of a shared machine hits both sides of one ratio alike. Exit status 2
with one line for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.server import free_port


@dataclass
class Run:
    """One measurement: N streams' token times."""

    streams: int
    tokens: int
    wall: float
    ttft: list[float] = field(default_factory=list)  # seconds, one per stream
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive tokens of a stream

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall


Request = tuple[list[int], int]  # a prompt's token ids and the tokens asked for
# A pause before each timed call: what the call before left running took 20-100 ms to stop (onnxruntime-genai's
# pool threads spin on after its loop; llama-server's threads poll) and slowed whatever came next. Measured: the
# server's time to first token right after a genai run 71 ms (median of 6), after a pause of 0.1 s 45 ms, 0.5 s
# 47 ms; 20 ms was not enough (63 ms).
SETTLE_S = 0.25
REQUESTS_PER_STREAM = 4  # the varied workload's requests per stream


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """n token-id prompts of `length` tokens (ids 32..126 when the vocabulary has them: text of the byte demos)."""
    rng = np.random.default_rng(seed)
    low, high = (32, 127) if vocab > 127 else (0, vocab)
    return [rng.integers(low, high, length).tolist() for _ in range(n)]


def shortest(max_tokens: int) -> int:
    """The fewest tokens a request of the varied workload asks for."""
    return max(max_tokens // 4, 2)


def workload(kind: str, vocab: int, streams: int, prompt_len: int, max_tokens: int, seed: int) -> list[Request]:
    """The requests of one round (module docstring): `equal`, one a stream of max_tokens each; `varied`,
    REQUESTS_PER_STREAM a stream, each asking for a seeded number of tokens in [max_tokens / 4, max_tokens]."""
    if kind == "equal":
        return [(p, max_tokens) for p in prompts(vocab, streams, prompt_len, seed)]
    count = REQUESTS_PER_STREAM * streams
    asked = np.random.default_rng(seed + 1).integers(shortest(max_tokens), max_tokens + 1, count).tolist()
    return list(zip(prompts(vocab, count, prompt_len, seed), asked, strict=True))


def static_batches(fn: Callable[[list[list[int]], list[int]], tuple[Run, list[list[int]]]],
                   requests: list[Request], streams: int) -> tuple[Run, list[list[int]]]:
    """`requests` served `streams` at a time in arrival order by a static batcher `fn(prompts, asked)`, each
    batch started when the one before has ended; each request's time to first token counts from its batch's
    start (when its stream sent it)."""
    start = time.perf_counter()
    run = Run(streams, 0, 0.0)
    out: list[list[int]] = []
    for i in range(0, len(requests), streams):
        chunk = requests[i:i + streams]
        part, tokens = fn([p for p, _ in chunk], [m for _, m in chunk])
        run.tokens += part.tokens
        run.ttft += part.ttft
        run.gaps += part.gaps
        out += tokens
    run.wall = time.perf_counter() - start
    return run, out


def _per_row(asked: list[int] | int, rows: int) -> list[int]:
    """Tokens asked for by each row of a batch: a list as it is, one number for every row."""
    return [asked] * rows if isinstance(asked, int) else asked


def _rows_run(start: float, times: list[float], asked: list[int]) -> Run:
    """The Run of a batch whose rows all got a token at each of `times`, row i keeping its first asked[i]."""
    return Run(len(asked), sum(asked), max(times[m - 1] for m in asked) - start, [times[0] - start] * len(asked),
               [b - a for m in asked for a, b in itertools.pairwise(times[:m])])


# ---- onnxruntime-genai ----------------------------------------------------------------------------------------


def genai_model(folder: Path, threads: int) -> Any:
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    return og.Model(config)


def genai_generator(model: Any, batch: list[list[int]], asked: list[int] | int) -> tuple[Run, list[list[int]]]:
    """One `og.Generator` over the batch (equal-length prompts: it has no per-row prompt lengths), greedy, until
    the row that asked for most tokens has them (`asked`: per row, or one number for all); each row keeps (and
    counts) the tokens it asked for."""
    import onnxruntime_genai as og

    asked = _per_row(asked, len(batch))
    length, steps = len(batch[0]), max(asked)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, batch_size=len(batch), max_length=length + steps,
                              min_length=length + steps)
    start = time.perf_counter()
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(batch, dtype=np.int32))
    times: list[float] = []
    while not gen.is_done():
        gen.generate_next_token()
        times.append(time.perf_counter())
    out = [list(gen.get_sequence(i))[length:length + m] for i, m in enumerate(asked)]
    return _rows_run(start, times, asked), out


def genai_engine(model: Any, batch: list[list[int]], asked: list[int] | int) -> tuple[Run, list[list[int]]]:
    """`og.Engine` (onnxruntime-genai's continuous batching) with one request per prompt, greedy."""
    import onnxruntime_genai as og

    asked = _per_row(asked, len(batch))
    engine = og.Engine(model)
    start = time.perf_counter()
    requests = []
    for p, m in zip(batch, asked, strict=True):
        req = engine.create_request()
        opts = og.TurnOptions(req)
        opts.set_do_sample(False)
        opts.set_max_generated_tokens(m)
        opts.set_min_generated_tokens(m)
        req.begin_turn(np.asarray(p, dtype=np.int32), opts)
        requests.append(req)
    index = {id(r): i for i, r in enumerate(requests)}
    tokens: list[list[int]] = [[] for _ in batch]
    stamps: list[list[float]] = [[] for _ in batch]
    buffer = engine.create_event_buffer(4 * len(batch) + 16)
    while engine.has_pending_requests():
        events = engine.run(buffer) or []
        now = time.perf_counter()
        for ev in events:
            i = _request_index(ev.request, requests, index)
            if i is not None and ev.token is not None and ev.token >= 0:
                tokens[i].append(int(ev.token))
                stamps[i].append(now)
    wall = max(s[-1] for s in stamps if s) - start
    run = Run(len(batch), sum(len(t) for t in tokens), wall, [s[0] - start for s in stamps if s],
              [b - a for s in stamps for a, b in itertools.pairwise(s)])
    for r in requests:
        r.close()
    return run, tokens


def _request_index(request: Any, requests: list[Any], index: dict[int, int]) -> int | None:
    if id(request) in index:
        return index[id(request)]
    for i, r in enumerate(requests):  # the binding may hand back a new wrapper of the same request
        if r == request:
            return i
    return None


def engine_is_correct(model: Any, vocab: int, max_tokens: int) -> tuple[bool, str]:
    """Does og.Engine give each prompt the Generator's own greedy text when prompts of different lengths share
    its batch?"""
    batch = [p[:n] for p, n in zip(prompts(vocab, 4, 40, 7), (40, 9, 23, 3), strict=True)]
    try:
        _, together = genai_engine(model, batch, max_tokens)
    except Exception as exc:  # an engine that fails is as unusable as one that is wrong
        return False, f"og.Engine failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    alone = [genai_generator(model, [p], max_tokens)[1][0] for p in batch]
    wrong = [i for i, (a, b) in enumerate(zip(alone, together, strict=True)) if a != b]
    if wrong:
        return False, (f"og.Engine's greedy tokens differ from og.Generator's for prompts of lengths "
                       f"{[len(batch[i]) for i in wrong]} batched with lengths {[len(p) for p in batch]}")
    return True, "og.Engine gives og.Generator's greedy tokens for prompts of lengths 40, 9, 23, 3 together"


# ---- the server's backend in a bare loop -----------------------------------------------------------------------


def folder_parser(prog: str, doc: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments the decode-loop benchmarks over one genai folder share: the folder, --rounds, --threads."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    ap.add_argument("folder", type=Path, help="an onnxruntime-genai folder")
    ap.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    return ap


def is_genai_folder(folder: Path) -> bool:
    return (folder / "genai_config.json").is_file()


def is_source_tree(tree: Path) -> bool:
    """A tree `python -m service` can run from (server(tree=...))."""
    return (tree / "service" / "__main__.py").is_file()


def model_limits(folder: Path) -> tuple[int, int]:
    """(vocabulary size, context length) of an onnxruntime-genai folder."""
    cfg = json.loads((folder / "genai_config.json").read_text())["model"]
    return int(cfg["vocab_size"]), int(cfg["context_length"])


def not_a_genai_folder(folder: Path) -> bool:
    """True, having said so on stderr, where `folder` has no genai_config.json."""
    if is_genai_folder(folder):
        return False
    print(f"error: {folder} is not an onnxruntime-genai folder (no genai_config.json)", file=sys.stderr)
    return True


def load_entry(folder: Path, threads: int) -> Any:
    """The folder as the server loads it (service.engine.model_folders.load_genai_folder)."""
    from service.base.config import Settings
    from service.engine.model_folders import load_genai_folder

    return load_genai_folder(folder.name, folder, Settings(intra_op_threads=threads))


def direct_backend(folder: Path, threads: int) -> Any:
    return load_entry(folder, threads).backend


def direct_loop(backend: Any, batch: list[list[int]], asked: list[int] | int) -> tuple[Run, list[list[int]]]:
    """Prefill the batch in one call, then one batched decode call a token, greedy (argmax), until the row that
    asked for most tokens has them; each row keeps (and counts) the tokens it asked for."""
    asked = _per_row(asked, len(batch))
    ids = np.asarray(batch, dtype=np.int64)
    b, length = ids.shape
    steps = max(asked)
    start = time.perf_counter()
    mask = np.ones((b, length), dtype=np.int64)
    positions = np.broadcast_to(np.arange(length, dtype=np.int64), (b, length))
    logits, past = backend.run_text(ids, mask, positions, backend.empty_past(b))
    backend.reserve(length + steps)  # as the server's decode loop tells it (and onnxruntime-genai's max_length)
    out: list[list[int]] = [[] for _ in range(b)]
    times = []
    for step in range(steps):
        nxt = backend.to_numpy(logits)[:, -1].argmax(axis=-1)
        for i, t in enumerate(nxt.tolist()):
            out[i].append(int(t))
        times.append(time.perf_counter())
        if step == steps - 1:
            break
        mask = np.ones((b, length + step + 1), dtype=np.int64)
        pos = np.full((b, 1), length + step, dtype=np.int64)
        logits, past = backend.run_text(nxt.astype(np.int64)[:, None], mask, pos, past)
    return _rows_run(start, times, asked), [o[:m] for o, m in zip(out, asked, strict=True)]


# ---- the server's decode loop without HTTP ---------------------------------------------------------------------


def engine_loop(entry: Any, backend: Any, requests: list[Request], streams: int,
                threads: int = 0) -> tuple[Run, list[list[int]]]:
    """`streams` clients each submitting its next request to a TextScheduler (the server's, with the server's
    default limits and the hand-off interval its `--stream-interval-ms auto` picks for `threads` intra-op threads)
    over `backend` when its last one has finished, greedy with ignore_eos as the server's requests; a token's time
    is when the event loop sees it."""
    from concurrent.futures import ThreadPoolExecutor

    from models.tokenizer import tokenizer_from_dict
    from service.__main__ import SWITCH_INTERVAL_S
    from service.base.config import Settings
    from service.base.metrics import Metrics
    from service.engine.text.delivery import stream_interval_s
    from service.engine.text.sampler import SamplingParams
    from service.engine.text.scheduler import GenSequence, TextScheduler

    tokenizer = entry.tokenizer or tokenizer_from_dict(entry.tokenizer_entry or {})

    async def main() -> tuple[Run, list[list[int]]]:
        with ThreadPoolExecutor(1) as executor:
            scheduler = TextScheduler(entry.name, backend, tokenizer, entry.context_length, executor, Metrics(),
                                      max_running=64, max_waiting=256,
                                      handoff_interval_s=stream_interval_s(Settings(intra_op_threads=threads)))
            scheduler.start()
            seqs = [GenSequence(list(p), SamplingParams(m, temperature=0.0, ignore_eos=True)) for p, m in requests]
            stamps: list[list[float]] = [[] for _ in seqs]
            sent = [0.0] * len(seqs)
            queue = iter(range(len(seqs)))

            async def client() -> None:
                for i in queue:  # the stream's next request once its last one has finished
                    seq = seqs[i]
                    sent[i] = time.perf_counter()
                    scheduler.submit([seq])
                    while True:
                        now = time.perf_counter()
                        stamps[i].extend([now] * (seq.generated - len(stamps[i])))
                        if seq.done:
                            break
                        seq.changed.clear()
                        await seq.changed.wait()

            start = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(streams)))
            wall = time.perf_counter() - start
            await scheduler.close()
        if any(s.error is not None for s in seqs):
            raise SystemExit(f"error: the engine failed a sequence: {next(s.error for s in seqs if s.error)}")
        run = Run(streams, sum(s.generated for s in seqs), wall, [t[0] - s for t, s in zip(stamps, sent, strict=True)],
                  [b - a for t in stamps for a, b in itertools.pairwise(t)])
        return run, [list(s.tokens) for s in seqs]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as `python -m service` runs its threads
    try:
        return asyncio.run(main())
    finally:
        sys.setswitchinterval(interval)


# ---- the server ------------------------------------------------------------------------------------------------


@contextmanager
def server(folder: Path, threads: int, extra: list[str], tree: Path | None = None) -> Iterator[str]:
    """`python -m service --model-dir` over a directory holding only (a link to) the folder; run from `tree`'s
    code where given (its working directory and PYTHONPATH), else this tree's."""
    work = Path(tempfile.mkdtemp(prefix="genai-vs-server-"))
    repo = work / "models"
    repo.mkdir()
    (repo / folder.name).symlink_to(folder.resolve(), target_is_directory=True)
    port = free_port()
    cmd = [sys.executable, "-m", "service", "--model-dir", str(repo), "--host", "127.0.0.1", "--port", str(port),
           "--intra-op-threads", str(threads), "--inter-op-threads", "1", "--max-running-sequences", "64", *extra]
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    # its log goes to a file, read only if it fails: a pipe nobody reads blocks the server once 64 KiB are written
    log = work / "server.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sink,
                                cwd=None if tree is None else str(tree), env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc, folder.name, log)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def _wait_ready(base: str, proc: subprocess.Popen[bytes], name: str, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = log.read_text(encoding="utf-8", errors="replace").strip()
            raise SystemExit(f"error: the server exited ({proc.returncode}): {said[-500:]}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models/{name}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("error: the server did not become ready in 600 s")


async def _stream(session: Any, url: str, name: str, prompt: list[int], max_tokens: int,
                  sink: list[tuple[float, list[float], int]]) -> None:
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    stamps: list[float] = []
    tokens = 0
    start = time.perf_counter()
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise SystemExit(f"error: the server answered {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                stamps.append(time.perf_counter())
            if event.get("usage"):  # an event of its own here; llama-server puts it on the last choice's event
                tokens = int(event["usage"]["completion_tokens"])
    if not stamps:  # no token decoded to text (special ids of a random model): the end stands for the first token
        stamps.append(time.perf_counter())
    sink.append((stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)], tokens))


def server_run(base: str, name: str, requests: list[Request], streams: int) -> Run:
    """`streams` clients each sending its next request (streamed /v1/completions) when its last one has ended."""
    import aiohttp

    async def main() -> Run:
        sink: list[tuple[float, list[float], int]] = []
        queue = iter(requests)
        # one connection per stream, as the streams of a load tester (aiohttp's default pool holds 100)
        connector = aiohttp.TCPConnector(limit=max(streams, 100))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=connector) as session:

            async def client() -> None:
                for p, m in queue:
                    await _stream(session, f"{base}/v1/completions", name, p, m, sink)

            start = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(streams)))
            wall = time.perf_counter() - start
        return Run(streams, sum(s[2] for s in sink), wall, [s[0] for s in sink], [g for s in sink for g in s[1]])

    return asyncio.run(main())


# ---- report ----------------------------------------------------------------------------------------------------


def settled(call: Callable[[], Run]) -> Run:
    """`call()` once the cores are quiet again (SETTLE_S): each contender starts as the first would."""
    time.sleep(SETTLE_S)
    return call()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def summary(runs: list[Run]) -> dict[str, float]:
    ttft = [t for r in runs for t in r.ttft]
    gaps = [g for r in runs for g in r.gaps]
    return {"tok_s": statistics.median(r.tok_s for r in runs), "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99)}


def _first(fn: Callable[..., tuple[Run, list[list[int]]]], *args: Any) -> Run:
    return fn(*args)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.genai_vs_server", description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="an onnxruntime-genai folder (genai_config.json, model.onnx, ...)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of every session (default 2)")
    ap.add_argument("--streams", default="1,4,16", help="concurrent streams, comma-separated (default 1,4,16)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="generated tokens a request (varied: the most a request asks for; default 64)")
    ap.add_argument("--workload", choices=("equal", "varied"), default="equal",
                    help="equal: one request a stream, all max-tokens long; varied: requests back to back, of "
                         "different lengths (module docstring; default equal)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `python -m service` option")
    ap.add_argument("--base-tree", type=Path, help="also serve the folder from this source tree's code (way 'base')")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    try:
        counts = [int(s) for s in args.streams.split(",")]
    except ValueError:
        ap.error(f"--streams: not a comma-separated list of integers: {args.streams!r}")
    if not_a_genai_folder(args.folder):
        return 2
    if args.base_tree is not None and not is_source_tree(args.base_tree):
        print(f"error: --base-tree {args.base_tree} is not a source tree of this project (no service/__main__.py)",
              file=sys.stderr)
        return 2
    if min(counts) < 1 or args.rounds < 1 or args.threads < 1 or args.prompt_len < 1 or args.max_tokens < 2:
        ap.error("--streams, --rounds, --threads, --prompt-len must be >= 1 and --max-tokens >= 2")
    folder = args.folder.resolve()
    vocab, context = model_limits(folder)
    if args.prompt_len + args.max_tokens > context:
        print(f"error: --prompt-len + --max-tokens = {args.prompt_len + args.max_tokens} is over the model's "
              f"context of {context}", file=sys.stderr)
        return 2

    model = genai_model(folder, args.threads)
    ok, why = engine_is_correct(model, vocab, 16)
    print(f"og.Engine: {why}", flush=True)
    entry = load_entry(folder, args.threads)
    backend = entry.backend
    genai_batched: Callable[..., tuple[Run, list[list[int]]]] = genai_engine if ok else genai_generator
    results: dict[str, dict[int, list[Run]]] = {"genai": {}, "server": {}, "direct": {}, "engine": {}}
    ratios: dict[str, dict[int, list[float]]] = {"server/genai": {}, "server/direct": {}, "engine/direct": {},
                                                 "server/engine": {}}
    if args.base_tree is not None:
        results["base"], ratios["server/base"] = {}, {}
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(server(folder, args.threads, args.server_arg))
        other = None if args.base_tree is None else stack.enter_context(
            server(folder, args.threads, args.server_arg, args.base_tree.resolve()))
        # Warm-up and a correctness check: every way gives the same greedy tokens for one prompt.
        p = prompts(vocab, 1, args.prompt_len, 0)
        ref = genai_generator(model, p, 8)[1][0]
        direct = direct_loop(backend, p, 8)[1][0]
        engine = engine_loop(entry, backend, [(p[0], 8)], 1, args.threads)[1][0]
        server_run(base, folder.name, [(p[0], 8)], 1)
        if other is not None:
            server_run(other, folder.name, [(p[0], 8)], 1)
        print(f"greedy tokens agree (og.Generator vs the server's backend): {ref == direct}", flush=True)
        print(f"greedy tokens agree (the server's backend vs its decode loop): {direct == engine}", flush=True)
        for rnd in range(args.rounds):
            for n in counts:
                requests = workload(args.workload, vocab, n, args.prompt_len, args.max_tokens, 1000 * rnd + n)
                batched = partial(genai_generator if n == 1 else genai_batched, model)
                ways: dict[str, Callable[[], Run]] = {
                    "genai": partial(_first, static_batches, batched, requests, n),
                    "server": partial(server_run, base, folder.name, requests, n),
                    "direct": partial(_first, static_batches, partial(direct_loop, backend), requests, n),
                    "engine": partial(_first, engine_loop, entry, backend, requests, n, args.threads)}
                if other is not None:
                    ways["base"] = partial(server_run, other, folder.name, requests, n)
                order = list(ways) if rnd % 2 == 0 else list(reversed(ways))
                got = {k: settled(ways[k]) for k in order}
                for k, run in got.items():
                    results[k].setdefault(n, []).append(run)
                ratios["server/genai"].setdefault(n, []).append(got["server"].tok_s / got["genai"].tok_s)
                ratios["server/direct"].setdefault(n, []).append(got["server"].tok_s / got["direct"].tok_s)
                ratios["engine/direct"].setdefault(n, []).append(got["engine"].tok_s / got["direct"].tok_s)
                ratios["server/engine"].setdefault(n, []).append(got["server"].tok_s / got["engine"].tok_s)
                if other is not None:
                    ratios["server/base"].setdefault(n, []).append(got["server"].tok_s / got["base"].tok_s)
                print(f"round {rnd + 1} streams {n}: " + ", ".join(f"{k} {r.tok_s:.0f} tok/s" for k, r in
                                                                     got.items()), flush=True)
    load = os.getloadavg()
    report = {"folder": folder.name, "threads": args.threads, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "workload": args.workload, "rounds": args.rounds,
              "engine_correct": ok, "engine_check": why,
              "genai_batched": "og.Engine" if ok else "og.Generator (batched, equal-length prompts)",
              "load_average": [round(x, 2) for x in load],
              "results": {k: {n: summary(v) for n, v in d.items()} for k, d in results.items()},
              "ratios": {k: {n: statistics.median(v) for n, v in d.items()} for k, d in ratios.items()}}
    asked = (f"{args.max_tokens} tokens a stream" if args.workload == "equal" else
             f"{REQUESTS_PER_STREAM} requests a stream of {shortest(args.max_tokens)}-{args.max_tokens} tokens")
    print(f"\n{folder.name}: {args.threads} intra-op threads, {args.workload} workload, prompt {args.prompt_len}, "
          f"{asked}, median of {args.rounds} rounds; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("| streams | way | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
    print("|---|---|---|---|---|")
    for n in counts:
        for k in results:
            s = report["results"][k][n]
            print(f"| {n} | {k} | {s['tok_s']:.0f} | {s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.1f} | "
                  f"{s['itl_p50_ms']:.2f} / {s['itl_p99_ms']:.2f} |")
    for n in counts:
        print(f"streams {n}: " + ", ".join(f"{k} {v[n]:.2f}" for k, v in report["ratios"].items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
