"""/v1/completions options beyond the basics: logprobs, echo, n, best_of, ignore_eos, min_tokens and per-chunk
usage; the official `openai` client against the real server on 127.0.0.1, httpx for the error cases, and the
scheduler in-process where a counter shows what the engine did (the prefill shared by n choices)."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from benchmarks.loadtest.prom import sample_value
from benchmarks.server import start, stop
from service.base.config import Settings
from service.edge.app import create_app
from service.engine.text.sampler import sample_token
from service.protocols.choices import offsets, token_text

MODEL = "text_multimax"
PROMPT = "Return the"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start("--max-running-sequences", "8", "--max-choices-per-request", "8")
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def local() -> Iterator[TestClient]:
    with TestClient(create_app(Settings()), raise_server_exceptions=False) as c:
        yield c


def _sum(values: list[float | None]) -> float:
    return sum(v for v in values if v is not None)


# ---- logprobs and echo -----------------------------------------------------------------------------------


def test_logprobs_are_the_models_and_name_their_alternatives(client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == list(range(len(lp.tokens)))  # ASCII: one character per byte token
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen <= 0
        assert max(top.values()) == chosen == top[token]  # greedy: the chosen token is the most likely
    # The decode loop's logprobs (cache, one token a step) equal a full forward's over prompt + completion.
    whole = client.completions.create(model=MODEL, prompt=PROMPT + done.choices[0].text, max_tokens=0, echo=True,
                                      logprobs=0)
    wl = whole.choices[0].logprobs
    assert wl is not None and wl.token_logprobs[0] is None and wl.top_logprobs[0] is None
    assert whole.choices[0].text == PROMPT + done.choices[0].text and whole.usage.completion_tokens == 0
    assert wl.token_logprobs[len(PROMPT):] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_echo_with_and_without_logprobs_and_sampling(client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, echo=True, seed=3)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, seed=3)
    assert done.choices[0].text == PROMPT + plain.choices[0].text and done.choices[0].logprobs is None
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, echo=True, logprobs=1, seed=3,
                                        temperature=1.5)
    lp = sampled.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(PROMPT) + 6 and lp.token_logprobs[0] is None
    # Raw model logprobs: the sampled token is always listed, next to the top alternative.
    assert all(1 <= len(top) <= 2 and tok in top for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:],
                                                                       strict=True))


def test_streamed_logprobs_and_echo_add_up_to_the_whole(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "seed": 9, "logprobs": 2,
                            "echo": True}
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    offs = [o for c in chunks for o in (c.choices[0].logprobs.text_offset if c.choices[0].logprobs else [])]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert tokens == whole.choices[0].logprobs.tokens and offs == whole.choices[0].logprobs.text_offset


def test_multibyte_tokens_are_named_by_their_bytes(local: TestClient) -> None:
    r = local.post("/v1/completions", json={"model": MODEL, "prompt": "héllo", "max_tokens": 0, "echo": True,
                                            "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "bytes:\\xc3", "bytes:\\xa9", "l", "l", "o"]
    assert lp["text_offset"] == [0, 1, 1, 2, 3, 4]  # a byte inside "é" counts from where the character starts
    tok = local.app.state.runtimes.models[MODEL].tokenizer
    assert token_text(tok, tok.eos_id) == "<|eos|>" and offsets(tok, tok.encode("aé")) == [0, 1, 1]


# ---- n and best_of ---------------------------------------------------------------------------------------


def test_n_choices_are_seeded_per_choice_and_share_one_prefill(local: TestClient) -> None:
    sched = local.app.state.runtimes.models[MODEL].scheduler
    before = dict(sched.steps)
    r = local.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "n": 4, "seed": 11})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert sched.steps["prefill_prompts"] - before["prefill_prompts"] == 1  # one prompt row for four choices
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 32, "total_tokens": 42}
    # The copied cache gives what a separate request of seed 11 + c gives.
    for c, choice in enumerate(body["choices"]):
        alone = local.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                    "seed": 11 + c}).json()
        assert alone["choices"][0]["text"] == choice["text"]
    assert len({c["text"] for c in body["choices"]}) > 1
    # Two prompts x n: indices prompt * n + choice, each prompt counted once.
    r = local.post("/v1/completions", json={"model": MODEL, "prompt": ["ab", "cde"], "max_tokens": 3, "n": 2,
                                            "ignore_eos": True})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert r.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def test_n_and_best_of_with_the_openai_client(client: openai.OpenAI, server: str) -> None:
    def prompt_tokens() -> float:
        return sample_value(httpx.get(f"{server}/metrics").text, "multimax_prompt_tokens_total", model=MODEL)

    before = prompt_tokens()
    many = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=4, best_of=4, seed=2,
                                     logprobs=0, extra_body={"ignore_eos": True})
    assert prompt_tokens() - before == len(PROMPT)  # prefilled once for four sequences
    best = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, best_of=4, seed=2,
                                     logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in best.choices] == [0, 1]
    ranked = sorted(many.choices, key=lambda c: _sum(c.logprobs.token_logprobs), reverse=True)[:2]
    assert [c.text for c in best.choices] == [c.text for c in ranked]
    # Billed as OpenAI bills best_of: every generated sequence, the prompt once.
    assert best.usage.completion_tokens == 32 and best.usage.prompt_tokens == len(PROMPT)


def test_streamed_n_interleaves_choices_with_their_index(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=3, seed=4)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=3, seed=4, stream=True,
                                            stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    order = [c.choices[0].index for c in chunks if c.choices]
    assert order != sorted(order)  # interleaved, not one choice after the other
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


# ---- ignore_eos, min_tokens, per-chunk usage ---------------------------------------------------------------


def test_ignore_eos_and_min_tokens_fix_the_length(client: openai.OpenAI) -> None:
    for extra in ({"ignore_eos": True}, {"min_tokens": 40}):
        done = client.completions.create(model=MODEL, prompt="a", max_tokens=40, extra_body=extra)
        assert done.usage.completion_tokens == 40 and done.choices[0].finish_reason == "length"
    # Stop strings count only from min_tokens on (vLLM): " " would end this at once otherwise.
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, stop=[" "], temperature=0,
                                     extra_body={"min_tokens": 12})
    assert done.usage.completion_tokens >= 12 and len(done.choices[0].text) >= 11
    early = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, stop=[" "], temperature=0)
    assert len(early.choices[0].text) < len(done.choices[0].text)


def test_ignore_eos_and_min_tokens_against_a_model_that_wants_to_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo model seldom samples eos; here its logits are skewed so that it always would."""
    with TestClient(create_app(Settings()), raise_server_exceptions=False) as c:
        rt = c.app.state.runtimes.models[MODEL]
        backend, eos = rt.entry.backend, rt.tokenizer.eos_id
        original = backend.run_text

        def eager(*args: Any) -> Any:
            logits, presents = original(*args)
            logits[..., eos] += 100.0
            return logits, presents

        monkeypatch.setattr(backend, "run_text", eager)

        def complete(**body: Any) -> dict[str, Any]:
            return c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 20} | body).json()

        assert complete()["usage"]["completion_tokens"] == 1 and complete()["choices"][0]["finish_reason"] == "stop"
        fixed = complete(ignore_eos=True, logprobs=1)
        assert fixed["usage"]["completion_tokens"] == 20 and fixed["choices"][0]["finish_reason"] == "length"
        # logprobs are the raw model's, before the ban: eos stays the top alternative of every position
        assert all("<|eos|>" in top for top in fixed["choices"][0]["logprobs"]["top_logprobs"])
        least = complete(min_tokens=7)
        assert least["usage"]["completion_tokens"] == 8 and least["choices"][0]["finish_reason"] == "stop"
        assert len(least["choices"][0]["text"]) == 7  # the eos that ended it is counted, not shown


