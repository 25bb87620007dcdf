"""The generation scheduler (service.engine.text.scheduler): sequences joining a running batch, bursts prefilled
together, chunked prefill between decode steps, cancellation, stream hand-off, seeds, stops and EOS."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

from models.demo import DEMO_DIR
from models.generate import generate
from service.base.config import load_settings
from service.base.metrics import Metrics
from service.edge.app import create_app
from service.engine.text.sampler import SamplingParams
from service.engine.text.scheduler import GenSequence, TextScheduler
from tests.service.support import TOK


def _scheduler(backend_kind: str, max_running: int = 8) -> TextScheduler:
    from concurrent.futures import ThreadPoolExecutor

    if backend_kind == "torch":
        from service.engine.backends.torch import TorchBackend

        backend: Any = TorchBackend(DEMO_DIR / "text_multimax.pt", device="cpu")
    else:
        from service.engine.backends.onnxruntime import OnnxRuntimeBackend

        backend = OnnxRuntimeBackend(DEMO_DIR / "text_multimax.onnx")
    return TextScheduler("text", backend, TOK, 128, ThreadPoolExecutor(1), Metrics(), max_running, 64)


async def _wait(seq: GenSequence, tokens: int | None = None) -> None:
    while not (seq.done or (tokens is not None and seq.generated >= tokens)):
        await seq.changed.wait()
        seq.changed.clear()


@pytest.mark.parametrize("backend_kind", ["torch", "onnxruntime"])
def test_sequences_joining_a_running_batch_generate_what_they_would_alone(
    backend_kind: str, service_text_model: Any
) -> None:
    """Greedy output of sequences merged mid-decode (left-padded caches of different lengths, rows leaving and
    columns trimmed) equals the reference generation of each prompt on its own."""
    prompts = ["Return the", "If the file is", "A", "This module provides the"]
    lengths = [60, 12, 40, 25]

    async def main() -> list[GenSequence]:
        sched = _scheduler(backend_kind)
        sched.start()
        seqs = [GenSequence(TOK.encode(p), SamplingParams(max_tokens=n, temperature=0.0))
                for p, n in zip(prompts, lengths, strict=True)]
        sched.submit(seqs[:1])
        await _wait(seqs[0], 5)
        sched.submit(seqs[1:3])  # join while the first is decoding
        await _wait(seqs[1])
        sched.submit(seqs[3:])  # join after one has left
        for s in seqs:
            await _wait(s)
        await sched.close()
        assert sched.steps["prefill"] == 3
        return seqs

    seqs = asyncio.run(main())
    for prompt, n, seq in zip(prompts, lengths, seqs, strict=True):
        want = generate(service_text_model, TOK.encode(prompt), n, temperature=0.0)[0]
        assert seq.tokens == want, prompt
        assert seq.finish_reason == "length" and seq.generated == n
    assert seqs[1].finished < seqs[0].finished  # the short one did not wait for the long one
    assert seqs[1].started < seqs[0].finished


def test_an_idle_model_prefills_a_burst_of_arrivals_together(service_text_model: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients starting together reach the scheduler a little apart (each handler parses its request first): an
    idle model waits for the burst and prefills it once; a lone request does not wait. (The gap is widened here so
    that a loaded machine's timer lag cannot split the burst.)"""
    from service.engine.text import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "BURST_GAP_S", 0.05)
    monkeypatch.setattr(scheduler_module, "BURST_MAX_S", 5.0)
    prompts = ["Return the", "If the file is", "A", "This module provides the", "x", "The"]

    async def main() -> tuple[TextScheduler, list[GenSequence]]:
        sched = _scheduler("onnxruntime")
        sched.start()
        lone = GenSequence(TOK.encode("A"), SamplingParams(max_tokens=2, temperature=0.0))
        sched.submit([lone])
        await _wait(lone)
        assert sched.steps["burst_waits"] == 0 and sched.steps["prefill"] == 1
        await asyncio.sleep(0.1)  # the model is idle again
        seqs = [GenSequence(TOK.encode(p), SamplingParams(max_tokens=6, temperature=0.0)) for p in prompts]
        sched.submit(seqs[:1])
        await asyncio.sleep(0)
        for seq in seqs[1:]:
            sched.submit([seq])
            await asyncio.sleep(0.001)  # the next client a millisecond later
        for seq in seqs:
            await _wait(seq)
        await sched.close()
        return sched, seqs

    sched, seqs = asyncio.run(main())
    assert sched.steps["burst_waits"] == 1
    assert sched.steps["prefill"] == 2 and sched.steps["prefill_prompts"] == 7  # the lone one, then all six at once
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.tokens == generate(service_text_model, TOK.encode(prompt), 6, temperature=0.0)[0], prompt


