"""What chunked prefill buys the running streams: the server's decode loop (`TextScheduler`, in this process, as
benchmarks.genai_vs_server's way `engine`) over an onnxruntime-genai folder, N streams decoding when one long
prompt arrives, with `--prefill-chunk-tokens` off (0: the long prompt prefilled in one call) and at the given
sizes, in interleaved rounds.

    python -m benchmarks.chunked_prefill DIR [--streams 8] [--long 768] [--chunks 0,128,256] [--rounds 3]

Per way: the running streams' inter-token latency p50 / p99 / max (the gaps between the times the event loop
sees their tokens), the long prompt's time to first token, and output tokens/s over all sequences. Exit status 2
with one line for bad input.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.genai_vs_server import folder_parser, load_entry, not_a_genai_folder, pct, prompts

RUNNING_TOKENS = 160  # tokens each running stream generates (the long prompt arrives after ARRIVE_AFTER of them)
ARRIVE_AFTER = 16
LONG_TOKENS = 16  # tokens the long prompt asks for


def one_run(entry: Any, chunk: int, streams: int, long_len: int, prompt_len: int = 32) -> dict[str, float]:
    """N streams start together; when the first has ARRIVE_AFTER tokens, a long_len-token prompt arrives."""
    from service.base.metrics import Metrics
    from service.engine.text.sampler import SamplingParams
    from service.engine.text.scheduler import GenSequence, TextScheduler

    vocab = entry.spec.vocab_size
    running = [GenSequence(p, SamplingParams(RUNNING_TOKENS, temperature=0.0, ignore_eos=True))
               for p in prompts(vocab, streams, prompt_len, 1)]
    long = GenSequence(prompts(vocab, 1, long_len, 2)[0],
                       SamplingParams(LONG_TOKENS, temperature=0.0, ignore_eos=True))
    stamps: list[list[float]] = [[] for _ in running]

    async def main() -> tuple[float, float]:
        arrive = asyncio.Event()  # the first stream has ARRIVE_AFTER tokens: the long prompt is sent

        async def watch(i: int, seq: GenSequence) -> None:
            while not seq.done:
                await seq.changed.wait()
                seq.changed.clear()
                stamps[i].extend([time.perf_counter()] * (seq.generated - len(stamps[i])))
                if i == 0 and seq.generated >= ARRIVE_AFTER:
                    arrive.set()
            arrive.set()

        async def finish(seq: GenSequence) -> None:
            while not seq.done:
                await seq.changed.wait()
                seq.changed.clear()

        with ThreadPoolExecutor(1) as executor:
            sched = TextScheduler(entry.name, entry.backend, entry.tokenizer, entry.context_length, executor,
                                  Metrics(), max_running=64, max_waiting=256, prefill_chunk=chunk)
            sched.start()
            start = time.perf_counter()
            sched.submit(running)
            watchers = [asyncio.create_task(watch(i, s)) for i, s in enumerate(running)]
            await arrive.wait()
            sent = time.perf_counter()
            sched.submit([long])
            await asyncio.gather(*watchers, finish(long))
            wall = time.perf_counter() - start
            await sched.close()
        ttft = (long.first_token or sent) - sent
        return ttft, wall

    ttft, wall = asyncio.run(main())
    if any(s.error is not None for s in (*running, long)):
        raise SystemExit("error: the decode loop failed a sequence")
    gaps = [b - a for t in stamps for a, b in itertools.pairwise(t)]
    tokens = sum(s.generated for s in running) + long.generated
    return {"itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99), "itl_max_ms": pct(gaps, 100),
            "long_ttft_ms": ttft * 1e3, "tok_s": tokens / wall}


def main(argv: list[str] | None = None) -> int:
    ap = folder_parser("python -m benchmarks.chunked_prefill", __doc__ or "", rounds=3)
    ap.add_argument("--streams", type=int, default=8, help="running streams (default 8)")
    ap.add_argument("--long", type=int, default=768, help="tokens of the prompt that arrives (default 768)")
    ap.add_argument("--chunks", default="0,128,256", help="--prefill-chunk-tokens values, 0 = off (default 0,128,256)")
    args = ap.parse_args(argv)
    if not_a_genai_folder(args.folder):
        return 2
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        print(f"error: --chunks: not a comma-separated list of integers: {args.chunks!r}", file=sys.stderr)
        return 2
    if min(args.streams, args.long, args.rounds, args.threads) < 1 or min(chunks) < 0:
        print("error: --streams, --long, --rounds and --threads must be >= 1, --chunks >= 0", file=sys.stderr)
        return 2
    entry = load_entry(args.folder.resolve(), args.threads)
    if args.long + LONG_TOKENS > entry.context_length:
        print(f"error: --long {args.long} + {LONG_TOKENS} tokens is past the model's context of "
              f"{entry.context_length}", file=sys.stderr)
        return 2
    one_run(entry, 0, 2, 32)  # warm
    results: dict[int, list[dict[str, float]]] = {c: [] for c in chunks}
    for r in range(args.rounds):
        for c in chunks if r % 2 == 0 else chunks[::-1]:
            results[c].append(one_run(entry, c, args.streams, args.long))
            print(f"round {r + 1} chunk {c}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[c][-1].items()),
                  flush=True)
    print(f"\n{args.folder.name}: {args.streams} streams of {RUNNING_TOKENS} tokens, a {args.long}-token prompt "
          f"arriving after {ARRIVE_AFTER}; median of {args.rounds} rounds, {args.threads} intra-op threads")
    print("| --prefill-chunk-tokens | running ITL p50 / p99 / max ms | long prompt TTFT ms | tok/s |")
    print("|---|---|---|---|")
    for c in chunks:
        med = {k: statistics.median(x[k] for x in results[c]) for k in results[c][0]}
        print(f"| {c or 'off'} | {med['itl_p50_ms']:.1f} / {med['itl_p99_ms']:.1f} / {med['itl_max_ms']:.1f} | "
              f"{med['long_ttft_ms']:.0f} | {med['tok_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