def test_the_eos_ban_holds_even_where_eos_is_certain() -> None:
    logits = torch.full((259,), -20.0)
    logits[257] = 30.0
    gen = torch.Generator().manual_seed(0)
    assert {sample_token(logits, 1.0, None, 1.0, gen, (257,)) for _ in range(50)} != {257}
    assert 257 not in {sample_token(logits, t, k, p, gen, (257,)) for t, p, k in
                       [(0, 1, None), (1, 0.5, None), (1, 1, 1), (1e-300, 1, None)] for _ in range(5)}


def test_continuous_usage_stats_in_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True, seed=1,
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None and c.usage.prompt_tokens == len(PROMPT) for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


# ---- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"logprobs": 6}, "logprobs", None),
    ({"logprobs": -1}, "logprobs", None),
    ({"n": 0}, "n", None),
    ({"n": 2, "best_of": 1}, "best_of", None),
    ({"best_of": 3, "stream": True}, "best_of", None),
    ({"n": 9}, "n", "too_many_choices"),
    ({"best_of": 9}, "best_of", "too_many_choices"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "n", "too_many_choices"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", None),
    ({"min_tokens": 17}, "min_tokens", None),  # default max_tokens is 16
    ({"min_tokens": -1}, "min_tokens", None),
])
def test_bad_options_are_400_in_the_openai_shape(server: str, body: dict[str, Any], param: str,
                                                 code: str | None) -> None:
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi"} | body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert code is None or err["code"] == code


def test_a_huge_n_is_refused_while_other_streams_go_on(server: str) -> None:
    got: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "stream": True,
                                "ignore_eos": True}) as r:
            got.extend(line for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=stream)
    t.start()
    for n in (10**6, 2**40):
        r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": n,
                                                         "max_tokens": 100}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_choices"
    t.join(60)
    assert got[-1] == "data: [DONE]"
    usage = json.loads(got[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 60 and math.isfinite(usage["total_tokens"])


def test_the_load_tester_fixes_output_lengths_with_ignore_eos(server: str) -> None:
    from benchmarks.loadtest import LoadConfig, run
    from benchmarks.loadtest.cli import build_parser, config_from_args
    from benchmarks.loadtest.config import IntRange
    from benchmarks.loadtest.workloads import build_workload

    cfg, _, _ = config_from_args(build_parser().parse_args(
        ["--url", server, "--workload", "generate", "--concurrency", "2", "--requests", "4", "--max-tokens", "12:12",
         "--ignore-eos"]))
    body = build_workload(cfg).request(0).body
    assert cfg.ignore_eos and body is not None and json.loads(body)["ignore_eos"] is True
    result = run(LoadConfig(url=server, workload="generate", model=MODEL, concurrency=2, requests=4,
                            max_tokens=IntRange(12, 12), ignore_eos=True, scrape_metrics=False))
    assert result.ok == 4 and result.generation is not None and result.generation["output_tokens"] == 48



def test_a_group_waits_for_room_as_a_whole_and_the_running_stream_goes_on() -> None:
    """With 4 slots and one taken, n=4 waits until all four fit (one prefill), while the stream finishes."""
    with TestClient(create_app(Settings(max_running_sequences=4)), raise_server_exceptions=False) as c:
        sched = c.app.state.runtimes.models[MODEL].scheduler
        before = sched.steps["prefill_prompts"]
        lines: list[str] = []

        def stream() -> None:
            with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 60,
                                                           "stream": True, "ignore_eos": True}) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

        t = threading.Thread(target=stream)
        t.start()
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "n": 4,
                                            "ignore_eos": True})
        t.join(60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 60
        assert sched.steps["prefill_prompts"] - before == 2  # the stream's prompt, and the group's once
