"""`python -m benchmarks.loadtest`: parse the command line, run (or sweep), print the summary, write the files.

Bad options and an unreachable server exit 2 with one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.loadtest.config import WORKLOADS, ConfigError, IntRange, LoadConfig
from benchmarks.loadtest.progress import Progress
from benchmarks.loadtest.report import report_dict, summary, sweep_summary, write_csv, write_json, write_requests_csv
from benchmarks.loadtest.runner import run_async, run_coroutine
from benchmarks.loadtest.stats import Result
from benchmarks.loadtest.sweep import SweepResult, analyse, sweep_configs

PROG = "python -m benchmarks.loadtest"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _list(kind: type) -> object:
    def parse(text: str) -> list[float]:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive comma-separated numbers, got {text!r}")
        return values
    return parse


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _range(text: str) -> IntRange:
    try:
        return IntRange.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Load-test a running multimax-serve server (or any server with the same "
                "API): latency distribution, throughput, errors, server-side split, sweeps with knee and goodput.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL; the only host contacted "
                   "(default %(default)s)")
    p.add_argument("--workload", choices=WORKLOADS, default="classify",
                   help="classify: POST /v1/models/{m}/classify; infer: KServe V2 /v2/models/{m}/infer; generate: "
                   "POST /v1/completions; chat: POST /v1/chat/completions (default %(default)s)")
    p.add_argument("--model", help="model name (default: digits_multimax, or text_multimax for generate/chat)")
    p.add_argument("--api-key", metavar="KEY", help="send `Authorization: Bearer KEY` (never written to --out)")
    load = p.add_argument_group("load model (exactly one)")
    load.add_argument("--concurrency", type=_positive_int, help="closed loop: N requests always in flight")
    load.add_argument("--rate", type=_positive_float, help="open loop: R requests/s, sent on schedule")
    load.add_argument("--sweep-concurrency", type=_list(int), metavar="N,N,...", help="closed-loop sweep")
    load.add_argument("--sweep-rate", type=_list(float), metavar="R,R,...", help="open-loop sweep")
    load.add_argument("--poisson", action="store_true", help="open loop: Poisson arrivals (exponential gaps)")
    load.add_argument("--max-in-flight", type=_positive_int, default=1024,
                      help="open loop: cap on outstanding requests (default %(default)s)")
    bound = p.add_argument_group("bounds (at least one; per sweep point)")
    bound.add_argument("--duration", type=_positive_float, metavar="S", help="measure for S seconds")
    bound.add_argument("--requests", type=_positive_int, metavar="N", help="measure N requests")
    bound.add_argument("--warmup", type=float, default=0.0, metavar="S", help="unmeasured load first (default 0)")
    bound.add_argument("--timeout", type=_positive_float, default=30.0, metavar="S",
                       help="per-request timeout (default %(default)s)")
    img = p.add_argument_group("classify / infer")
    img.add_argument("--images", type=Path, metavar="DIR", help="send these .png/.jpg files (default: generated)")
    img.add_argument("--batch", type=_positive_int, default=1, help="images per request / tensor rows (default 1)")
    img.add_argument("--top-k", type=_positive_int, default=5, help="classify ?top_k= (default %(default)s)")
    gen = p.add_argument_group("generate / chat")
    gen.add_argument("--prompt-len", type=_range, default=IntRange(8, 32), metavar="LO:HI",
                     help="prompt length in tokens (of --tokenizer; bytes without), uniform (default 8:32)")
    gen.add_argument("--tokenizer", type=Path, metavar="PATH",
                     help="the served model's tokenizer.json (or its folder): prompt lengths and output counts "
                     "without usage in its tokens (default: byte-level, the demo models)")
    gen.add_argument("--system-prompt", metavar="TEXT", help="chat: a system message before each user message")
    gen.add_argument("--extra-body", type=_json_object, metavar="JSON",
                     help="fields merged into every request body, e.g. '{\"guided_regex\": \"[a-z]+\"}'")
    gen.add_argument("--max-tokens", type=_range, default=IntRange(16, 64), metavar="LO:HI",
                     help="max_tokens, uniform (default 16:64); keep prompt + output within the model's context")
    gen.add_argument("--prompts", type=Path, metavar="FILE", help="prompts, one per line (overrides --prompt-len)")
    gen.add_argument("--no-stream", action="store_true", help="ask for whole completions instead of SSE")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--ignore-eos", action="store_true",
                     help="send ignore_eos: every completion runs to its max_tokens (fixed output lengths)")
    slo = p.add_argument_group("SLO and analysis")
    slo.add_argument("--slo-p99-ms", type=_positive_float, metavar="MS",
                     help="latency SLO: goodput counts requests done within MS; met if >= 99%% of them are")
    slo.add_argument("--slo-ttft-ms", type=_positive_float, metavar="MS", help="generate: time-to-first-token SLO")
    slo.add_argument("--knee-scaling", type=_positive_float, default=0.1, metavar="S",
                     help="sweep: a step whose throughput grew by less than S of the load step (with latency "
                     "taking up the rest, and no later point 10%% faster) is saturated (default %(default)s)")
    slo.add_argument("--knee-latency-growth", type=_positive_float, default=2.0, metavar="G",
                     help="sweep: a step whose median latency grew more than G times as fast as the load is "
                     "saturated (default %(default)s)")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, metavar="DIR", help="write results.json, results.csv and PNG plots here")
    out.add_argument("--save-requests", action="store_true", help="also write requests.csv (one row per request)")
    out.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics before and after")
    out.add_argument("--seed", type=int, default=0, help="seed for images, tensors, prompts and Poisson gaps")
    out.add_argument("--quiet", action="store_true", help="no live progress")
    out.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                     help="auto: uvloop when installed (default)")
    return p


def config_from_args(args: argparse.Namespace) -> tuple[LoadConfig, str | None, list[float] | None]:
    modes = [m for m in ("concurrency", "rate", "sweep_concurrency", "sweep_rate") if getattr(args, m) is not None]
    if len(modes) != 1:
        raise ConfigError("give exactly one of --concurrency, --rate, --sweep-concurrency, --sweep-rate")
    sweep_kind = {"sweep_concurrency": "concurrency", "sweep_rate": "rate"}.get(modes[0])
    values = getattr(args, modes[0]) if sweep_kind else None
    first = values[0] if values else None
    cfg = LoadConfig(
        url=args.url, workload=args.workload, model=args.model,
        concurrency=args.concurrency if sweep_kind is None else (int(first) if sweep_kind == "concurrency" else None),
        rate=args.rate if sweep_kind is None else (float(first) if sweep_kind == "rate" else None),
        poisson=args.poisson, duration_s=args.duration, requests=args.requests, warmup_s=args.warmup,
        timeout_s=args.timeout, max_in_flight=args.max_in_flight, seed=args.seed, images=args.images,
        batch=args.batch, top_k=args.top_k, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos, api_key=args.api_key, tokenizer=args.tokenizer,
        system_prompt=args.system_prompt, extra_body=args.extra_body,
        stream=not args.no_stream, temperature=args.temperature, prompts_file=args.prompts,
        slo_ms=args.slo_p99_ms, slo_ttft_ms=args.slo_ttft_ms, scrape_metrics=not args.no_metrics,
        progress=not args.quiet, keep_samples=args.save_requests, event_loop=args.event_loop,
    )
    return cfg.validate(), sweep_kind, values


async def _run_all(configs: list[LoadConfig], progress: Progress | None) -> list[Result]:
    results = []
    for i, cfg in enumerate(configs):
        if len(configs) > 1 and progress is not None:
            print(f"sweep point {i + 1}/{len(configs)}: {cfg.mode} loop, load {cfg.load:g}", file=sys.stderr)
        results.append(await run_async(cfg, progress))
        if any("interrupted" in w for w in results[-1].generator.get("warnings", ())):
            break
    return results


def _redacted(argv: list[str]) -> list[str]:
    """The command line with the API key replaced (results.json records the command)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--api-key":
            out.append("***")
        elif arg.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(arg)
    return out


