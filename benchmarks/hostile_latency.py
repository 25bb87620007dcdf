"""`python -m benchmarks.hostile_latency`: what hostile LLM requests cost everyone else (issue 38).

An innocent client sends one request at a time (a liveness probe, which is the event loop alone, and a short
greedy chat completion) while a hostile client keeps sending one kind of heavy request back to back:

- `chat_1mb`: a chat message of one 1,000,000-character word (refused: over the context, but only once it is
  tokenized; it used to be tokenized on the event loop, 0.6 s in which no other request moved);
- `kserve_16x256`: KServe infer on the Llama with input_ids [16, 256], JSON output (343 MB of logits as JSON,
  ~8 s of the event loop before; refused before the model runs now, --max-kserve-json-output-bytes);
- `kserve_binary`: the same with binary output (67 MB, written off the event loop);
- `kserve_json_max`: the largest JSON output the default limit lets through ([4, 160]: 2.6 M floats, written off
  the event loop in pieces).

For each, the innocent latencies (median, p90, max) against the same requests alone. `--root DIR` serves from
another checkout (e.g. `git archive HEAD | tar -x -C /tmp/base`: the code before a change) with this one's
benchmark. `--grammar` also times the structured-output worker per grammar (a small json_schema, each a new one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.server import ROOT, running

LLAMA = "llama_seglu"
SMALL_CHAT = {"model": LLAMA, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4,
              "temperature": 0}


def _ids(rows: int, tokens: int) -> dict[str, Any]:
    return {"name": "input_ids", "shape": [rows, tokens], "datatype": "INT64",
            "data": [(i * 7) % 4000 for i in range(rows * tokens)]}


HOSTILE: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_1mb": ("/v1/chat/completions", {"model": LLAMA, "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "x" * 1_000_000}]}),
    "kserve_16x256": (f"/v2/models/{LLAMA}/infer", {"inputs": [_ids(16, 256)]}),
    "kserve_binary": (f"/v2/models/{LLAMA}/infer", {"inputs": [_ids(16, 256)],
                                                     "parameters": {"binary_data_output": True}}),
    "kserve_json_max": (f"/v2/models/{LLAMA}/infer", {"inputs": [_ids(4, 160)]}),
}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def innocent(url: str, seconds: float) -> dict[str, list[float]]:
    """Latencies (ms) of the innocent requests, one at a time for `seconds`."""
    out: dict[str, list[float]] = {"live": [], "chat": []}
    end = time.monotonic() + seconds
    with httpx.Client(timeout=120) as client:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            assert client.get(f"{url}/v2/health/live").status_code == 200
            out["live"].append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            assert client.post(f"{url}/v1/chat/completions", json=SMALL_CHAT).status_code == 200
            out["chat"].append((time.perf_counter() - t0) * 1000)
            time.sleep(0.02)
    return out


def hostile(url: str, path: str, body: dict[str, Any], stop: threading.Event, log: list[tuple[int, float]]) -> None:
    data = json.dumps(body).encode()
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = client.post(url + path, content=data, headers={"Content-Type": "application/json"})
            log.append((r.status_code, time.perf_counter() - t0))


def scenario(url: str, name: str | None, seconds: float) -> dict[str, Any]:
    stop, log = threading.Event(), []
    worker = None
    if name is not None:
        path, body = HOSTILE[name]
        worker = threading.Thread(target=hostile, args=(url, path, body, stop, log))
        worker.start()
        time.sleep(0.5)  # its first request is under way
    try:
        lat = innocent(url, seconds)
    finally:
        stop.set()
        if worker is not None:
            worker.join()
    row: dict[str, Any] = {"scenario": name or "alone"}
    for kind, values in lat.items():
        row[kind] = {"n": len(values), "median": round(statistics.median(values), 1),
                     "p90": round(_pct(values, 0.9), 1), "max": round(max(values), 1)}
    if log:
        row["hostile"] = {"status": sorted({s for s, _ in log}), "n": len(log),
                          "median_s": round(statistics.median(t for _, t in log), 3)}
    return row


def grammar_cost(rounds: int) -> dict[str, Any]:
    """ms per grammar: in-process compile + probe, the worker's round trip, the server's whole path."""
    import asyncio

    from models.hf_text import HFTextTokenizer
    from models.hf_tokenizer import HFTokenizer
    from models.tokenizer import ByteTokenizer
    from service.base.config import Settings
    from service.protocols import structured
    from service.protocols.grammar_guard import GrammarGuard
    from service.protocols.grammar_worker import GrammarJob

    def schema(i: int) -> dict[str, Any]:
        return {"type": "object", "properties": {f"n{i}": {"type": "integer"}, "ok": {"type": "boolean"},
                                                 "tag": {"enum": ["a", "b"]}},
                "required": [f"n{i}", "ok"], "additionalProperties": False}

    def timed(fn: Callable[[int], Any]) -> float:
        fn(-1)  # warm: the worker started, the tokenizer built
        times = []
        for i in range(rounds):
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1000)
        return round(statistics.median(times), 2)

    out: dict[str, Any] = {}
    settings = Settings()
    tokenizers = {"byte": ByteTokenizer(), "llama": HFTextTokenizer(HFTokenizer.from_folder(
        ROOT / "models" / "demo" / LLAMA))}
    guard = GrammarGuard(1, 10.0)
    try:
        for name, tok in tokenizers.items():
            spec = structured.tokenizer_spec(tok)
            out[name] = {
                "in_process_ms": timed(lambda i, tok=tok: structured.processors_for({"guided_json": schema(i)}, tok)),
                "worker_ms": timed(lambda i, spec=spec: guard.check(
                    GrammarJob("guided_json", "json_schema", json.dumps(schema(i))), spec)),
                "server_path_ms": timed(lambda i, tok=tok: asyncio.run(structured.processors_for_request(
                    {"guided_json": schema(10_000 + i)}, tok, settings))),
            }
    finally:
        guard.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="innocent requests per scenario, seconds")
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to serve from (default: this one)")
    parser.add_argument("--scenarios", default=",".join(HOSTILE), help="comma list of " + ", ".join(HOSTILE))
    parser.add_argument("--grammar", action="store_true", help="also time the grammar worker per grammar")
    parser.add_argument("--rounds", type=int, default=50, help="grammars timed per figure (--grammar)")
    args = parser.parse_args(argv)
    with running("--models", f"{LLAMA},text_multimax", cwd=args.root) as url:
        innocent(url, 1.0)  # warm
        for name in [None, *[s for s in args.scenarios.split(",") if s]]:
            print(json.dumps(scenario(url, name, args.seconds)), flush=True)
    if args.grammar:
        print(json.dumps({"grammar_cost": grammar_cost(args.rounds)}), flush=True)


if __name__ == "__main__":
    main()
