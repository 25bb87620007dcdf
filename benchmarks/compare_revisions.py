"""`python -m benchmarks.compare_revisions --base REV [--head DIR_OR_REV]`: did a change make anything slower?

Side by side, two source trees: the headline export's wall time (`python -m models init deit_small --multimax
attention,output --params paper`, then `python -m export deit_small_multimax.pt`), and the serving benchmark's
classification throughput (`python -m benchmarks.serving --only batching`: images/s of the default server,
16 clients) and generation throughput (`--only generation`: tokens/s at 16 streams; 1 and 4 are kept too).
Each tree runs its own code, in a subprocess with the tree as working directory and on PYTHONPATH, so nothing of
this tree leaks into the other's figures. Rounds are interleaved, base first then head first (A B B A ...), so
that load from other work falls on both alike. Printed and written as JSON: every round's values, the medians,
the ratio of medians head/base, and the median of the per-round ratios (for throughputs, above 1 is faster; for
the export time, below 1 is faster).

A revision is checked out with `git worktree add --detach` into a temporary directory (removed afterwards); a
directory is used as it is (its uncommitted changes included). The head defaults to this working tree. Flags a
tree's benchmark does not know (an older base) are left out, with a note.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
METRICS = {  # name -> (what it is, higher is better)
    "export_s": ("headline export wall time, s", False),
    "classification_images_per_s": ("classification images/s (benchmarks.serving --only batching, batched)", True),
    "generation_tokens_per_s": ("generation tokens/s at 16 streams (benchmarks.serving --only generation)", True),
}
SIDES = ("base", "head")


# ---- the trees --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def materialise(spec: str, repo: Path) -> Iterator[tuple[Path, str]]:
    """(directory, description) of `spec`: an existing directory as it is, else a revision of `repo` checked out
    into a temporary git worktree for the duration."""
    if Path(spec).is_dir():
        tree = Path(spec).resolve()
        yield tree, f"{tree} (at {_git(tree, 'rev-parse', '--short', 'HEAD') or '?'}, working tree)"
        return
    commit = _git(repo, "rev-parse", "--verify", f"{spec}^{{commit}}")
    if not commit:
        raise SystemExit(f"compare_revisions: {spec!r} is neither a directory nor a revision of {repo}")
    tmp = Path(tempfile.mkdtemp(prefix="multimax-compare."))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(tree), commit], check=True)
    try:
        yield tree, f"{spec} ({commit[:12]})"
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)
        with contextlib.suppress(OSError):
            tmp.rmdir()


def _git(where: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def known_flags(tree: Path, module: str) -> set[str]:
    """The long options `python -m module --help` lists in `tree`."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=tree, env=_env(tree), capture_output=True,
                          text=True, timeout=300)
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", proc.stdout))


