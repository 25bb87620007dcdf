"""Next tokens for the rows of one decode step, in tensor operations over the whole batch.

Per row, in this order (vLLM's): the row's logits processors (structured output), `logit_bias`, the eos ban
(`ignore_eos`, `min_tokens`), the penalties (repetition over prompt and generated tokens, as vLLM/HF: positive
logits divided, negative multiplied; presence and frequency over the generated tokens, as OpenAI), then
temperature, the model's output distribution (`output_function`), top-k, top-p, and one draw from the row's own
generator (seeded rows reproduce whatever else is in the batch). temperature 0 or top_p 0 is greedy: the argmax of
the logits after bias, ban and penalties (of the model's logits when there are none). Where sampling degenerates
(logits / temperature overflows, a nucleus that keeps nothing) the limit of the distribution is taken: greedy.

Only a row's own failure fails it (non-finite logits from the model, a processor that raises): the others are
sampled as if it were not there. The one host sync is reading the tokens back; processors run row by row (they
are Python), and only for the rows that have them.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from models.generate import NonFiniteLogits, as_output_logits
from models.output_function import ZERO_LOGPROB, log_probabilities

MAX_LOGIT_BIAS = 100.0  # OpenAI: a bias is in [-100, 100]


class LogitsProcessor(Protocol):
    """Changes one row's logits before sampling (a grammar's mask, ...): `generated` are the token ids generated so
    far for that row, `logits` its 1-D logits; returns the modified 1-D logits."""

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    stop: tuple[bytes, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # alternatives per token (0..5); None: no logprobs
    prompt_logprobs: bool = False  # echo with logprobs: the prompt's tokens too (needs the prefill's logits)
    rank: bool = False  # best_of: the cumulative logprob of the sampled tokens is wanted
    ignore_eos: bool = False  # eos is never drawn: the length is max_tokens (or a stop string)
    min_tokens: int = 0  # eos is never drawn, and stop strings not checked, before this many tokens
    repetition_penalty: float = 1.0  # > 1 discourages every token of the prompt and the generated text
    presence_penalty: float = 0.0  # subtracted once from each token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence of each token generated so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit
    processors: tuple[LogitsProcessor, ...] = field(default=(), compare=False)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.rank

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)


class ProcessorFailed(Exception):
    """A row's logits processor raised or returned something unusable (the row fails, the batch goes on)."""


