"""The batched sampler (service.engine.text.sampler): penalties, logit_bias and processors against direct computations
on known logits, greedy exactness, seeded rows that do not depend on their batch-mates, the distribution drawn from, one
row's failure staying its own; then the request fields over HTTP (400 naming the field) and a processor in the real
decode loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from models.demo import DEMO_DIR
from models.generate import NonFiniteLogits, top_k_filter, top_p_filter
from models.tokenizer import ByteTokenizer
from service.base.config import Settings
from service.base.metrics import Metrics
from service.edge.app import create_app
from service.engine.backends.onnxruntime import OnnxRuntimeBackend
from service.engine.text.sampler import (
    ProcessorFailed,
    SamplingParams,
    _plain_greedy,
    _sample,
    adjusted_logits,
    new_generator,
    sample,
    sample_token,
)
from service.engine.text.scheduler import GenSequence, TextScheduler
from service.protocols.engine_status import http_error

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], dtype=torch.float64)


@dataclass
class Row:
    params: SamplingParams
    generator: torch.Generator = field(default_factory=lambda: new_generator(0))
    prompt: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    banned: Sequence[int] = ()


def reference(logits: torch.Tensor, prompt: Sequence[int], generated: Sequence[int], repetition: float = 1.0,
              presence: float = 0.0, frequency: float = 0.0, bias: dict[int, float] | None = None) -> torch.Tensor:
    """The definitions, token by token: logit_bias added; repetition (vLLM/HF) over prompt + generated, a positive
    logit divided, a negative one multiplied; presence once and frequency per occurrence over generated (OpenAI)."""
    x = logits.double().clone()
    for t, b in (bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(generated):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(generated):
        x[t] -= presence + frequency * list(generated).count(t)
    return x


CASES: list[dict[str, Any]] = [
    {},  # no penalty: the logits untouched
    {"repetition": 1.3},
    {"repetition": 0.7},  # < 1 encourages repetition
    {"presence": 0.8},
    {"frequency": 0.5},
    {"presence": -0.4, "frequency": -1.5},  # negative values encourage
    {"repetition": 1.2, "presence": 1.0, "frequency": 0.25, "bias": {1: 5.0, 3: -100.0}},
    {"bias": {4: 100.0}},
]


def test_penalties_and_bias_equal_their_definitions_for_every_row_of_one_batch() -> None:
    prompt, generated = [0, 1], [3, 5, 3, 3, 1]
    rows = [Row(SamplingParams(8, repetition_penalty=c.get("repetition", 1.0), presence_penalty=c.get("presence", 0.0),
                               frequency_penalty=c.get("frequency", 0.0),
                               logit_bias=tuple((c.get("bias") or {}).items())), prompt=prompt, output_ids=generated)
            for c in CASES]
    got, errors = adjusted_logits(LOGITS.repeat(len(rows), 1), rows)
    assert errors == [None] * len(rows)
    for i, case in enumerate(CASES):
        want = reference(LOGITS, prompt, generated, **case)
        assert torch.allclose(got[i], want, rtol=0, atol=1e-12), (case, got[i], want)
    assert torch.equal(got[0], LOGITS)  # a row without penalties is bit-exact


def _greedy(logits: list[float], **params: Any) -> int:
    prompt, generated = params.pop("prompt", ()), params.pop("generated", ())
    return sample_one(torch.tensor(logits), SamplingParams(8, temperature=0.0, **params), prompt, generated)


def sample_one(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int] = (),
               generated: Sequence[int] = ()) -> int:
    tokens, errors = sample(logits[None], [Row(params, prompt=prompt, output_ids=generated)])
    assert errors == [None]
    return tokens[0]


def test_each_penalty_moves_the_greedy_choice_exactly_where_its_definition_says() -> None:
    # presence: 3.0 - 0.2 > 2.9, 3.0 - 0.11 < 2.9
    assert _greedy([3.0, 2.9, 1.0], presence_penalty=0.09, generated=[0]) == 0
    assert _greedy([3.0, 2.9, 1.0], presence_penalty=0.11, generated=[0]) == 1
    # frequency counts occurrences: two of token 0 at 0.04 each keep it (2.92), at 0.06 they do not (2.88)
    assert _greedy([3.0, 2.9, 1.0], frequency_penalty=0.04, generated=[0, 0]) == 0
    assert _greedy([3.0, 2.9, 1.0], frequency_penalty=0.06, generated=[0, 0]) == 1
    assert _greedy([3.0, 2.9, 1.0], frequency_penalty=0.06, generated=[0]) == 0  # once: 2.94
    # presence and frequency only see generated tokens, never the prompt
    assert _greedy([3.0, 2.9, 1.0], presence_penalty=2.0, frequency_penalty=2.0, prompt=[0]) == 0
    # repetition sees the prompt too: 3.0 / 1.1 = 2.73 < 2.9; a negative logit is multiplied: -1.1 < -1.05
    assert _greedy([3.0, 2.9, 1.0], repetition_penalty=1.1, prompt=[0]) == 1
    assert _greedy([3.0, 2.9, 1.0], repetition_penalty=1.03, prompt=[0]) == 0  # 2.913
    assert _greedy([-1.0, -1.05, -3.0], repetition_penalty=1.1, generated=[0]) == 1
    # logit_bias: +100 makes a token certain, -100 removes it
    assert _greedy([3.0, 2.9, -20.0], logit_bias=((2, 100.0),)) == 2
    assert _greedy([3.0, 2.9, 1.0], logit_bias=((0, -100.0),)) == 1


def test_logit_bias_makes_a_sampled_token_certain_but_never_lifts_the_eos_ban() -> None:
    gen = new_generator(1)
    p = SamplingParams(8, temperature=1.0, logit_bias=((2, 100.0),))
    assert {sample(LOGITS[None], [Row(p, gen)])[0][0] for _ in range(30)} == {2}
    banned = Row(SamplingParams(8, temperature=0.0, logit_bias=((2, 100.0),)), banned=(2,))
    assert sample(LOGITS[None], [banned])[0] == [3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eos_ban_alone_takes_the_best_allowed_token_of_each_row_and_leaves_the_input_alone(
        dtype: torch.dtype) -> None:
    """The ban-only path (ignore_eos, min_tokens: every step of such streams) against the general one: rows with
    different bans, a row without any, a vocabulary of end ids only."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0], [5.0, 4.0, 3.0, 1.0], [0.0, 9.0, 1.0, 2.0]], dtype=dtype)
    before = logits.clone()
    greedy = SamplingParams(8, temperature=0.0)
    rows = [Row(greedy, banned=(0,)), Row(greedy, banned=(0, 1)), Row(greedy)]
    tokens, errors = sample(logits, rows)
    assert tokens == [1, 2, 1] and errors == [None, None, None]
    assert torch.equal(logits, before)  # the caller's logits (the model's output) are not written to
    drawing = [Row(SamplingParams(8, temperature=1.0), new_generator(s), banned=(0, 1, 2)) for s in range(20)]
    drawn = sample(logits[:1].expand(20, -1), drawing)[0]
    assert set(drawn) == {3}
    everything = sample(logits[:1], [Row(greedy, banned=(0, 1, 2, 3))])[1][0]
    assert isinstance(everything, ProcessorFailed) and "no token left" in str(everything)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_plain_greedy_path_gives_the_general_paths_tokens_and_errors(dtype: torch.dtype) -> None:
    """A batch of greedy rows with at most an eos ban takes numpy's short path (every step of a greedy stream):
    its tokens are the general path's, with ties, a banned argmax, bans of several ids; a non-finite logit or a
    row with nothing left to draw leaves it for the general path, which names the row."""
    torch.manual_seed(2)
    logits = torch.randn(6, 50, dtype=dtype).round()  # rounded: rows with equal maxima
    logits[2, 7] = logits[3, 7] = 100.0  # the argmax, banned in row 3
    logits[4, 7], logits[4, 9] = 100.0, 100.0  # two equal maxima, the first banned
    greedy, top_p0 = SamplingParams(8, temperature=0.0), SamplingParams(8, temperature=0.7, top_p=0.0)
    rows = [Row(greedy), Row(top_p0), Row(greedy, banned=(8,)), Row(greedy, banned=(7,)),
            Row(greedy, banned=(7, 3)), Row(top_p0, banned=(0,))]
    plain = _plain_greedy(logits.numpy(), rows)
    assert plain is not None
    assert plain == _sample(logits, rows, None) == sample(logits, rows) == sample(logits.numpy(), rows)
    masked = logits[3].clone()
    masked[7] = float("-inf")
    assert plain[0][2:5] == [7, int(masked.argmax()), 9]  # the best allowed; of equal maxima the first allowed
    bad = logits.clone()
    bad[1, 4] = float("-inf")
    assert _plain_greedy(bad.numpy(), rows) is None
    assert sample(bad.numpy(), rows)[0] == sample(bad, rows)[0]  # an onnxruntime step's array: the same answer
    tokens, errors = sample(bad, rows)
    assert isinstance(errors[1], NonFiniteLogits) and errors[:1] + errors[2:] == [None] * 5
    assert tokens[:1] + tokens[2:] == plain[0][:1] + plain[0][2:]
    everything = [Row(greedy), Row(greedy, banned=tuple(range(50)))]
    assert _plain_greedy(logits[:2].numpy(), everything) is None
    errors = sample(logits[:2], everything)[1]
    assert errors[0] is None and isinstance(errors[1], ProcessorFailed)
    sampling = [Row(greedy), Row(SamplingParams(8, temperature=0.7))]
    assert _plain_greedy(logits[:2].numpy(), sampling) is None
    assert _plain_greedy(None, rows) is None  # logits not on the host as float32/64 (fp16, a GPU tensor)


