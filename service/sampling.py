"""One next token from one row of logits, for any sampling parameters the API accepts: it never raises on them.

`temperature` 0 and `top_p` 0 mean greedy. Every other value in range is honoured, computed in float64;
where the numbers still leave the finite range (a temperature so small that logits / temperature
overflows, a nucleus that keeps nothing) the limit of the distribution is taken, which is greedy.
Only logits that are themselves not finite (a model failure) raise, and then for this row alone.
"""

from __future__ import annotations

import torch

from models.gpt import top_k_filter, top_p_filter


class NonFiniteLogits(ValueError):
    """The model produced NaN or infinite logits for this sequence."""


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int | None,
                 generator: torch.Generator) -> int:
    """Token id from `logits` (V,); greedy for temperature 0 or top_p 0, and wherever sampling degenerates."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits("the model produced non-finite logits for this sequence")
    greedy = int(logits.argmax())
    if temperature <= 0 or top_p <= 0:
        return greedy
    scaled = logits.double() / temperature
    if not bool(torch.isfinite(scaled).all()):
        return greedy  # temperature -> 0: the distribution tends to the argmax
    scaled = scaled[None]
    if top_k is not None:
        scaled = top_k_filter(scaled, top_k)
    if top_p < 1:
        scaled = top_p_filter(scaled, top_p)
    probs = scaled.softmax(-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return greedy
    return int(torch.multinomial(probs, 1, generator=generator)[0, 0])