class SamplerRow(Protocol):
    """What the sampler reads of one row of the batch."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def generator(self) -> torch.Generator: ...
    @property
    def prompt(self) -> Sequence[int]: ...
    @property
    def output_ids(self) -> Sequence[int]: ...  # token ids sampled so far (penalties, processors)
    @property
    def banned(self) -> Sequence[int]: ...  # ids never drawn at this step (eos before min_tokens, ignore_eos)


def new_generator(seed: int | None) -> torch.Generator:
    """A generator per sequence: its samples depend on its seed only, not on what else is in the batch."""
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed % 2**64)


def host_view(logits: torch.Tensor) -> np.ndarray | None:
    """The CPU float32/float64 logits as a numpy view (no copy), else None. The per-step reductions over the whole
    vocabulary (is every logit finite, the argmax) run in numpy: on the sampler's one thread torch takes 13-130 us
    for (1..16, 4096) where numpy takes 2-7 us (measured; a small model's decode step is 0.1-0.3 ms)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64) or logits.requires_grad:
        return None
    return logits.numpy()


def _flat(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of every row, for one scatter into (B, V)."""
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(rows)), lengths), ids


def _apply_processors(logits: torch.Tensor, rows: Sequence[SamplerRow], errors: list[Exception | None]) -> None:
    for i, row in enumerate(rows):
        if not row.params.processors or errors[i] is not None:
            continue
        try:
            out = logits[i]
            for processor in row.params.processors:
                out = processor(list(row.output_ids), out)
                if not isinstance(out, torch.Tensor) or out.shape != logits[i].shape:
                    raise ValueError(f"a logits processor returned "
                                     f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}, "
                                     f"not logits of shape {tuple(logits[i].shape)}")
            out = out.to(logits.dtype)
            if bool(torch.isnan(out).any() | (out == float("inf")).any()) or not bool(torch.isfinite(out).any()):
                raise ValueError("a logits processor left no finite logit (or gave NaN / +inf)")
            logits[i] = out
        except Exception as exc:  # this row's processor failed: the row ends, its batch-mates go on
            errors[i] = ProcessorFailed(f"logits processor failed on this sequence: {type(exc).__name__}: {exc}"[:300])
            logits[i] = 0.0


def _bias_and_ban(logits: torch.Tensor, rows: Sequence[SamplerRow], errors: list[Exception | None]) -> None:
    vocab = logits.shape[-1]
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias and errors[i] is None]
    if biased:
        bias = torch.zeros_like(logits)
        for i in biased:
            pairs = rows[i].params.logit_bias
            ids = [t for t, _ in pairs]
            if any(not 0 <= t < vocab for t in ids):
                errors[i] = ValueError(f"logit_bias names a token outside the vocabulary of {vocab}")
                continue
            bias[i, ids] = torch.tensor([b for _, b in pairs], dtype=logits.dtype)
        logits += bias
    banned = [r.banned for r in rows]
    if any(banned):
        where, banned_ids = _flat(banned)
        logits[where, banned_ids] = float("-inf")


def _penalize(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> None:
    """Penalties of every row at once; a row without them gets the identity (x / 1, x - 0: exact)."""
    params = [r.params for r in rows]
    if not any(p.penalized for p in params):
        return
    where, ids = _flat([r.output_ids for r in rows])
    counts = torch.zeros_like(logits).index_put_((where, ids), torch.ones_like(ids, dtype=logits.dtype),
                                                 accumulate=True)
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)[:, None]
    if bool((rep != 1).any()):
        where_p, ids_p = _flat([r.prompt for r in rows])
        seen = counts > 0
        seen[where_p, ids_p] = True
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)[:, None]
    logits -= freq * counts + presence * (counts > 0)


def adjusted_logits(logits: torch.Tensor, rows: Sequence[SamplerRow],
                    ) -> tuple[torch.Tensor, list[Exception | None]]:
    """The logits (B, V) after each row's processors, logit_bias, eos ban and penalties (what greedy takes the
    argmax of, and temperature scales; a float64 copy where anything changes them, else `logits` themselves),
    and each row's error."""
    logits = logits.detach().cpu()
    host = host_view(logits)
    finite = torch.from_numpy(np.isfinite(host).all(-1)) if host is not None else torch.isfinite(logits).all(-1)
    errors: list[Exception | None] = [None] * len(rows)
    all_finite = bool(finite.all())
    params = [r.params for r in rows]
    if all_finite and not any(p.processors or p.logit_bias or p.penalized for p in params):
        if not any(r.banned for r in rows):
            return logits, errors  # the common path: nothing to change, nothing copied
        return _banned_only(logits, rows, errors), errors
    logits = logits.to(torch.float64, copy=True)
    if not all_finite:
        for i in torch.nonzero(~finite)[:, 0].tolist():
            errors[i] = NonFiniteLogits("the model produced non-finite logits for this sequence")
        logits[~finite] = 0.0  # keep the batch's arithmetic finite
    _apply_processors(logits, rows, errors)
    _bias_and_ban(logits, rows, errors)
    _penalize(logits, rows)
    # a processor may allow only tokens the eos ban then removes (eos alone, before min_tokens): nothing to draw
    for i in torch.nonzero(~(logits > float("-inf")).any(-1))[:, 0].tolist():
        if errors[i] is None:
            errors[i] = ProcessorFailed("no token left to sample: the logits processors and the eos ban exclude "
                                        "every token")
    return logits, errors


def _banned_only(logits: torch.Tensor, rows: Sequence[SamplerRow], errors: list[Exception | None]) -> torch.Tensor:
    """The eos ban alone (ignore_eos, before min_tokens: every decode step of such streams): one masked copy in the
    logits' own dtype instead of the general float64 path (about 5x cheaper a step; the argmax and the draw, which
    works in float64 anyway, see the same numbers)."""
    vocab = logits.shape[-1]
    exact = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()  # bf16/fp16: exact in fp32
    out = exact.numpy().copy()  # numpy's indexing costs microseconds where torch's costs tens (CPU tensors here)
    seen: dict[tuple[int, ...], list[int]] = {}  # rows banning the same ids (usually all): one scatter each
    for i, r in enumerate(rows):
        if r.banned:
            seen.setdefault(tuple(r.banned), []).append(i)
    for ids, where in seen.items():
        out[np.ix_(where, ids)] = -np.inf
        if len(set(ids)) >= vocab:  # nothing left to draw (a vocabulary of end ids only)
            for i in where:
                errors[i] = ProcessorFailed("no token left to sample: the logits processors and the eos ban "
                                            "exclude every token")
    return torch.from_numpy(out)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """No intra-op threads for the sampler's small tensors on this (the model's worker) thread: a (B, V) op may
    start an OpenMP parallel region, whose threads then spin and take the CPU from the model's own threads
    (measured: with 2 threads, 4 streams' inter-token latency 5.1 ms, with 1 thread 0.97 ms). The setting is
    this thread's (OpenMP's is per thread) and is restored at once; the pair costs about 1 us."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sample(logits: torch.Tensor | np.ndarray, rows: Sequence[SamplerRow], output_function: str | None = None,
           ) -> tuple[list[int], list[Exception | None]]:
    """Next token of each row from `logits` (B, V), a tensor or the numpy array an onnxruntime step returned, and
    each row's error (None where it was sampled; a failed row's token is meaningless)."""
    if isinstance(logits, np.ndarray):
        host = logits if logits.dtype in (np.float32, np.float64) else None
        tensor = None
    else:
        host, tensor = host_view(logits), logits
    plain = _plain_greedy(host, rows)
    if plain is not None:
        return plain
    if tensor is None:
        tensor = torch.from_numpy(np.ascontiguousarray(logits))
    with _one_thread():
        return _sample(tensor, rows, output_function)


def _plain_greedy(host: np.ndarray | None, rows: Sequence[SamplerRow],
                  ) -> tuple[list[int], list[Exception | None]] | None:
    """The common step of greedy rows with nothing but an eos ban (temperature or top_p 0; no processors, bias or
    penalties; finite logits) in a few numpy calls, else None (the general path). Right after a model step the
    interpreter's and libraries' code is out of the CPU's caches and every call costs several times what it costs
    warm (measured after an onnxruntime step of the demo LLM: the general path's adjusted_logits 76 us, 28 us when
    called again at once): this path makes a handful of calls where the general one makes dozens. Its tokens are
    the general path's: the argmax with the banned ids removed (only recomputed when the argmax is banned), the
    first of equal maxima. `host`: the logits as float32/float64 numpy (None: not on the host as such)."""
    for r in rows:
        p = r.params
        if (p.temperature > 0 and p.top_p > 0) or p.processors or p.logit_bias or p.penalized:
            return None
    if host is None or not np.isfinite(host).all():
        return None  # the general path names the rows that failed
    tokens: list[int] = host.argmax(-1).tolist()
    for i, r in enumerate(rows):
        if r.banned and tokens[i] in r.banned:
            allowed = host[i].copy()
            allowed[list(r.banned)] = -np.inf
            if not (allowed > -np.inf).any():
                return None  # nothing left to draw: the general path fails the row
            tokens[i] = int(allowed.argmax())
    return tokens, [None] * len(rows)


def _sample(logits: torch.Tensor, rows: Sequence[SamplerRow], output_function: str | None,
            ) -> tuple[list[int], list[Exception | None]]:
    logits, errors = adjusted_logits(logits, rows)
    host = host_view(logits)
    # greedy, and where sampling degenerates (numpy's argmax, like torch's, takes the first of equal maxima)
    tokens = torch.from_numpy(host.argmax(-1)) if host is not None else logits.argmax(-1)
    drawing = [i for i, (r, e) in enumerate(zip(rows, errors, strict=True))
               if r.params.temperature > 0 and r.params.top_p > 0 and e is None]
    if drawing:
        subset = logits if len(drawing) == len(rows) else logits[drawing]
        drawn = _draw(subset, [rows[i] for i in drawing], output_function, tokens[drawing])
        if len(drawing) == len(rows):
            tokens = drawn
        else:
            tokens[drawing] = drawn
    return tokens.tolist(), errors


def _draw(logits: torch.Tensor, rows: Sequence[SamplerRow], output_function: str | None,
          greedy: torch.Tensor) -> torch.Tensor:
    """One draw per row (all of them sample: temperature > 0, top_p > 0), in float64; `greedy` where sampling
    degenerates."""
    params = [r.params for r in rows]
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64)[:, None]
    scaled = logits.double() / temperature
    # temperature -> 0: logits / temperature leaves the finite range; the distribution tends to the argmax
    degenerate = (~torch.isfinite(scaled) & (logits > float("-inf"))).any(-1)
    scaled = torch.where(degenerate[:, None], logits.double(), scaled)
    out = as_output_logits(output_function, scaled)
    k = [min(p.top_k or vocab, vocab) for p in params]
    if max(k) == vocab and all(p.top_p >= 1 for p in params):  # no filter: draw in vocabulary order, no sort
        ordered, order = out, None
    elif max(k) < vocab and all(p.top_p >= 1 for p in params):
        ordered, order = torch.topk(out, max(k), dim=-1)  # top-k alone: the best k of each row suffice
    else:  # top-p: the whole vocabulary in descending order
        ordered, order = torch.sort(out, descending=True, dim=-1)
    if order is not None:
        kth = ordered.gather(-1, (torch.tensor(k) - 1)[:, None])
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # ties at the k-th value survive
        top_p = torch.tensor([p.top_p if p.top_p < 1 else float("inf") for p in params],
                             dtype=torch.float64)[:, None]
        probs = ordered.softmax(-1)
        ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))  # the top one stays
    probs = ordered.softmax(-1)
    ok = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
    probs = torch.where(ok[:, None], probs, 0.0)
    cdf = probs.cumsum(-1)
    u = torch.stack([torch.rand((), generator=r.generator, dtype=torch.float64) for r in rows])  # each its own
    pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # rounding at the top end of the cdf never picks a token of probability 0: the last one that has any
    last_kept = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    pos = torch.minimum(pos, last_kept)
    drawn = pos if order is None else order.gather(-1, pos[:, None])[:, 0]
    return torch.where(~degenerate & ok, drawn, greedy)


@dataclass
class _OneRow:
    params: SamplingParams
    generator: torch.Generator
    prompt: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    banned: Sequence[int] = ()


def sample_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
                 generator: torch.Generator | None = None, banned: Sequence[int] = (),
                 output_function: str | None = None) -> int:
    """One row's next token from `logits` (V,), the parameters in `models.generate.sample_next`'s order; raises
    NonFiniteLogits for logits that are not finite."""
    row = _OneRow(SamplingParams(1, temperature=temperature, top_k=top_k, top_p=top_p),
                  generator or new_generator(None), banned=banned)
    tokens, errors = sample(logits[None], [row], output_function)
    if errors[0] is not None:
        raise errors[0]
    return tokens[0]


TopLogprobs = dict[int, float]  # token id -> logprob


@dataclass
class TokenLogprobs:
    """Raw model logprobs (log of the model's output distribution, softmax or its `output_function`, before
    processors, bias, penalties, temperature/top-k/top-p and the eos ban) of chosen tokens, with the `top` most
    likely alternatives of each position. A token the distribution gives exactly 0 has
    models.output_function.ZERO_LOGPROB."""

    chosen: list[float | None] = field(default_factory=list)
    top: list[TopLogprobs | None] = field(default_factory=list)

    def since(self, start: int) -> TokenLogprobs:
        """The entries from position `start` on (a copy)."""
        return TokenLogprobs(self.chosen[start:], self.top[start:])

    def truncate(self, n: int) -> None:
        del self.chosen[n:], self.top[n:]


def token_logprobs(
    logits: torch.Tensor, token: int, top: int, output_function: str | None = None
) -> tuple[float, TopLogprobs]:
    """The raw logprob of `token` under `logits` (V,), and the `top` best alternatives (the chosen token added
    when it is not among them, as vLLM does)."""
    lp = log_probabilities(output_function, logits.double()).clamp(min=ZERO_LOGPROB)  # no -inf into the JSON
    alternatives: TopLogprobs = {}
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]))
        alternatives = dict(zip(ids.tolist(), values.tolist(), strict=True))
    chosen = float(lp[token])
    alternatives.setdefault(token, chosen)
    return chosen, alternatives
