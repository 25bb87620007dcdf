"""`python -m benchmarks.server_ab`: servers side by side, each a folder served from a source tree with its own options,
in interleaved rounds: what an option, a model variant or a change costs the served model, as a ratio.

    python -m benchmarks.server_ab LABEL=FOLDER[@TREE] ... [--arg LABEL=OPTION ...] [--streams 1,16] [--rounds 5]
                                   [--max-tokens 128] [--prompt-len 32] [--threads 2] [-o report.json]

Each side is `python -m service` on 127.0.0.1 (benchmarks.genai_vs_server.server) serving one onnxruntime-genai
folder, run from TREE's code where given (a `git worktree` of another revision), else this tree's, with the
options `--arg LABEL=OPTION` gives it (repeatable; e.g. `--arg off=--ort-spinning=off`). Every side gets the same
token-id prompts, greedy, ignore_eos, streamed /v1/completions from N concurrent clients (genai_vs_server.server_run);
each round runs every side once per stream count, the order reversed every other round. Reported per side and
stream count: tokens/s, TTFT and ITL p50/p99 (medians over rounds), and its ratio to the first side: the median of
per-round ratios, so load that comes and goes slows both sides of a ratio alike. Examples (docs/BENCHMARKS.md):

    # the spinning modes on one export
    python -m benchmarks.server_ab run=/tmp/m always=/tmp/m off=/tmp/m --arg always=--ort-spinning=always \\
        --arg off=--ort-spinning=off --streams 1,4,16
    # a SegLU head against the plain one
    python -m benchmarks.server_ab plain=/tmp/plain_genai seglu=/tmp/seglu_genai --streams 1,16

Exit status 2 with one line for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks import genai_vs_server as gvs


@dataclass
class Side:
    label: str
    folder: Path
    tree: Path | None
    options: list[str] = field(default_factory=list)


def parse_sides(specs: list[str], args: list[str]) -> list[Side]:
    """LABEL=FOLDER[@TREE] specs and LABEL=OPTION args as sides; ValueError naming what is wrong."""
    sides: dict[str, Side] = {}
    for spec in specs:
        label, sep, rest = spec.partition("=")
        if not sep or not label or not rest:
            raise ValueError(f"a side is LABEL=FOLDER[@TREE], got {spec!r}")
        if label in sides:
            raise ValueError(f"side {label!r} named twice")
        folder, _, tree = rest.partition("@")
        if not gvs.is_genai_folder(Path(folder)):
            raise ValueError(f"{folder}: not an onnxruntime-genai folder (no genai_config.json)")
        if tree and not gvs.is_source_tree(Path(tree)):
            raise ValueError(f"{tree}: not a source tree of this project (no service/__main__.py)")
        sides[label] = Side(label, Path(folder), Path(tree).resolve() if tree else None)
    for arg in args:
        label, sep, option = arg.partition("=")
        if not sep or label not in sides or not option:
            raise ValueError(f"--arg is LABEL=OPTION for a side named before, got {arg!r}")
        sides[label].options.append(option)
    if not sides:
        raise ValueError("name at least one side: LABEL=FOLDER[@TREE]")
    return list(sides.values())


def measure(sides: list[Side], streams: list[int], rounds: int, prompt_len: int, max_tokens: int,
            threads: int) -> dict[str, Any]:
    runs: dict[str, dict[int, list[gvs.Run]]] = {s.label: {n: [] for n in streams} for s in sides}
    vocab = min(gvs.model_limits(s.folder)[0] for s in sides)
    with contextlib.ExitStack() as stack:
        bases = {s.label: stack.enter_context(gvs.server(s.folder, threads, s.options, s.tree)) for s in sides}
        for n in streams:  # one untimed run each: warm caches, first-call allocations
            for s in sides:
                gvs.server_run(bases[s.label], s.folder.name, [(p, 4) for p in gvs.prompts(vocab, n, prompt_len, 99)],
                               n)
        for rnd in range(rounds):
            for n in streams:
                requests = [(p, max_tokens) for p in gvs.prompts(vocab, n, prompt_len, 1000 * rnd + n)]
                for s in (sides if rnd % 2 == 0 else sides[::-1]):
                    runs[s.label][n].append(gvs.settled(partial(gvs.server_run, bases[s.label], s.folder.name,
                                                                requests, n)))
                print(f"round {rnd + 1} streams {n}: " + ", ".join(
                    f"{s.label} {runs[s.label][n][-1].tok_s:.1f} tok/s" for s in sides), flush=True)
    first = sides[0].label
    results = {s.label: {str(n): gvs.summary(runs[s.label][n]) for n in streams} for s in sides}
    ratios = {s.label: {str(n): statistics.median(a.tok_s / b.tok_s for a, b in
                                                  zip(runs[s.label][n], runs[first][n], strict=True))
                        for n in streams} for s in sides}
    return {"sides": [{"label": s.label, "folder": str(s.folder), "tree": str(s.tree) if s.tree else None,
                       "options": s.options} for s in sides],
            "streams": streams, "rounds": rounds, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "threads": threads, "results": results, "ratios_to": first, "ratios": ratios}


def table(report: dict[str, Any]) -> str:
    first = report["ratios_to"]
    lines = [f"| streams | side | tok/s | TTFT p50 ms | ITL p50 / p99 ms | tok/s / {first} |",
             "|---|---|---|---|---|---|"]
    for n in report["streams"]:
        for side in report["sides"]:
            r = report["results"][side["label"]][str(n)]
            lines.append(f"| {n} | {side['label']} | {r['tok_s']:.1f} | {r['ttft_p50_ms']:.1f} | "
                         f"{r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | "
                         f"{report['ratios'][side['label']][str(n)]:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.server_ab", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sides", nargs="*", metavar="LABEL=FOLDER[@TREE]")
    parser.add_argument("--arg", action="append", default=[], metavar="LABEL=OPTION",
                        help="a `python -m service` option for one side (repeatable)")
    parser.add_argument("--streams", default="1,16", help="concurrent streams, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every server")
    parser.add_argument("-o", "--output", type=Path, help="write the report here as JSON")
    args = parser.parse_args(argv)
    try:
        sides = parse_sides(args.sides, args.arg)
        streams = [int(x) for x in args.streams.split(",")]
        if min(streams) < 1 or args.rounds < 1 or args.max_tokens < 1 or args.prompt_len < 1 or args.threads < 0:
            raise ValueError("streams, rounds, max tokens and prompt length must be at least 1")
        context = min(gvs.model_limits(side.folder)[1] for side in sides)
        if args.prompt_len + args.max_tokens > context:
            raise ValueError(f"--prompt-len + --max-tokens = {args.prompt_len + args.max_tokens} is over the "
                             f"context of {context}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = measure(sides, streams, args.rounds, args.prompt_len, args.max_tokens, args.threads)
    print(table(report))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