def test_greedy_is_the_exact_argmax_and_sampling_rows_leave_it_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 4
    params = [SamplingParams(8, temperature=0.0), SamplingParams(8, temperature=0.9),
              SamplingParams(8, temperature=1.0, top_p=0.0), SamplingParams(8, temperature=0.0, top_k=5),
              SamplingParams(8, temperature=1.5, top_k=1), SamplingParams(8, temperature=1e-300)]
    tokens, errors = sample(logits, [Row(p, new_generator(i)) for i, p in enumerate(params)])
    want = logits.argmax(-1).tolist()
    assert errors == [None] * 6
    assert [tokens[i] for i in (0, 2, 3, 4, 5)] == [want[i] for i in (0, 2, 3, 4, 5)]


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch_mates() -> None:
    torch.manual_seed(1)
    steps = [torch.randn(5, 50) for _ in range(20)]
    p = SamplingParams(8, temperature=1.2, top_k=20, top_p=0.9, seed=7)

    def run(others: list[SamplingParams], at: int) -> list[int]:
        rows = [Row(q, new_generator(100 + j)) for j, q in enumerate(others)]
        rows.insert(at, Row(p, new_generator(p.seed)))
        # the seeded row's logits are always s[0], wherever it sits in the batch
        return [sample(torch.cat([s[1:at + 1], s[:1], s[at + 1:len(rows)]]), rows)[0][at] for s in steps]

    alone = run([], 0)
    assert run([SamplingParams(8, temperature=0.0), SamplingParams(8, frequency_penalty=1.0)], 2) == alone
    assert run([SamplingParams(8, temperature=0.5, top_p=0.3)] * 4, 1) == alone
    assert len(set(alone)) > 3  # it really samples


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int = 4000) -> torch.Tensor:
    gen = new_generator(3)
    rows = [Row(params, gen)] * 100
    out = [t for _ in range(draws // 100) for t in sample(logits[None].repeat(100, 1), rows)[0]]
    return torch.bincount(torch.tensor(out), minlength=logits.shape[0]).double() / len(out)


@pytest.mark.parametrize("top_k, top_p", [(None, 1.0), (3, 1.0), (None, 0.8), (4, 0.7)])
def test_draws_follow_the_filtered_distribution(top_k: int | None, top_p: float) -> None:
    temperature = 0.8
    want = LOGITS[None] / temperature
    if top_k is not None:
        want = top_k_filter(want, top_k)
    if top_p < 1:
        want = top_p_filter(want, top_p)
    want = want.softmax(-1)[0]
    got = _frequencies(LOGITS, SamplingParams(8, temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(got > 0, want > 0)  # nothing outside the kept set is ever drawn
    assert (got - want).abs().max() < 0.03, (got, want)


def test_one_sampler_signature_for_one_row() -> None:
    # sample_token takes (logits, temperature, top_k, top_p, ...) as models.generate.sample_next does
    logits = torch.tensor([1.0, 5.0, 4.9, -3.0])
    assert sample_token(logits, 0.0) == 1
    gen = new_generator(0)
    assert {sample_token(logits, 1.0, 2, 1.0, gen) for _ in range(60)} == {1, 2}
    assert sample_token(logits, 1.0, None, 1e-9, new_generator(0)) == 1
    with pytest.raises(NonFiniteLogits):
        sample_token(torch.tensor([1.0, float("nan")]), 1.0)


# ---- processors --------------------------------------------------------------------------------------------


class Force:
    """A trivial structured-output processor: only `token` may come next."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.seen: list[list[int]] = []

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self.seen.append(list(generated))
        out = torch.full_like(logits, float("-inf"))
        out[self.token] = logits[self.token]
        return out


def _boom(generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("grammar exploded")


def test_a_processor_forces_its_row_only_and_runs_before_penalties() -> None:
    force = Force(4)  # the least likely token
    rows = [Row(SamplingParams(8, temperature=1.0, processors=(force,)), new_generator(0), output_ids=[1, 2]),
            Row(SamplingParams(8, temperature=0.0))]
    for _ in range(10):
        assert sample(LOGITS.repeat(2, 1), rows)[0] == [4, 3]
    assert force.seen == [[1, 2]] * 10  # it is given the row's generated tokens
    # processors first, then penalties: the processor's doubling is what repetition divides
    def double(generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        return logits * 2
    row = Row(SamplingParams(8, repetition_penalty=1.5, processors=(double,)), output_ids=[0, 1])
    got, _ = adjusted_logits(LOGITS[None], [row])
    assert torch.allclose(got[0], reference(LOGITS * 2, [], [0, 1], repetition=1.5), rtol=0, atol=1e-12)


def test_a_failing_processor_or_non_finite_row_fails_only_itself() -> None:
    bad = torch.tensor([1.0, float("nan"), 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    def nothing_left(generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        return torch.full_like(logits, float("-inf"))
    rows = [Row(SamplingParams(8, processors=(_boom,))), Row(SamplingParams(8, temperature=0.0)),
            Row(SamplingParams(8, temperature=0.0)), Row(SamplingParams(8, processors=(nothing_left,))),
            Row(SamplingParams(8, temperature=0.0, processors=(lambda g, x: x[:2],))),
            Row(SamplingParams(8, processors=(Force(5),)), banned=(5,))]  # only eos allowed, and eos banned
    logits = torch.stack([LOGITS, LOGITS, bad, LOGITS, LOGITS, LOGITS])
    tokens, errors = sample(logits, rows)
    assert isinstance(errors[0], ProcessorFailed) and "grammar exploded" in str(errors[0])
    assert errors[1] is None and tokens[1] == 3
    assert isinstance(errors[2], NonFiniteLogits)
    assert isinstance(errors[3], ProcessorFailed) and "no finite logit" in str(errors[3])
    assert isinstance(errors[4], ProcessorFailed) and "shape" in str(errors[4])
    assert isinstance(errors[5], ProcessorFailed) and "no token left" in str(errors[5])


def test_processors_in_the_decode_loop_fail_only_their_own_sequence() -> None:
    tok = ByteTokenizer()
    backend = OnnxRuntimeBackend(DEMO_DIR / "text_multimax.onnx")
    force = Force(ord("A"))
    forced = GenSequence(tok.encode("Return the"), SamplingParams(max_tokens=6, seed=1, processors=(force,)))
    broken = GenSequence(tok.encode("If the file"), SamplingParams(max_tokens=6, processors=(_boom,)))
    plain = GenSequence(tok.encode("If the file"), SamplingParams(max_tokens=6, temperature=0.0))
    alone = GenSequence(tok.encode("If the file"), SamplingParams(max_tokens=6, temperature=0.0))

    async def run(seqs: list[GenSequence]) -> None:
        sched = TextScheduler("text", backend, tok, 128, ThreadPoolExecutor(1), Metrics(), 8, 64)
        sched.start()
        sched.submit(seqs)
        for s in seqs:
            while not s.done:
                await s.changed.wait()
                s.changed.clear()
        await sched.close()

    asyncio.run(run([forced, broken, plain]))
    asyncio.run(run([alone]))
    assert forced.error is None and tok.decode(forced.tokens) == "AAAAAA"
    assert force.seen[:3] == [[], [65], [65, 65]]
    assert broken.error is not None and http_error(broken.error).status == 500
    assert "logits processor failed" in broken.error.message and broken.tokens == []
    assert plain.error is None and plain.tokens == alone.tokens and len(plain.tokens) == 6


# ---- over HTTP ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings()), raise_server_exceptions=False) as c:
        yield c


def _complete(client: TestClient, **fields: Any) -> Any:
    return client.post("/v1/completions", json={"model": "text_multimax", "prompt": "Return the", "max_tokens": 12,
                                                "temperature": 0} | fields)


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"repetition_penalty": "1.2"}, "repetition_penalty"),  # strict: a string is not a number
    ({"presence_penalty": True}, "presence_penalty"),
    ({"logit_bias": {"65": 100.5}}, "logit_bias.65"),
    ({"logit_bias": {"65": "5"}}, "logit_bias.65"),
    ({"logit_bias": {"A": 5}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
])
def test_out_of_range_or_badly_typed_fields_are_400_naming_them(client: TestClient, fields: dict[str, Any],
                                                                 param: str) -> None:
    r = _complete(client, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split(".")[0] in error["message"]


def test_penalties_and_bias_change_what_the_server_generates(client: TestClient) -> None:
    plain = _complete(client).json()["choices"][0]["text"]
    assert _complete(client, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                     logit_bias={}).json()["choices"][0]["text"] == plain  # the neutral values change nothing
    assert _complete(client, logit_bias={"65": 100}).json()["choices"][0]["text"] == "A" * 12
    banned = {str(b): -100 for b in set(plain.encode())}
    assert not set(_complete(client, logit_bias=banned).json()["choices"][0]["text"]) & set(plain)
    for field_, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 2.0)):
        text = _complete(client, **{field_: value}).json()["choices"][0]["text"]
        assert text != plain, field_
        if field_ != "repetition_penalty":  # over the generated tokens only: the first token is the same
            assert text[0] == plain[0]
    assert len(set(_complete(client, presence_penalty=2.0).json()["choices"][0]["text"])) > len(set(plain))
