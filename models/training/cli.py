"""`python -m models.training`: train the demo models, run the demo, plot learned MultiMax modulations, compare
reweighting functions.

Errors behave as in `python -m models`: one line on stderr and exit code 2, nothing written unless the
command finished.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from models import checkpoint as ckpt_io
from models.cli import (
    PLACES,
    UsageError,
    add_function_args,
    add_load_hints,
    function_overrides,
    load_hints,
    parse_places,
    run,
)
from models.demo import DEMO_DIR
from models.training.demo import build_demos, run_demo, text_checkpoint, vision_checkpoint


def parse_seeds(text: str) -> list[int]:
    """`--seeds 1,2`: comma-separated non-negative integers."""
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers, e.g. 1,2") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: one or more non-negative integers, e.g. 1,2")
    return seeds


def cmd_train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads) if args.threads else None
    functions = function_overrides(args)
    if args.task == "demos":
        if functions:
            raise UsageError("train demos trains the shipped MultiMax/softmax models; use train vision|text for others")
        kinds = (args.only,) if args.only else ("vision", "text", "llm")
        report = build_demos(Path(args.output or DEMO_DIR), seed=args.seed, progress=not args.quiet, kinds=kinds)
        print(json.dumps(report, indent=2))
        return 0
    if not args.output:
        raise UsageError("train vision|text|llm needs -o FILE (llm: a directory)")
    if args.task == "llm":
        if functions or args.multimax != PLACES or args.epochs:
            raise UsageError("train llm trains the demo LLM's recipe (SegLU head); --multimax, --epochs and the "
                             "function options do not apply")
        from models.training.llm import save_llm, train_llm

        kwargs = {"steps": args.steps} if args.steps else {}
        llm = train_llm(seed=args.seed, progress=not args.quiet, **kwargs)
        out_dir = save_llm(llm, Path(args.output))
        print(json.dumps({"folder": str(out_dir), **llm["metrics"], "samples_greedy": llm["samples_greedy"]},
                         indent=2))
        return 0
    if args.task == "vision":
        from models.training.vision import train_vision

        kwargs = {"epochs": args.epochs} if args.epochs else {}
        result = train_vision(multimax=args.multimax, seed=args.seed, progress=not args.quiet, **functions, **kwargs)
        ckpt = vision_checkpoint(result)
    else:
        from models.training.text import train_text

        kwargs = {"steps": args.steps} if args.steps else {}
        result = train_text(multimax=args.multimax, seed=args.seed, progress=not args.quiet, **functions, **kwargs)
        ckpt = text_checkpoint(result)
    out = ckpt_io.save_checkpoint(ckpt, args.output)
    print(json.dumps({"checkpoint": str(out), **ckpt.meta}, indent=2))
    return 0


def cmd_plot_sigma(args: argparse.Namespace) -> int:
    from models.training.plot import learned_modulations, plot_sigma

    ckpt, _ = ckpt_io.parse(ckpt_io.read_file(args.checkpoint), args.checkpoint, **load_hints(args))
    mods = learned_modulations(ckpt.state_dict, ckpt.config.get("variant", "second"))
    if not mods:
        raise UsageError(f"{args.checkpoint}: no MultiMax parameters to plot (a softmax model)")
    out = plot_sigma(mods, args.output, title=f"learned MultiMax modulation: {Path(args.checkpoint).name}")
    print(f"wrote {out} ({len(mods)} panels: {', '.join(m.name for m in mods)})")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from models.training.compare import ALL, compare, table

    results = Path(args.output)
    if args.table:
        if not results.is_file():
            raise UsageError(f"{results}: no results yet (run compare first)")
        data = json.loads(results.read_text())
        print(table(data))
        _plot(data, args.plot)
        return 0
    names = [n.strip() for n in args.functions.split(",") if n.strip()] if args.functions else list(ALL)
    checkpoints = Path(args.checkpoints) if args.checkpoints else None
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        data = compare(names, results, epochs=args.epochs, seed=args.seed, checkpoints=checkpoints,
                       progress=not args.quiet, retrain_twins=args.retrain_twins, extra_seeds=args.seeds)
    finally:
        torch.set_num_threads(threads)  # called in-process (tests): leave the caller's setting
    print(table(data))
    _plot(data, args.plot)
    return 0


def _plot(data: dict[str, Any], out: str | None) -> None:
    if out:
        from models.training.compare_plot import plot_seed_accuracies

        print(f"wrote {plot_seed_accuracies(data, out)}")


def cmd_plot_simplex(args: argparse.Namespace) -> int:
    from models.training.simplex_plot import plot_simplex

    print(f"wrote {plot_simplex(args.output)}")
    return 0


def cmd_plot_drawn(args: argparse.Namespace) -> int:
    from models.training.drawn_digits import sample_grid

    out = Path(args.output)
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent}: no such directory")
    sample_grid(str(out))
    print(f"wrote {out} (the first 10 drawings of each digit in the drawn test set)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(Path(args.dir), rebuild=args.rebuild)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.training", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a demo model on offline data")
    p.add_argument("task", choices=("vision", "text", "llm", "demos"),
                   help="llm = the demo LLM (Hugging Face folder); demos = all four demo models")
    p.add_argument("-o", "--output", help="checkpoint file (a directory for 'llm' and 'demos')")
    p.add_argument("--multimax", type=parse_places, default=PLACES, help="attention,output | none (softmax twin)")
    add_function_args(p)
    p.add_argument("--epochs", type=int, help="vision epochs")
    p.add_argument("--steps", type=int, help="text / llm optimisation steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--only", choices=("vision", "text", "llm"),
                   help="demos: retrain only these models (report.json kept)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plot-sigma", help="plot the learned sigma of every layer (paper Figure 3)")
    p.add_argument("checkpoint")
    p.add_argument("-o", "--output", default="sigma.png")
    add_load_hints(p)
    p.set_defaults(func=cmd_plot_sigma)

    p = sub.add_parser("compare", help="train the digits demo with every attention reweighting function")
    p.add_argument("-o", "--output", default="docs/reweighting_results.json", help="results JSON (resumed)")
    p.add_argument("--functions", help="comma-separated subset (default: all, in the table's order)")
    p.add_argument("--epochs", type=int, help="budget (default: the shipped twins' 120)")
    p.add_argument("--seed", type=int, default=0, help="the main seed (the table's accuracy and metrics)")
    p.add_argument("--seeds", type=parse_seeds, default=[], metavar="N,N",
                   help="also train every function with these seeds (the table adds mean ± sd over all seeds)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the shipped twins)")
    p.add_argument("--checkpoints", help="also save each trained model into this directory")
    p.add_argument("--table", action="store_true", help="only print the Markdown table of the results so far")
    p.add_argument("--plot", metavar="PNG", help="also draw each function's accuracy per seed and its step cost")
    p.add_argument("--retrain-twins", action="store_true",
                   help="train the MultiMax/softmax twins here too (timed like the others), not read the shipped ones")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("plot-simplex", help="every reweighting function on the same inputs (paper Figure 1)")
    p.add_argument("-o", "--output", default="docs/reweighting_simplex.png")
    p.set_defaults(func=cmd_plot_simplex)

    p = sub.add_parser("plot-drawn", help="a grid of the drawn test digits (models.training.drawn_digits)")
    p.add_argument("-o", "--output", default="docs/drawn_digits.png")
    p.set_defaults(func=cmd_plot_drawn)

    p = sub.add_parser("demo", help="classify held-out digits and generate text with the demo models")
    p.add_argument("--dir", default=str(DEMO_DIR), help="where the demo checkpoints live")
    p.add_argument("--rebuild", action="store_true", help="train the demo models again first")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)