def test_an_idle_model_that_has_seen_bursts_waits_for_arrivals_later_than_two_loop_turns(
        service_text_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst's requests can reach the scheduler milliseconds apart (one client process sending them): the first
    is prefilled alone while the others wait for it. Once idle starts have had such company, the next idle start
    waits BURST_FIRST_S for it; lone requests never wait. (Gaps widened against a loaded machine's timer lag.)"""
    from service.engine.text import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "BURST_FIRST_S", 0.2)
    monkeypatch.setattr(scheduler_module, "BURST_MAX_S", 0.4)

    async def pair(sched: TextScheduler, prompts: tuple[str, str]) -> list[GenSequence]:
        seqs = [GenSequence(TOK.encode(p), SamplingParams(max_tokens=4, temperature=0.0)) for p in prompts]
        sched.submit(seqs[:1])
        await asyncio.sleep(0.02)  # the second request of the burst, later than two loop turns
        sched.submit(seqs[1:])
        for seq in seqs:
            await _wait(seq)
        await asyncio.sleep(0.6)  # idle again, longer than BURST_MAX_S
        return seqs

    async def main() -> tuple[TextScheduler, list[int], list[GenSequence]]:
        sched = _scheduler("onnxruntime")
        sched.start()
        for _ in range(2):  # lone requests, further apart than BURST_MAX_S: no company, no waiting
            seq = GenSequence(TOK.encode("A"), SamplingParams(max_tokens=2, temperature=0.0))
            sched.submit([seq])
            await _wait(seq)
            await asyncio.sleep(0.6)
        prefills = [sched.steps["prefill"]]
        assert sched.steps["burst_waits"] == 0 and sched._bursty == 0.0
        seqs = await pair(sched, ("Return the", "If the file is"))  # learned from: prefilled one at a time
        prefills.append(sched.steps["prefill"])
        seqs += await pair(sched, ("This module provides the", "The"))  # gathered: one prefill of both
        prefills.append(sched.steps["prefill"])
        await sched.close()
        return sched, prefills, seqs

    sched, prefills, seqs = asyncio.run(main())
    assert prefills == [2, 4, 5], prefills
    assert sched.steps["burst_waits"] == 1
    for prompt, seq in zip(("Return the", "If the file is", "This module provides the", "The"), seqs, strict=True):
        assert seq.tokens == generate(service_text_model, TOK.encode(prompt), 4, temperature=0.0)[0], prompt


def test_the_scheduler_tells_the_backend_how_far_its_cache_may_grow() -> None:
    """After each prefill the backend hears the batch's width plus the most tokens a running row may still
    generate (its max_tokens, capped by the context): what it sizes a growing cache buffer to."""
    sched = _scheduler("onnxruntime")
    heard: list[int] = []
    sched.backend.reserve = heard.append  # type: ignore[method-assign]

    async def main() -> None:
        sched.start()
        first = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=30, temperature=0.0))
        sched.submit([first])
        await _wait(first, 5)
        short = GenSequence(TOK.encode("If the file is"), SamplingParams(max_tokens=3, temperature=0.0))
        sched.submit([short])
        await _wait(short)
        long = GenSequence(TOK.encode("A"), SamplingParams(max_tokens=500, temperature=0.0))
        sched.submit([long])
        for seq in (first, long):
            await _wait(seq)
        await sched.close()

    asyncio.run(main())
    assert len(heard) == 3
    assert heard[0] == len(TOK.encode("Return the")) + 30 - 1  # the prompt, and 29 tokens after the first
    assert heard[1] >= heard[0]  # the first row may still need its room: the newcomer asks less
    assert heard[2] == 128  # 500 tokens would pass the context


