"""`python -m models`: inspect, create, train and plot MultiMax checkpoints.

Every user error (missing or broken file, unknown preset, bad flag) is one line on stderr and exit
code 2; nothing is written unless the command finished.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from models import checkpoint as ckpt_io
from models import deit, registry
from models.demo import DEMO_DIR, build_demos, run_demo, text_checkpoint, vision_checkpoint
from models.describe import describe, format_text
from models.loading import CheckpointError
from models.multimax import VARIANTS
from models.plot import learned_modulations, plot_sigma

PLACES = ("attention", "output")


class UsageError(Exception):
    """A bad command line detected after argparse (exit code 2)."""


def parse_places(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("", "none", "softmax"):
        return ()
    places = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in places if p not in PLACES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown MultiMax place(s) {unknown}; use attention,output or none")
    return places


def add_load_hints(p: argparse.ArgumentParser) -> None:
    """Flags for foreign checkpoints whose weights do not say everything (official / timm DeiT)."""
    g = p.add_argument_group("foreign checkpoints (official MultiMax / timm DeiT)")
    g.add_argument("--num-heads", type=int, help="attention heads (not stored in the weights)")
    g.add_argument("--preset", choices=sorted(deit.DEIT_PRESETS), help="take heads and LayerNorm eps from a preset")
    g.add_argument("--ln-eps", type=float, help="LayerNorm epsilon")
    g.add_argument("--variant", choices=VARIANTS, help="MultiMax variant, when the weights cannot tell")
    g.add_argument("--ema", action="store_true", help="load 'model_ema' from a DeiT training checkpoint")


def load_hints(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "num_heads": args.num_heads,
        "preset": args.preset,
        "ln_eps": args.ln_eps,
        "variant": args.variant,
        "use_ema": args.ema or None,
    }


def cmd_info(args: argparse.Namespace) -> int:
    model, ckpt, info = ckpt_io.load(args.checkpoint, **load_hints(args))
    d = describe(model, ckpt, info)
    print(json.dumps(d, indent=2, default=str) if args.json else format_text(d))
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    places = args.multimax
    common = {
        "multimax_attention": "attention" in places,
        "multimax_output": "output" in places,
        "variant": args.variant,
    }
    arch = registry.for_preset(args.preset)
    if arch is None:
        raise UsageError(f"unknown preset {args.preset!r}; known: {', '.join(registry.all_presets())}")
    overrides = common | {k: v for k in arch.init_options if (v := getattr(args, k))}
    config = arch.preset_config(args.preset, **overrides)
    model = arch.model(config)
    if args.params == "paper":
        arch.set_paper_params(model)
    ckpt = ckpt_io.Checkpoint(arch.name, config.to_dict(), model.state_dict(),
                              meta={"init": args.params, "seed": args.seed}, **arch.new_checkpoint_fields())
    out = ckpt_io.save_checkpoint(ckpt, args.output)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({args.preset}, {params / 1e6:.2f}M parameters, MultiMax {args.params} params)")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads) if args.threads else None
    if args.task == "demos":
        kinds = (args.only,) if args.only else ("vision", "text")
        report = build_demos(Path(args.output or DEMO_DIR), seed=args.seed, progress=not args.quiet, kinds=kinds)
        print(json.dumps(report, indent=2))
        return 0
    if not args.output:
        raise UsageError("train vision|text needs -o FILE")
    if args.task == "vision":
        from models.train_vision import train_vision

        kwargs = {"epochs": args.epochs} if args.epochs else {}
        result = train_vision(multimax=args.multimax, seed=args.seed, progress=not args.quiet, **kwargs)
        ckpt = vision_checkpoint(result)
    else:
        from models.train_text import train_text

        kwargs = {"steps": args.steps} if args.steps else {}
        result = train_text(multimax=args.multimax, seed=args.seed, progress=not args.quiet, **kwargs)
        ckpt = text_checkpoint(result)
    out = ckpt_io.save_checkpoint(ckpt, args.output)
    print(json.dumps({"checkpoint": str(out), **ckpt.meta}, indent=2))
    return 0


def cmd_plot_sigma(args: argparse.Namespace) -> int:
    ckpt, _ = ckpt_io.parse(ckpt_io.read_file(args.checkpoint), args.checkpoint, **load_hints(args))
    mods = learned_modulations(ckpt.state_dict, ckpt.config.get("variant", "second"))
    if not mods:
        raise UsageError(f"{args.checkpoint}: no MultiMax parameters to plot (a softmax model)")
    out = plot_sigma(mods, args.output, title=f"learned MultiMax modulation: {Path(args.checkpoint).name}")
    print(f"wrote {out} ({len(mods)} panels: {', '.join(m.name for m in mods)})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(Path(args.dir), rebuild=args.rebuild)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="print what the loader inferred from a checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_load_hints(p)
    p.set_defaults(func=cmd_info)

    presets = registry.all_presets()
    p = sub.add_parser("init", help="create a model from a preset (for tests and demos)")
    p.add_argument("preset", help=f"one of: {', '.join(presets)}")
    p.add_argument("--multimax", type=parse_places, default=PLACES, help="attention,output | attention | none")
    p.add_argument("--params", choices=("paper", "random"), default="paper", help="MultiMax parameters")
    p.add_argument("--variant", choices=VARIANTS, default="second")
    p.add_argument("--num-classes", type=int, help="DeiT classifier size (default 1000)")
    p.add_argument("--pool", choices=("avg", "token"), help="DeiT pooling (default avg, as the official code)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("train", help="train a demo model on offline data")
    p.add_argument("task", choices=("vision", "text", "demos"), help="demos = all three demo models")
    p.add_argument("-o", "--output", help="checkpoint file (a directory for 'demos')")
    p.add_argument("--multimax", type=parse_places, default=PLACES, help="attention,output | none (softmax twin)")
    p.add_argument("--epochs", type=int, help="vision epochs")
    p.add_argument("--steps", type=int, help="text optimisation steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--only", choices=("vision", "text"), help="demos: retrain only these models (report.json kept)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plot-sigma", help="plot the learned sigma of every layer (paper Figure 3)")
    p.add_argument("checkpoint")
    p.add_argument("-o", "--output", default="sigma.png")
    add_load_hints(p)
    p.set_defaults(func=cmd_plot_sigma)

    p = sub.add_parser("demo", help="classify held-out digits and generate text with the demo models")
    p.add_argument("--dir", default=str(DEMO_DIR), help="where the demo checkpoints live")
    p.add_argument("--rebuild", action="store_true", help="train the demo models again first")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (CheckpointError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        # Config validation (unknown preset, inconsistent sizes) raises ValueError with a user-facing line.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
