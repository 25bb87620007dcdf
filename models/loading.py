"""Shared pieces of checkpoint loading: the user-facing error and an exact state-dict load."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

# Wrappers that DDP, torch.compile and EMA helpers put in front of every key.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message is one line meant for the user."""


def strip_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove `module.` / `_orig_mod.` wrappers (in any nesting order) from every key."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key = key[len(prefix):]
                    changed = True
        out[key] = value
    return out


def _short(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def load_exact(model: nn.Module, state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Load every tensor or fail with a message naming the offending keys and shapes.

    torch's strict load reports all problems in a multi-line dump; users need the first key that
    does not fit and both shapes, and never a silent partial load.
    """
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing key(s) {_short(missing)}")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected key(s) {_short(unexpected)}")
    for key, tensor in expected.items():
        got = state_dict[key]
        if not isinstance(got, torch.Tensor):
            raise CheckpointError(f"{source}: key {key} holds {type(got).__name__}, not a tensor")
        if tuple(got.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{source}: key {key} has shape {tuple(got.shape)}, the model expects {tuple(tensor.shape)}"
            )
    model.load_state_dict(dict(state_dict), strict=True)