@pytest.mark.parametrize("backend_kind", ["torch", "onnxruntime"])
def test_a_long_prompt_arriving_while_rows_decode_is_prefilled_in_chunks_between_their_steps(
    backend_kind: str, service_text_model: Any
) -> None:
    """Long prompts (two choices of one, then another) that arrive while a sequence decodes are prefilled
    `prefill_chunk` tokens a call, each chunk after a decode step of the running rows, the second prompt after
    the first; every sequence's greedy text is still the model's own. On an idle model a long prompt is one call."""
    sched = _scheduler(backend_kind)
    sched.prefill_chunk = 8
    sched.prefix_cache.budget = 0  # whole prompts' chunks are counted here (the prefix cache's: test_prefix_cache)
    widths: list[int] = []  # tokens fed by each model call, in order
    run_text = sched.backend.run_text

    def recording(ids: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        widths.append(ids.shape[1])
        return run_text(ids, *args, **kwargs)

    sched.backend.run_text = recording  # type: ignore[method-assign]
    running_prompt, long_prompts = "Return the", ["This module provides the functions", "If the file is missing, the"]
    group = object()

    async def main() -> list[GenSequence]:
        sched.start()
        running = GenSequence(TOK.encode(running_prompt), SamplingParams(max_tokens=40, temperature=0.0))
        sched.submit([running])
        await _wait(running, 3)
        choices = [GenSequence(TOK.encode(long_prompts[0]), SamplingParams(max_tokens=6, temperature=0.0),
                               group=group) for _ in range(2)]
        other = GenSequence(TOK.encode(long_prompts[1]), SamplingParams(max_tokens=6, temperature=0.0))
        sched.submit(choices)
        sched.submit([other])
        for seq in (running, *choices, other):
            await _wait(seq)
        assert sched.steps["prefill_chunks"] == 5 + 4  # 34 and 27 tokens, 8 a chunk
        idle = GenSequence(TOK.encode(long_prompts[0]), SamplingParams(max_tokens=2, temperature=0.0))
        sched.submit([idle])
        await _wait(idle)
        assert sched.steps["prefill_chunks"] == 5 + 4  # nothing decoded beside it: one call
        await sched.close()
        return [running, *choices, other, idle]

    seqs = asyncio.run(main())
    for seq in seqs:
        want = generate(service_text_model, seq.prompt, seq.params.max_tokens, temperature=0.0)[0]
        assert seq.error is None and seq.tokens == want, TOK.decode(seq.prompt)
    chunks = [i for i, w in enumerate(widths) if w == 8]
    assert len(chunks) == 7 and widths.count(2) == 1 and widths.count(3) == 1  # the prompts' last chunks: 2, 3
    assert all(1 in widths[a + 1:b] for a, b in itertools.pairwise(chunks))  # a decode step between chunks
    assert widths[-2:] == [len(long_prompts[0]), 1]  # the idle model's prefill: one call, then its decode step


def test_a_cancelled_sequence_frees_its_slot_at_the_next_step() -> None:
    async def main() -> None:
        sched = _scheduler("onnxruntime", max_running=1)
        sched.start()
        long = GenSequence(TOK.encode("The"), SamplingParams(max_tokens=120, temperature=0.0))
        short = GenSequence(TOK.encode("The"), SamplingParams(max_tokens=3, temperature=0.0))
        sched.submit([long])
        await _wait(long, 2)
        sched.submit([short])
        assert sched.waiting == 1 and sched.running == 1
        sched.cancel(long)
        assert sched.running == 0
        await _wait(short)
        await sched.close()
        assert short.finish_reason == "length" and long.generated < 60 and long.finish_reason is None

    asyncio.run(main())


def _counting_drains(sched: TextScheduler, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting the loop's drains of the worker's hand-offs (its wake-ups)."""
    drains = [0]
    drain = sched._drain

    def counting() -> None:
        drains[0] += 1
        drain()

    monkeypatch.setattr(sched, "_drain", counting)
    return drains


@pytest.mark.parametrize("interval", [0.0, 60.0])
def test_every_step_reaches_the_loop_as_its_own_step_however_the_worker_batches_its_wake_ups(
        interval: float, monkeypatch: pytest.MonkeyPatch, service_text_model: Any) -> None:
    """The worker wakes the loop at most every handoff_interval_s (--stream-interval-ms; or every HANDOFF_MAX_STEPS
    steps); each step is still applied on its own and in order (seq.steps: one mark per step, what a stream sends
    one event for), and the tokens are the reference generation's."""
    from service.engine.text import scheduler

    drains = [0]

    async def main() -> GenSequence:
        nonlocal drains
        sched = _scheduler("onnxruntime")
        sched.handoff_interval_s = interval
        drains = _counting_drains(sched, monkeypatch)
        sched.start()
        seq = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=40, temperature=0.0))
        sched.submit([seq])
        await _wait(seq)
        await sched.close()
        return seq

    seq = asyncio.run(main())
    assert seq.tokens == generate(service_text_model, TOK.encode("Return the"), 40, temperature=0.0)[0]
    assert seq.finish_reason == "length" and seq.steps == list(range(1, 41))
    if interval:  # one wake-up per HANDOFF_MAX_STEPS steps, plus a drain each time the worker returns
        assert drains[0] <= 40 // scheduler.HANDOFF_MAX_STEPS + 4, drains


