"""What the decode loop's cache reservation saves: the server's decode loop (`TextScheduler`, as
benchmarks.genai_vs_server's way `engine`) over an onnxruntime-genai folder, with the backend's `reserve` hint
(a full cache buffer grows once, to what the batch may reach) and without it (the buffer doubles: 64, 128, ...
positions), in interleaved rounds of N equal streams.

    python -m benchmarks.cache_reserve DIR [--streams 16] [--max-tokens 64] [--rounds 8] [--threads 1]

Prints tokens/s both ways and the median of per-round ratios (on / off). Exit status 2 with one line for bad
input.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from benchmarks.genai_vs_server import engine_loop, folder_parser, load_entry, not_a_genai_folder, prompts


def compare(folder: Path, streams: int, max_tokens: int, rounds: int, threads: int,
            prompt_len: int = 32) -> dict[str, list[float]]:
    """tok/s of each round with the hint ("on") and without ("off"), the order alternating by round."""
    entry = load_entry(folder, threads)
    backend = entry.backend
    hint = backend.reserve
    batch = prompts(entry.spec.vocab_size, streams, prompt_len, 0)
    engine_loop(entry, backend, [(p, 8) for p in batch], streams)  # warm
    out: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for r in range(rounds):
            for way in ("on", "off") if r % 2 == 0 else ("off", "on"):
                backend.reserve = hint if way == "on" else (lambda positions: hint(0))
                out[way].append(engine_loop(entry, backend, [(p, max_tokens) for p in batch], streams)[0].tok_s)
    finally:
        backend.reserve = hint
    return out


def main(argv: list[str] | None = None) -> int:
    ap = folder_parser("python -m benchmarks.cache_reserve", __doc__ or "", rounds=8)
    ap.add_argument("--streams", type=int, default=16, help="equal streams sent together (default 16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens a stream generates (default 64)")
    args = ap.parse_args(argv)
    if not_a_genai_folder(args.folder):
        return 2
    if min(args.streams, args.max_tokens, args.rounds, args.threads) < 1:
        print("error: --streams, --max-tokens, --rounds and --threads must be >= 1", file=sys.stderr)
        return 2
    out = compare(args.folder.resolve(), args.streams, args.max_tokens, args.rounds, args.threads)
    ratios = [a / b for a, b in zip(out["on"], out["off"], strict=True)]
    print(f"{args.folder.name}: {args.streams} streams x {args.max_tokens} tokens, {args.rounds} rounds, "
          f"{args.threads} intra-op threads")
    print(f"reserve on  {statistics.median(out['on']):.0f} tok/s")
    print(f"reserve off {statistics.median(out['off']):.0f} tok/s")
    print(f"on / off {statistics.median(ratios):.3f} (per round {', '.join(f'{x:.3f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
