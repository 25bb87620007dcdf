"""The project's checkpoint format, safe reading of any supported checkpoint, and model building.

Format `multimax/1` is a plain dict readable with `torch.load(weights_only=True)`:
    {"format": "multimax/1", "arch": "deit" | "gpt", "config": {...}, "state_dict": {...},
     "labels": [...] | None, "preprocess": {...} | None, "tokenizer": {...} | None, "meta": {...}}
Foreign layouts (official MultiMax DeiT, timm DeiT, DeiT training checkpoints) are adapted by the
model's load hook. Every failure is a `CheckpointError` with a one-line message.
"""

from __future__ import annotations

import argparse
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models import deit, fairseq_checkpoint, registry
from models.atomic import publish, staging_dir
from models.loading import CheckpointError, load_exact
from models.spec import ModelSpec

FORMAT = "multimax/1"
ARCHES = registry.names()

IMAGENET_PREPROCESS = deit.IMAGENET_PREPROCESS
# The command-line flag of each load hint, for messages.
HINT_FLAGS = {"num_heads": "--num-heads", "ln_eps": "--ln-eps", "qk_scale": "--qk-scale", "preset": "--preset",
              "variant": "--variant", "use_ema": "--ema", "dictionary": "--dict"}


@dataclass
class Checkpoint:
    """What a served or exported model needs, whatever file it came from."""

    arch: str
    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    labels: list[str] | None = None
    preprocess: dict[str, Any] | None = None
    tokenizer: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def spec(self) -> ModelSpec:
        """What the model takes and gives (models.spec), from its architecture's describe hook."""
        try:
            return registry.spec_of(self.arch, self.config, self.labels, self.preprocess, self.tokenizer)
        except KeyError as exc:
            raise CheckpointError(str(exc.args[0])) from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"invalid {self.arch} config: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "arch": self.arch,
            "config": self.config,
            "state_dict": self.state_dict,
            "labels": self.labels,
            "preprocess": self.preprocess,
            "tokenizer": self.tokenizer,
            "meta": self.meta,
        }