def write_outputs(out: Path, results: list[Result], sweep: SweepResult | None, argv: list[str]) -> list[Path]:
    from benchmarks.loadtest.plots import plot_histogram, plot_latency_vs_throughput

    out.mkdir(parents=True, exist_ok=True)
    meta = {"tool": "benchmarks.loadtest", "command": " ".join([PROG, *map(shlex.quote, _redacted(argv))]),
            "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    files = [out / "results.json", out / "results.csv", out / "latency_vs_throughput.png",
             out / "latency_histogram.png"]
    write_json(files[0], report_dict(results, sweep, meta))
    write_csv(files[1], results)
    cfg = results[0].config
    title = f"{cfg['workload']} {cfg['model']}"
    plot_latency_vs_throughput(results, files[2], None if sweep is None else sweep.knee.index, cfg["slo_ms"],
                               f"{title}: latency percentiles vs throughput")
    plot_histogram(results, files[3], f"{title}: latency distribution")
    if any(r.samples for r in results):
        for i, r in enumerate(results):
            path = out / ("requests.csv" if len(results) == 1 else f"requests_{i}.csv")
            write_requests_csv(path, r.samples)
            files.append(path)
    return files


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad option (2, its line already printed)
        return int(exc.code or 0)
    try:
        cfg, sweep_kind, values = config_from_args(args)
        configs = [cfg] if sweep_kind is None else sweep_configs(cfg, values or [], sweep_kind)
        progress = Progress() if cfg.progress else None
        results = run_coroutine(_run_all(configs, progress), cfg.event_loop)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    sweep = None if sweep_kind is None else analyse(results, args.knee_scaling, args.knee_latency_growth, cfg.slo_ms)
    print(summary(results[0]) if sweep is None else sweep_summary(sweep))
    if args.out is not None:
        files = write_outputs(args.out, results, sweep, argv)
        print("files      " + ", ".join(str(f) for f in files))
    interrupted = any("interrupted" in w for r in results for w in r.generator.get("warnings", ()))
    return 130 if interrupted else 0