def supported(args: list[str], flags: set[str], notes: list[str], where: str) -> list[str]:
    """`args` without the options (and their values) that `flags` lacks; each one left out is noted."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("-")
        if arg.startswith("--") and arg not in flags:
            notes.append(f"{where}: does not know {arg}; left out")
            i += 2 if takes_value else 1
            continue
        out.append(arg)
        i += 1
    return out


# ---- one measurement --------------------------------------------------------------------------------------------


def export_once(tree: Path, work: Path, checkpoint: str, flags: set[str], notes: list[str]) -> float:
    """Wall seconds of `python -m export CHECKPOINT` (the headline command, default validation) in `tree`."""
    out = work / "compare.onnx"
    command = supported(["-o", str(out), "--quiet"], flags, notes, f"{tree.name} export")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "export", checkpoint, *command], cwd=work, env=_env(tree),
                          capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"export in {tree} failed with exit {proc.returncode}: {proc.stderr[-2000:]}")
    return wall


def serving_once(tree: Path, work: Path, sections: list[str], args: argparse.Namespace, flags: set[str],
                 notes: list[str]) -> dict[str, Any]:
    """The serving benchmark's figures for `sections` (batching, generation) from `tree`'s own benchmark."""
    out = work / "serving.json"
    out.unlink(missing_ok=True)
    wanted = ["--only", ",".join(sections), "--seconds", str(args.seconds), "--rounds", "1",
              "--max-tokens", str(args.max_tokens), "--work-dir", str(work / "serving-work"), "-o", str(out)]
    command = supported(wanted, flags, notes, f"{tree.name} benchmarks.serving")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving", *command], cwd=tree, env=_env(tree),
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks.serving in {tree} failed with exit {proc.returncode}: {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else json.loads(proc.stdout)
    figures: dict[str, Any] = {}
    if "batching" in sections:
        figures["classification_images_per_s"] = result["batching"]["images_per_s"]["batched"]
    if "generation" in sections:
        gen = result["generation"]
        figures["generation_tokens_per_s"] = gen["c16"]["tokens_per_s"]
        figures["generation_tokens_per_s_by_streams"] = {c: gen[f"c{c}"]["tokens_per_s"] for c in (1, 4, 16)
                                                         if f"c{c}" in gen}
    return figures


# ---- the summary -----------------------------------------------------------------------------------------------


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per metric: each side's values and median, the ratio of medians head/base and the median per-round ratio."""
    out: dict[str, Any] = {}
    for metric, (what, higher_better) in METRICS.items():
        pairs = [(r["base"][metric], r["head"][metric]) for r in rounds
                 if r["base"].get(metric) is not None and r["head"].get(metric) is not None]
        if not pairs:
            continue
        base = [b for b, _ in pairs]
        head = [h for _, h in pairs]
        ratio = statistics.median(head) / statistics.median(base)
        out[metric] = {"what": what, "higher_is_better": higher_better, "base": base, "head": head,
                       "base_median": statistics.median(base), "head_median": statistics.median(head),
                       "ratio_of_medians": round(ratio, 4),
                       "median_of_ratios": round(statistics.median(h / b for b, h in pairs), 4),
                       "head_slower": ratio < 1 if higher_better else ratio > 1}
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'metric':<34} {'base median':>12} {'head median':>12} {'head/base':>10} {'median ratio':>13}"]
    for metric, s in summary.items():
        lines.append(f"{metric:<34} {s['base_median']:>12.2f} {s['head_median']:>12.2f} "
                     f"{s['ratio_of_medians']:>10.3f} {s['median_of_ratios']:>13.3f}")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare_revisions", description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the tree before the change: a revision, or a directory")
    p.add_argument("--head", default=str(ROOT), help="the tree after it: a directory (default: this working tree) "
                   "or a revision")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds: base first in odd ones, head first "
                   "in even ones")
    p.add_argument("--only", default="export,classification,generation",
                   help="comma-separated subset of export, classification, generation")
    p.add_argument("--seconds", type=float, default=10.0, help="the serving benchmark's seconds per load point")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens per generation request")
    p.add_argument("--export-preset", default="deit_small", help="the model the export times (headline: deit_small)")
    p.add_argument("-o", "--output", type=Path, default=Path("runs/compare_revisions.json"))
    args = p.parse_args(argv)
    parts = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = parts - {"export", "classification", "generation"}
    if unknown or not parts or args.rounds < 1 or args.seconds <= 0:
        p.error(f"--only takes export, classification, generation (got {args.only!r}); --rounds >= 1; --seconds > 0")
    sections = [s for s, part in (("batching", "classification"), ("generation", "generation")) if part in parts]
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        trees: dict[str, Path] = {}
        described: dict[str, str] = {}
        for side, spec in (("base", args.base), ("head", args.head)):
            trees[side], described[side] = stack.enter_context(materialise(spec, ROOT))
        work = {side: Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"multimax-compare-{side}.")))
                for side in SIDES}
        export_flags = {s: known_flags(trees[s], "export") for s in SIDES} if "export" in parts else {}
        serving_flags = {s: known_flags(trees[s], "benchmarks.serving") for s in SIDES} if sections else {}
        checkpoint = f"{args.export_preset}_multimax.pt"
        if "export" in parts:
            for side in SIDES:  # each tree makes its own checkpoint (the same seed): nothing timed
                subprocess.run([sys.executable, "-m", "models", "init", args.export_preset, "--multimax",
                                "attention,output", "--params", "paper", "-o", checkpoint], cwd=work[side],
                               env=_env(trees[side]), check=True, capture_output=True, timeout=1800)
        for side in SIDES:
            print(f"{side}: {described[side]}", file=sys.stderr)
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            row: dict[str, dict[str, Any]] = {}
            for side in order:
                figures: dict[str, Any] = {"load_average": os.getloadavg()[0]}
                if "export" in parts:
                    figures["export_s"] = export_once(trees[side], work[side], checkpoint, export_flags[side], notes)
                if sections:
                    figures |= serving_once(trees[side], work[side], sections, args, serving_flags[side], notes)
                row[side] = figures
                shown = "  ".join(f"{m} {figures[m]:.2f}" for m in METRICS if m in figures)
                print(f"round {r + 1} {side:<4} {shown}  (load {figures['load_average']:.1f})", file=sys.stderr,
                      flush=True)
            rounds.append(row)
    summary = summarise(rounds)
    result = {"command": " ".join(["python -m benchmarks.compare_revisions", *(argv if argv is not None
                                                                                 else sys.argv[1:])]),
              "base": described["base"], "head": described["head"], "rounds": rounds, "summary": summary,
              "settings": {"seconds": args.seconds, "max_tokens": args.max_tokens,
                           "export_preset": args.export_preset, "only": sorted(parts)},
              "notes": sorted(set(notes)), "python": sys.version.split()[0], "cpus": os.cpu_count()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    for note in sorted(set(notes)):
        print(f"note: {note}", file=sys.stderr)
    print(table(summary))
    print(f"written: {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
