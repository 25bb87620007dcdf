"""`python -m models`: inspect and create MultiMax checkpoints.

Training the demo models, the demonstration and the plots are `python -m models.training` (the `train`
extra): this command line imports no training or plotting code.

Every user error (missing or broken file, unknown preset, bad flag) is one line on stderr and exit
code 2; nothing is written unless the command finished.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Any

import torch

from models import checkpoint as ckpt_io
from models import deit, registry
from models.describe import describe, describe_folder, format_folder_text, format_text
from models.hf_folder import is_model_folder, load_folder
from models.labels import read_labels
from models.loading import CheckpointError
from models.multimax import VARIANTS
from models.output_function import OUTPUT_FUNCTIONS
from models.reweighting import FUNCTIONS

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


def parse_option(text: str) -> tuple[str, float]:
    """KEY=NUMBER, e.g. k=4 or eps=0.05."""
    key, sep, value = text.partition("=")
    try:
        if not sep or not key.strip():
            raise ValueError
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=NUMBER (e.g. k=4), got {text!r}") from None


def add_function_args(p: argparse.ArgumentParser) -> None:
    """--attention-function and its --attention-option KEY=NUMBER (models.reweighting)."""
    p.add_argument("--attention-function", choices=list(FUNCTIONS),
                   help="attention reweighting (default: MultiMax where --multimax has attention, else softmax)")
    p.add_argument("--attention-option", type=parse_option, action="append", default=[], metavar="KEY=NUMBER",
                   help="the function's hyperparameter, repeatable: k (topk_softmax), eps and m (length_scaled)")
    p.add_argument("--output-function", choices=OUTPUT_FUNCTIONS,
                   help="the output distribution instead of softmax (replaces MultiMax's output; trained with its "
                   "own loss, without label smoothing)")


def function_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the function flags set (none when not given)."""
    options = dict(args.attention_option or [])
    if options and not args.attention_function:
        raise UsageError("--attention-option needs --attention-function")
    out: dict[str, Any] = {}
    if args.attention_function:
        out["attention_function"] = args.attention_function
        out["attention_options"] = options or None
    if getattr(args, "output_function", None):
        out["output_function"] = args.output_function
    return out


def parse_scale(text: str) -> float:
    """A positive number, or N**-0.5 / N^-0.5 (e.g. 768**-0.5, timm's vit_small_patch16_224 pretrained scale)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(?:\*\*|\^)\s*-0\.5\s*", text)
    try:
        value = float(m.group(1)) ** -0.5 if m else float(text)
    except (ValueError, ZeroDivisionError):
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number or N**-0.5, got {text!r}")
    return value


def add_load_hints(p: argparse.ArgumentParser) -> None:
    """Flags for foreign checkpoints whose weights do not say everything (official / timm DeiT)."""
    g = p.add_argument_group("foreign checkpoints (official MultiMax / timm DeiT, fairseq language models)")
    g.add_argument("--num-heads", type=int, help="attention heads (not stored in the weights)")
    g.add_argument("--preset", choices=list(deit.DEIT_PRESETS),
                   help="take heads, LayerNorm eps (and attention scale) from a preset")
    g.add_argument("--ln-eps", type=float, help="LayerNorm epsilon (DeiT: 1e-6; nn.LayerNorm's default: 1e-5)")
    g.add_argument("--qk-scale", type=parse_scale, metavar="SCALE",
                   help="attention scale, e.g. 768**-0.5 (default: head_dim**-0.5)")
    g.add_argument("--variant", choices=VARIANTS, help="MultiMax variant, when the weights cannot tell")
    g.add_argument("--ema", action="store_true", help="load 'model_ema' from a DeiT training checkpoint")
    g.add_argument("--dict", dest="dictionary", metavar="PATH",
                   help="a fairseq language model's dict.txt (default: dict.txt beside the checkpoint)")


def load_hints(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "num_heads": args.num_heads,
        "preset": args.preset,
        "ln_eps": args.ln_eps,
        "qk_scale": args.qk_scale,
        "variant": args.variant,
        "use_ema": args.ema or None,
        "dictionary": args.dictionary,
    }


def cmd_info(args: argparse.Namespace) -> int:
    if is_model_folder(args.checkpoint):  # a Hugging Face ForCausalLM folder (Llama, Qwen2, Qwen3)
        llm, folder = load_folder(args.checkpoint)
        d = describe_folder(llm, folder)
        print(json.dumps(d, indent=2, default=str) if args.json else format_folder_text(d))
        return 0
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
    overrides = common | {k: v for k in arch.init_options if (v := getattr(args, k))} | function_overrides(args)
    config = arch.preset_config(args.preset, **overrides)
    fields = arch.new_checkpoint_fields()
    if args.labels is not None:
        if arch.task != registry.VISION:
            raise UsageError(f"--labels is for image classifiers; {args.preset} is a {arch.task} model")
        fields["labels"] = read_labels(args.labels, config.num_classes)
    model = arch.model(config)
    if args.params == "paper":
        arch.set_paper_params(model)
    ckpt = ckpt_io.Checkpoint(arch.name, config.to_dict(), model.state_dict(),
                              meta={"init": args.params, "seed": args.seed}, **fields)
    out = ckpt_io.save_checkpoint(ckpt, args.output)
    params = sum(p.numel() for p in model.parameters())
    fn, out_fn = config.attention_function, config.output_function
    what = f"MultiMax {args.params} params" if config.multimax_attention or config.multimax_output else "no MultiMax"
    what += (f", attention {fn}" if fn else "") + (f", output {out_fn}" if out_fn else "")
    print(f"wrote {out} ({args.preset}, {params / 1e6:.2f}M parameters, {what})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="print what the loader inferred from a checkpoint or a Hugging Face model folder")
    p.add_argument("checkpoint", help="a checkpoint file, or a folder with config.json, weights and tokenizer.json")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_load_hints(p)
    p.set_defaults(func=cmd_info)

    presets = registry.all_presets()
    p = sub.add_parser("init", help="create a model from a preset (for tests and demos)")
    p.add_argument("preset", help=f"one of: {', '.join(presets)}")
    p.add_argument("--multimax", type=parse_places, default=PLACES, help="attention,output | attention | none")
    p.add_argument("--params", choices=("paper", "random"), default="paper", help="MultiMax parameters")
    p.add_argument("--variant", choices=VARIANTS, default="second")
    add_function_args(p)
    p.add_argument("--num-classes", type=int, help="DeiT classifier size (default 1000)")
    p.add_argument("--pool", choices=("avg", "token"), help="DeiT pooling (default avg, as the official code)")
    p.add_argument("--labels", metavar="FILE", help="class names: one a line, a JSON list or an ImageNet class "
                   "index (default: none; the server names classes by index)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_init)

    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse `argv` and run the chosen command: user errors are one line on stderr and exit code 2."""
    args = parser.parse_args(argv)
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
