"""The output layer's distribution when it is not softmax: SparseMax, EntMax-1.5 or Ev-SoftMax over the logits.

A model config's `output_function` (None: softmax, or MultiMax's modulation where `multimax_output`) names how
the logits become the distribution over classes or the vocabulary. The model still returns logits (and the
exported graph still outputs them); the function is applied where probabilities are needed: the training loss,
the server's classification probabilities, sampling and logprobs. Its forward is models.reweighting's reference.

Training losses, per function:
- sparsemax, entmax15: their Fenchel-Young losses (the `entmax` package's SparsemaxLoss / Entmax15Loss; the
  negative log-likelihood is infinite wherever the target gets weight 0). They take integer labels, so no label
  smoothing (the MultiMax paper makes the same point, section 5.1).
- evsoftmax: Chen et al. (2021)'s training-time relaxation ev-softmax_eps, p_i proportional to
  (1[x_i >= mean(x)] + eps) exp(x_i), with the negative log-likelihood; eps (EV_TRAIN_EPS) keeps every entry's
  gradient alive, and inference uses eps = 0 (the sparse function).

Other reweighting functions are refused at the output, with the reason (`NOT_AT_THE_OUTPUT`).
"""

from __future__ import annotations

import math
from typing import Any

import entmax
import torch
import torch.nn.functional as F
from torch import Tensor

from models import reweighting

OUTPUT_FUNCTIONS = ("sparsemax", "entmax15", "evsoftmax")
NOT_AT_THE_OUTPUT = {
    "softmax": "softmax is the output's default: leave output_function unset",
    "multimax": "MultiMax at the output is `multimax_output` (--multimax output)",
    "topk_softmax": "top-k at the output is top-k sampling: the completions' `top_k` parameter",
    "gaussian": "it has no training loss over classes (a window around the mean score, not a likelihood)",
    "laplacian": "it has no training loss over classes (a window around the mean score, not a likelihood)",
    "length_scaled": "over a fixed vocabulary its scale is a constant: a temperature",
}
EV_TRAIN_EPS = 1e-6  # Ev-SoftMax's training-time epsilon
# Where the distribution gives a token exactly 0, its logprob is reported as this (OpenAI's documented value for
# "very unlikely"): -inf is not JSON.
ZERO_LOGPROB = -9999.0


def check(name: str | None) -> str | None:
    """The canonical output function name (None: softmax); ValueError naming why for any other value."""
    if name is None:
        return None
    if name in NOT_AT_THE_OUTPUT:
        raise ValueError(f"output_function {name!r} is not offered: {NOT_AT_THE_OUTPUT[name]}")
    if name not in OUTPUT_FUNCTIONS:
        raise ValueError(f"unknown output_function {name!r}; expected one of {', '.join(OUTPUT_FUNCTIONS)}")
    return name


def normalise_config(config: Any) -> None:
    """Validate a config's `output_function` in place; it replaces MultiMax's output (`multimax_output` off)."""
    config.output_function = check(config.output_function)
    if config.output_function is not None:
        config.multimax_output = False


def _split(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(finite logits, additive mask): -inf logits (banned or filtered tokens) become masked entries."""
    neg = torch.isneginf(logits)
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    return torch.where(neg, zero, logits), torch.where(neg, torch.full_like(zero, -math.inf), zero)


def probabilities(name: str | None, logits: Tensor) -> Tensor:
    """The output distribution over the last axis; -inf logits get exactly 0."""
    if check(name) is None:
        return torch.softmax(logits, -1)
    fn = reweighting.FUNCTIONS[str(name)].fn
    assert fn is not None
    x, mask = _split(logits)
    return fn(x, mask, -1)


def log_probabilities(name: str | None, logits: Tensor) -> Tensor:
    """log of `probabilities`: -inf where the distribution gives exactly 0 (float64 in, float64 out)."""
    if name is None:
        return torch.log_softmax(logits, -1)
    return probabilities(name, logits).log()


def loss(name: str | None, logits: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean training loss of (N, C) logits against (N,) integer targets, for the output function `name`."""
    if name is None:
        return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)
    if label_smoothing:
        raise ValueError(f"the {name} output's loss takes integer labels: label smoothing must be 0")
    if name == "sparsemax":
        return entmax.SparsemaxLoss(reduction="elementwise_mean")(logits, targets)
    if name == "entmax15":
        return entmax.Entmax15Loss(reduction="elementwise_mean")(logits, targets)
    return F.nll_loss(ev_softmax_train_log(logits), targets)


def ev_softmax_train_log(logits: Tensor, eps: float = EV_TRAIN_EPS) -> Tensor:
    """log ev-softmax_eps (Chen et al. 2021): log((1[x >= mean] + eps) exp(x)) normalised over the last axis."""
    above = (logits >= logits.mean(-1, keepdim=True)).to(logits.dtype)
    z = logits + torch.log(above + eps)
    return z - torch.logsumexp(z, -1, keepdim=True)
