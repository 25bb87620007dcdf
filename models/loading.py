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


def check_keys(
    expected: Mapping[str, tuple[int, ...]], state_dict: Mapping[str, object], source: str = "checkpoint"
) -> None:
    """Fail on the first key that does not fit, naming it and both shapes.

    torch's strict load reports every problem in a multi-line dump; users need the first key that
    does not fit and both shapes, and never a silent partial load.
    """
    for key, shape in expected.items():
        if key not in state_dict:
            raise CheckpointError(f"{source}: missing key {key} (the model expects shape {shape})")
    for key, value in state_dict.items():
        if key not in expected:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(f"{source}: unexpected key {key} with shape {got} (no such parameter)")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{source}: key {key} holds {type(value).__name__}, not a tensor")
        if tuple(value.shape) != tuple(expected[key]):
            got = tuple(value.shape)
            raise CheckpointError(f"{source}: key {key} has shape {got}, the model expects {tuple(expected[key])}")


def load_exact(model: nn.Module, state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Load every tensor or raise CheckpointError (see `check_keys`)."""
    check_keys({k: tuple(v.shape) for k, v in model.state_dict().items()}, state_dict, source)
    model.load_state_dict(dict(state_dict), strict=True)