def save_checkpoint(ckpt: Checkpoint, path: str | os.PathLike[str]) -> Path:
    """Write atomically (see models.atomic): a reader sees the old file or the new one, never a part."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise CheckpointError(f"cannot write {path}: directory {directory} does not exist")
    state = {k: v.detach().cpu().contiguous() for k, v in ckpt.state_dict.items()}
    payload = ckpt.to_dict() | {"state_dict": state}
    try:
        with staging_dir(path) as staging:
            torch.save(payload, staging / path.name)
            publish(staging / path.name, path)
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def read_file(path: str | os.PathLike[str]) -> Any:
    """torch.load with weights_only=True, every failure turned into one clear line."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: empty file")
    try:
        # DeiT's and old fairseq's training scripts store an argparse.Namespace; building one runs no code.
        # fairseq's omegaconf configs become inert stand-ins (models.fairseq_checkpoint.SAFE_GLOBALS).
        with torch.serialization.safe_globals([argparse.Namespace, *fairseq_checkpoint.SAFE_GLOBALS]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "Unsupported global" in text or "GLOBAL" in text:
            culprit = text.split("GLOBAL", 1)[1].split()[0] if "GLOBAL" in text else "a Python object"
            raise CheckpointError(
                f"{path}: refused: the pickle asks to construct {culprit}; checkpoints are loaded with "
                "weights_only=True and may hold tensors and plain containers only"
            ) from None
        raise CheckpointError(f"{path}: not a PyTorch checkpoint ({_first_line(text)})") from None
    except Exception as exc:  # torch.load raises many types for damaged files; all mean "unusable"
        text = _first_line(str(exc) or type(exc).__name__)
        with open(path, "rb") as fh:
            is_zip = fh.read(4) == b"PK\x03\x04"  # torch.save's container: damaged rather than foreign
        if is_zip or isinstance(exc, EOFError):
            raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({text})") from None
        raise CheckpointError(f"{path}: not a PyTorch checkpoint ({text})") from None


def _first_line(text: str) -> str:
    """The first sentence of torch's (often multi-paragraph) message."""
    line = text.strip().splitlines()[0] if text.strip() else "unreadable"
    return line.split(". ")[0].rstrip(".")[:160]


def parse(obj: Any, source: str = "checkpoint", **hints: Any) -> tuple[Checkpoint, dict[str, Any]]:
    """Turn what `read_file` returned into a Checkpoint plus a description of how it was read.

    `hints` go to foreign-layout load hooks (num_heads, ln_eps, preset, variant, use_ema; dictionary for fairseq);
    the hooks also get `source`, the checkpoint's path (a fairseq model's dict.txt lies beside it).
    """
    if isinstance(obj, dict) and "format" in obj:
        flags = [HINT_FLAGS.get(k, k) for k, v in hints.items() if v is not None and v is not False]
        if flags:  # silently ignoring them would let a user believe they changed the model
            raise CheckpointError(f"{source}: {', '.join(flags)} apply to foreign checkpoints (official / timm DeiT); "
                                  "this file is in the project's format and stores its config")
        return _parse_own(obj, source)
    arch = registry.for_foreign(obj) if isinstance(obj, dict) and obj else None
    if arch is not None and arch.adapt_checkpoint is not None:
        given = {k: v for k, v in hints.items() if v is not None}
        config, state_dict, info = arch.adapt_checkpoint(obj, source=source, **given)
        ckpt = Checkpoint(
            arch=arch.name,
            config=config.to_dict(),
            state_dict=state_dict,
            labels=None,
            meta={"source_layout": info.get("layout")},
            **arch.foreign_fields(config, info),
        )
        return ckpt, {"format": info.get("layout", arch.name), **{k: v for k, v in info.items() if k != "tokenizer"}}
    if isinstance(obj, dict):
        keys = ", ".join(list(map(str, obj))[:5])
        raise CheckpointError(f"{source}: unknown checkpoint layout (top-level keys: {keys or 'none'})")
    raise CheckpointError(f"{source}: holds a {type(obj).__name__}, not a checkpoint dict")


def _parse_own(obj: dict[str, Any], source: str) -> tuple[Checkpoint, dict[str, Any]]:
    if obj.get("format") != FORMAT:
        raise CheckpointError(f"{source}: unsupported format {obj.get('format')!r} (this version reads {FORMAT})")
    arch = obj.get("arch")
    if arch not in registry.names():  # asked now: an architecture may be registered after this module's import
        raise CheckpointError(f"{source}: unknown architecture {arch!r} (known: {', '.join(registry.names())})")
    for key, kind in (("config", dict), ("state_dict", dict)):
        if not isinstance(obj.get(key), kind):
            raise CheckpointError(f"{source}: field {key!r} is missing or not a {kind.__name__}")
    ckpt = Checkpoint(
        arch=arch,
        config=obj["config"],
        state_dict=obj["state_dict"],
        labels=obj.get("labels"),
        preprocess=obj.get("preprocess"),
        tokenizer=obj.get("tokenizer"),
        meta=obj.get("meta") or {},
    )
    return ckpt, {"format": FORMAT}


def config_of(ckpt: Checkpoint) -> Any:
    try:
        arch = registry.get(ckpt.arch)
    except KeyError as exc:
        raise CheckpointError(str(exc.args[0])) from None
    try:
        return arch.config(ckpt.config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"invalid {ckpt.arch} config: {exc}") from None


def build_model(ckpt: Checkpoint, source: str = "checkpoint") -> nn.Module:
    """Construct the model for `ckpt` and load every weight exactly; returns it in eval mode."""
    config = config_of(ckpt)
    model = registry.get(ckpt.arch).model(config)
    load_exact(model, ckpt.state_dict, source)
    return model.eval()


def load(path: str | os.PathLike[str], **hints: Any) -> tuple[nn.Module, Checkpoint, dict[str, Any]]:
    """Read any supported checkpoint file and return (model, checkpoint, how it was read)."""
    ckpt, info = parse(read_file(path), str(path), **hints)
    return build_model(ckpt, str(path)), ckpt, info
