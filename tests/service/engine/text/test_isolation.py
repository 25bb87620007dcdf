"""A failure stays inside its own request: faults injected into one row of a prefill, a decode step or a
classification batch fail that row's request alone; its batch-mates get exactly what they would alone."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from models.checkpoint import load
from models.demo import DEMO_DIR
from models.generate import generate
from models.tokenizer import ByteTokenizer
from service.base.config import Settings
from service.base.metrics import Metrics
from service.edge.app import create_app
from service.engine.backends.onnxruntime import OnnxRuntimeBackend
from service.engine.text.sampler import SamplingParams
from service.engine.text.scheduler import GenSequence, TextScheduler
from service.protocols.engine_status import http_error
from tests.service.support import Wrapped

TOK = ByteTokenizer()
POISON = ord("~")  # a prompt holding this byte breaks the prefill it is in


class FaultyText(Wrapped):
    """The demo text model, except: a prefill whose real tokens include POISON raises; a step that feeds any
    row at position `raise_at` raises; rows at position `nan_at` get NaN logits (their numbers go bad)."""

    def __init__(self, raise_at: int | None = None, nan_at: int | None = None) -> None:
        super().__init__(OnnxRuntimeBackend(DEMO_DIR / "text_multimax.onnx"))
        self.raise_at, self.nan_at = raise_at, nan_at
        self.calls: list[int] = []  # batch size of every call

    def run_text(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Any,
                 last_only: bool = False) -> Any:
        self.calls.append(len(ids))
        if ((ids == POISON) & (mask[:, -ids.shape[1]:] == 1)).any():
            raise RuntimeError("poisoned prompt")
        if self.raise_at is not None and (positions[:, -1] == self.raise_at).any():
            raise RuntimeError("poisoned position")
        logits, presents = self.inner.run_text(ids, mask, positions, past)
        if self.nan_at is not None:
            logits = logits.copy()
            logits[positions[:, -1] == self.nan_at, -1] = np.nan
        return logits, presents


@pytest.fixture(scope="module")
def reference() -> Any:
    model, _, _ = load(DEMO_DIR / "text_multimax.pt")
    return lambda prompt, n: generate(model, TOK.encode(prompt), n, temperature=0.0)[0]


def _run(backend: Any, batches: list[list[GenSequence]], max_running: int = 8) -> None:
    """Submit each list of sequences together (so they share a prefill) and wait for all to end."""
    async def main() -> None:
        sched = TextScheduler("text", backend, TOK, 128, ThreadPoolExecutor(1), Metrics(), max_running, 64)
        sched.start()
        for seqs in batches:
            sched.submit(seqs)
        for s in (s for seqs in batches for s in seqs):
            while not s.done:
                await s.changed.wait()
                s.changed.clear()
        await sched.close()

    asyncio.run(main())


def _greedy(prompt: str, n: int, **params: Any) -> GenSequence:
    return GenSequence(TOK.encode(prompt), SamplingParams(max_tokens=n, **({"temperature": 0.0} | params)))


def test_a_prefill_that_fails_on_one_prompt_fails_only_that_prompt(reference: Any) -> None:
    good = [_greedy("Return the", 12), _greedy("If the file", 9)]
    bad = _greedy("bad ~ prompt", 12)
    backend = FaultyText()
    _run(backend, [[good[0], bad, good[1]]])
    assert bad.error is not None and http_error(bad.error).status == 500 and bad.tokens == []
    for seq, prompt, n in zip(good, ("Return the", "If the file"), (12, 9), strict=True):
        assert seq.error is None and seq.tokens == reference(prompt, n)
    assert backend.calls[0] == 3  # they really shared the prefill that failed


def test_a_decode_step_that_fails_on_one_row_fails_only_that_row(reference: Any) -> None:
    # "0123456789" is the only prompt long enough to reach position 14; the others end at position 11.
    long, short = "0123456789", ["Return", "The"]
    victim = _greedy(long, 20)
    mates = [_greedy(short[0], 6), _greedy(short[1], 8)]
    backend = FaultyText(raise_at=14)
    _run(backend, [[victim, *mates]])
    assert victim.error is not None and http_error(victim.error).status == 500
    assert victim.generated == 5  # it got its first five tokens before the step at position 14 failed
    for seq, prompt in zip(mates, short, strict=True):
        assert seq.error is None and seq.tokens == reference(prompt, seq.params.max_tokens), prompt
    assert 3 in backend.calls and 1 in backend.calls  # a batched step failed and was redone row by row


def test_a_chunk_of_a_long_prompt_that_fails_fails_only_that_prompt(reference: Any) -> None:
    """A long prompt arriving while another sequence decodes is prefilled a chunk a step; the chunk holding the
    poisoned byte raises: that prompt's sequence fails, the running one and a long prompt queued behind it go on
    to their own text, and one cancelled while being chunked just leaves."""
    running = _greedy("Return the", 40)
    bad = _greedy("abcdefghijklmnopqr~stuvwxyz0123", 8)  # the poisoned byte in its third chunk of 8
    after = _greedy("This module provides the functions", 5)
    gone = _greedy("If the file is missing, the server", 5)
    backend = FaultyText()

    async def main() -> TextScheduler:
        sched = TextScheduler("text", backend, TOK, 128, ThreadPoolExecutor(1), Metrics(), 8, 64, prefill_chunk=8)
        sched.start()
        sched.submit([running])
        while running.generated < 3:
            await running.changed.wait()
            running.changed.clear()
        sched.submit([gone])
        sched.submit([bad])
        sched.submit([after])
        while sched.steps["prefill_chunks"] < 1:  # gone's first chunk is in: cancel it half-prefilled
            await asyncio.sleep(0.001)
        sched.cancel(gone)
        for s in (running, bad, after):
            while not s.done:
                await s.changed.wait()
                s.changed.clear()
        await sched.close()
        return sched

    sched = asyncio.run(main())
    assert bad.error is not None and http_error(bad.error).status == 500 and bad.tokens == []
    assert running.error is None and running.tokens == reference("Return the", 40)
    assert after.error is None and after.tokens == reference("This module provides the functions", 5)
    assert gone.tokens == [] and gone.error is None and gone.finish_reason is None
    assert sched.steps["prefill_chunks"] >= 1 + 2 + 5  # gone's first, bad's first two, then all of after's


def test_a_stream_whose_numbers_go_bad_ends_alone(reference: Any) -> None:
    victim = _greedy("0123456789", 20)
    mates = [_greedy("Return", 6), _greedy("The", 8)]
    _run(FaultyText(nan_at=12), [[victim, *mates]])
    assert victim.error is not None and "non-finite" in victim.error.message
    for seq, prompt in zip(mates, ("Return", "The"), strict=True):
        assert seq.error is None and seq.tokens == reference(prompt, seq.params.max_tokens)


@pytest.mark.parametrize("params", [
    {"temperature": 1e-300},  # logits / temperature overflows even float64 for any logit above ~1.8e8 * 1e-300
    {"temperature": 1e-45},  # a float32 denormal: logits / temperature is inf in float32
    {"temperature": 0.7, "top_p": 1e-300},  # no token's mass reaches it: the top token alone
    {"temperature": 1.0, "top_p": 0.0},
    {"temperature": 2.0, "top_k": 1, "top_p": 1e-9},
])
def test_sampling_parameters_at_their_limits_are_greedy_and_never_fail_batch_mates(reference: Any,
                                                                                  params: dict[str, Any]) -> None:
    edge = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=10, seed=1, **params))
    mate = _greedy("If the file", 10)
    _run(FaultyText(), [[edge, mate]])
    assert edge.error is None and edge.tokens == reference("Return the", 10)
    assert mate.error is None and mate.tokens == reference("If the file", 10)


def test_extreme_sampling_over_http_beside_an_innocent_request() -> None:
    with TestClient(create_app(Settings(models=("text_multimax",))), raise_server_exceptions=False) as client:
        for params in ({"temperature": 1e-300}, {"top_p": 0}, {"top_p": 1e-300, "temperature": 2}):
            body = {"model": "text_multimax", "prompt": ["Return the", "If the"], "max_tokens": 8} | params
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert all(c["finish_reason"] == "length" for c in r.json()["choices"])


# ---- classification batch ------------------------------------------------------------------------------------


def test_a_classification_batch_that_fails_on_one_image_fails_only_its_request() -> None:
    app = create_app(Settings(models=("digits_multimax",), max_queue_delay_ms=200))
    backend = app.state.runtimes.models["digits_multimax"].entry.backend
    original = backend.run_vision
    calls: list[int] = []

    def faulty(x: np.ndarray) -> np.ndarray:
        calls.append(len(x))
        if (x == 7.0).all(axis=(1, 2, 3)).any():
            raise RuntimeError("poisoned image")
        return original(x)

    backend.run_vision = faulty
    rng = np.random.default_rng(0)
    inputs = [rng.uniform(-1, 1, (1, 1, 32, 32)).astype(np.float32) for _ in range(3)]
    inputs.insert(1, np.full((1, 1, 32, 32), 7.0, np.float32))

    def infer(client: TestClient, x: np.ndarray) -> Any:
        body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                            "data": x.ravel().tolist()}]}
        return client.post("/v2/models/digits_multimax/infer", json=body)

    with TestClient(app, raise_server_exceptions=False) as client:
        from concurrent.futures import ThreadPoolExecutor as Pool

        with Pool(4) as pool:
            responses = list(pool.map(lambda x: infer(client, x), inputs))
    assert [r.status_code for r in responses] == [200, 500, 200, 200]
    assert json.loads(responses[1].text)["error"].startswith("model failed on this input")
    for x, r in zip(inputs, responses, strict=True):
        if r.status_code == 200:
            assert np.allclose(np.array(r.json()["outputs"][0]["data"]).reshape(1, -1), original(x), atol=1e-5)
    assert max(calls) > 1  # the poisoned image really shared a batch with the others