def test_a_first_token_and_an_end_reach_the_loop_at_once_whatever_the_interval(
        monkeypatch: pytest.MonkeyPatch, service_text_model: Any) -> None:
    """With an interval (and a worker slice) longer than the whole generation, a mid-stream step never wakes the
    loop, but a sequence's first token and its end do: the stream starts while the model runs, and a short
    sequence ends while its long batch-mate still decodes."""
    from service.engine.text import scheduler

    monkeypatch.setattr(scheduler, "STEPS_SLICE_S", 60.0)
    monkeypatch.setattr(scheduler, "HANDOFF_MAX_STEPS", 10**9)
    seen: dict[str, tuple[int, bool]] = {}
    drains = [0]

    async def main() -> tuple[GenSequence, GenSequence]:
        nonlocal drains
        sched = _scheduler("onnxruntime")
        sched.handoff_interval_s = 60.0
        drains = _counting_drains(sched, monkeypatch)
        run_text = sched.backend.run_text

        def slow(*args: Any, **kwargs: Any) -> Any:  # every step takes a while: the end is far from the start
            import time

            time.sleep(0.002)
            return run_text(*args, **kwargs)

        monkeypatch.setattr(sched.backend, "run_text", slow)
        sched.start()
        long = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=100, temperature=0.0))
        short = GenSequence(TOK.encode("If the"), SamplingParams(max_tokens=5, temperature=0.0))
        sched.submit([long, short])
        await _wait(long, 1)
        seen["first"] = (long.generated, long.done)
        await _wait(short)
        seen["short end"] = (long.generated, long.done)
        await _wait(long)
        await sched.close()
        return long, short

    long, short = asyncio.run(main())
    assert seen["first"] == (1, False)  # the first token alone, long before the end
    generated, done = seen["short end"]
    assert 5 <= generated < 100 and not done
    assert short.finish_reason == long.finish_reason == "length" and long.generated == 100
    assert long.tokens == generate(service_text_model, TOK.encode("Return the"), 100, temperature=0.0)[0]
    assert drains[0] <= 4, drains  # first tokens, the short one's end, the last step (and _run's own drain)


def test_stream_interval_ms_is_each_decode_loops_hand_off_interval() -> None:
    from service.engine.text.delivery import stream_interval_s

    auto = load_settings(["--models", "text_multimax"], {})
    assert auto.stream_interval_ms is None
    loops = [rt.scheduler for rt in create_app(auto).state.runtimes.models.values() if hasattr(rt, "scheduler")]
    assert loops and all(loop.handoff_interval_s == stream_interval_s(auto) for loop in loops)
    settings = load_settings(["--stream-interval-ms", "4.5", "--models", "text_multimax"], {})
    loops = [rt.scheduler for rt in create_app(settings).state.runtimes.models.values() if hasattr(rt, "scheduler")]
    assert loops and all(loop.handoff_interval_s == 0.0045 for loop in loops)


def test_seeded_sampling_does_not_depend_on_batch_mates() -> None:
    async def run(extra: int) -> list[int]:
        sched = _scheduler("onnxruntime")
        sched.start()
        target = GenSequence(TOK.encode("Return"), SamplingParams(max_tokens=30, temperature=0.9, seed=7))
        others = [GenSequence(TOK.encode("x" * (i + 1)), SamplingParams(max_tokens=20, seed=i)) for i in range(extra)]
        sched.submit([target, *others])
        for s in (target, *others):
            await _wait(s)
        await sched.close()
        return target.tokens

    alone, crowded = asyncio.run(run(0)), asyncio.run(run(5))
    assert alone == crowded


def test_stop_sequence_and_eos_end_a_sequence() -> None:
    async def main() -> None:
        sched = _scheduler("onnxruntime")
        sched.start()
        free = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=40, temperature=0.0, logprobs=1))
        sched.submit([free])
        await _wait(free)
        text = TOK.decode(free.tokens)
        stop = text[5:8]  # three tokens, sampled in three steps: the stop removes tokens the loop already has
        cut = GenSequence(TOK.encode("Return the"), SamplingParams(max_tokens=40, temperature=0.0,
                                                                   stop=(stop.encode(),), logprobs=1))
        sched.submit([cut])
        await _wait(cut)
        await sched.close()
        assert TOK.decode(cut.tokens) == text[: text.index(stop)] and cut.finish_reason == "stop"
        kept = len(cut.tokens)  # the logprobs stay one a token, and are the free run's own
        assert len(free.logprobs.chosen) == len(free.tokens) == 40
        assert cut.logprobs.chosen == free.logprobs.chosen[:kept] and cut.logprobs.top == free.logprobs.top[:kept]
        assert cut.steps[-1] == kept < max(cut.steps)  # the last step took back tokens an earlier step had

    asyncio.run(main())
