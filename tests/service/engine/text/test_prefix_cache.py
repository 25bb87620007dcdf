"""The prefix cache (service.engine.text.prefix_cache): a prompt that starts as a recent one did is prefilled from
where the cached part ends, and generates exactly what it generates without the cache; memory stays within its
budget, least recently used first out; hits are counted."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.checkpoint import load
from models.demo import DEMO_DIR
from models.generate import generate
from models.tokenizer import ByteTokenizer
from service.base.config import Settings
from service.base.metrics import Metrics
from service.engine.backends.cache_numpy import NumpyCache
from service.engine.backends.cache_ops import LEFT, RIGHT, CacheOps
from service.engine.backends.cache_torch import TorchCache
from service.engine.text.prefix_cache import BLOCK, PrefixCache
from service.engine.text.sampler import SamplingParams
from service.engine.text.scheduler import GenSequence, TextScheduler

TOK = ByteTokenizer()
SYSTEM = "You are a careful assistant. Answer in one short sentence. "  # 59 bytes: 3 whole blocks


def _cache(kind: str, layout: str = LEFT) -> CacheOps:
    return NumpyCache(layout) if kind == "numpy" else TorchCache(layout)


def _past(kind: str, rows: int, length: int, seed: int = 0) -> list[tuple[Any, Any]]:
    x = np.random.default_rng(seed).normal(size=(rows, 2, length, 4)).astype(np.float32)
    t = x if kind == "numpy" else torch.from_numpy(x)
    return [(t, t * 2)]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("layout", [LEFT, RIGHT])
def test_the_longest_cached_prefix_is_found_and_handed_out_as_a_copy(kind: str, layout: str) -> None:
    ops = _cache(kind, layout)
    cache = PrefixCache(ops, 1 << 20)
    prompt = list(range(100, 150))  # 50 tokens: 3 whole blocks cached
    # row 1 of a left-padded (or right-padded) batch of two, 50 real positions in 60 columns
    past = _past(kind, 2, 60)
    mask = np.zeros((2, 60), np.int64)
    mask[0] = 1
    mask[1, 10:] = 1
    cache.store(prompt, past, mask, 1)
    start = 10 if layout == LEFT else 0
    n, got = cache.lookup([*prompt[:40], 7, 8, 9])  # shares 40 tokens: 2 whole blocks
    assert n == 2 * BLOCK and got is not None
    assert np.array_equal(np.asarray(got[0][0]), np.asarray(past[0][0])[1:2, :, start:start + n])
    assert np.array_equal(np.asarray(got[0][1]), np.asarray(past[0][1])[1:2, :, start:start + n])
    got[0][0][:] = 0  # the copy is the caller's: writing it leaves the store as it was
    n2, again = cache.lookup([*prompt, 1])
    assert n2 == 3 * BLOCK and again is not None and np.asarray(again[0][0]).any()
    assert cache.lookup(prompt)[0] == 3 * BLOCK  # 50 tokens: the 48 cached, 2 to prefill
    assert cache.lookup(prompt[:48])[0] == 2 * BLOCK  # at least the last token is always prefilled
    assert cache.lookup([1, *prompt])[0] == 0  # a prefix must start at the prompt's start
    assert cache.stats.hits == 4 and cache.stats.lookups == 5


def test_a_hash_that_matches_other_tokens_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine.text import prefix_cache

    monkeypatch.setattr(prefix_cache, "block_hashes", lambda tokens, blocks: list(range(blocks)))  # all collide
    cache = PrefixCache(NumpyCache(), 1 << 20)
    cache.store(list(range(40)), _past("numpy", 1, 40), np.ones((1, 40), np.int64), 0)
    assert cache.lookup([*list(range(1, 41)), 0])[0] == 0


def test_the_budget_holds_and_the_least_recently_used_prompt_leaves_first() -> None:
    ops = NumpyCache()
    per_block = 2 * 2 * BLOCK * 4 * 4  # key and value, 2 heads, BLOCK positions, 4 wide, float32
    cache = PrefixCache(ops, 5 * per_block)
    prompts = [[p] * (2 * BLOCK) for p in (1, 2, 3)]  # 2 blocks each
    for i, p in enumerate(prompts[:2]):
        cache.store(p, _past("numpy", 1, 2 * BLOCK, i), np.ones((1, 2 * BLOCK), np.int64), 0)
    assert cache.used == 4 * per_block and len(cache) == 2
    assert cache.lookup(prompts[0] + [9])[0] == 2 * BLOCK  # prompt 1 is now the most recently used
    cache.store(prompts[2], _past("numpy", 1, 2 * BLOCK, 2), np.ones((1, 2 * BLOCK), np.int64), 0)
    assert cache.used <= cache.budget and len(cache) == 2 and cache.stats.evicted == 1
    assert cache.lookup(prompts[1] + [9])[0] == 0  # prompt 2 left
    assert cache.lookup(prompts[0] + [9])[0] == 2 * BLOCK and cache.lookup(prompts[2] + [9])[0] == 2 * BLOCK
    cache.store([5] * (8 * BLOCK), _past("numpy", 1, 8 * BLOCK), np.ones((1, 8 * BLOCK), np.int64), 0)
    assert len(cache) == 2  # larger than the whole budget: not kept, nothing evicted for it
    off = PrefixCache(ops, 0)
    off.store(prompts[0], _past("numpy", 1, 2 * BLOCK), np.ones((1, 2 * BLOCK), np.int64), 0)
    assert len(off) == 0 and off.lookup(prompts[0] + [1]) == (0, None)


# ---- in the decode loop -------------------------------------------------------------------------------------


def _backend(kind: str, tmp_path: Path) -> Any:
    if kind == "torch":
        from service.engine.backends.torch import TorchBackend

        return TorchBackend(DEMO_DIR / "text_multimax.pt", device="cpu")
    if kind == "onnxruntime":
        from service.engine.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(DEMO_DIR / "text_multimax.onnx")
    # an onnxruntime-genai folder whose GroupQueryAttention keeps the cache right-padded
    from export.genai_folder import write_folder
    from service.engine.model_folders import GenaiTextBackend

    model, ckpt, _ = load(DEMO_DIR / "text_multimax.pt")
    folder = write_folder(model, ckpt, tmp_path / "genai", with_library=False)
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    return GenaiTextBackend(folder, decoder, Settings(intra_op_threads=1), context=128)


async def _wait(seq: GenSequence, tokens: int | None = None) -> None:
    while not (seq.done or (tokens is not None and seq.generated >= tokens)):
        await seq.changed.wait()
        seq.changed.clear()


def _params(tokens: int = 8, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, **kwargs)


@pytest.mark.parametrize("kind", ["torch", "onnxruntime", "genai-right-padded"])
def test_prompts_sharing_a_start_reuse_its_cache_and_generate_what_they_would_without_it(
    kind: str, tmp_path: Path
) -> None:
    """A first prompt fills the cache; then, one at a time and while another sequence decodes: a prompt sharing
    its start, two choices of one (n=2), one whose rest is longer than a prefill chunk; each sequence's greedy
    tokens and logprobs equal the same scheduler's with the cache off, and the model's own greedy text."""
    model, _, _ = load(DEMO_DIR / "text_multimax.pt")
    questions = ["Where is the file?", "What is the name of it?", "Why does the light fade " * 2]

    def scenario(budget: int) -> tuple[list[GenSequence], TextScheduler]:
        metrics = Metrics()
        sched = TextScheduler("text", _backend(kind, tmp_path), TOK, 128, ThreadPoolExecutor(1), metrics, 8, 64,
                              prefill_chunk=16, prefix_cache_bytes=budget)
        first = GenSequence(TOK.encode(SYSTEM + "Hello."), _params(logprobs=2))
        group = object()
        later = [GenSequence(TOK.encode(SYSTEM + questions[0]), _params(logprobs=2)),
                 *[GenSequence(TOK.encode(SYSTEM + questions[1]), _params(seed=5), group=group) for _ in range(2)],
                 GenSequence(TOK.encode(SYSTEM + questions[2]), _params(logprobs=1))]
        hold = GenSequence(TOK.encode("Return the"), _params(40))

        async def main() -> None:
            sched.start()
            sched.submit([first])
            await _wait(first)
            sched.submit([hold])  # decodes while the next two arrive: their rests are prefilled beside it
            await _wait(hold, 2)
            for wave in ([later[0]], later[1:3]):
                sched.submit(wave)
                for seq in wave:
                    await _wait(seq)
            await _wait(hold)
            sched.submit([later[3]])  # on an idle model
            await _wait(later[3])
            await sched.close()

        asyncio.run(main())
        return [first, *later, hold], sched

    cached, with_cache = scenario(64 << 20)
    plain, without = scenario(0)
    stats = with_cache.prefix_cache.stats
    assert stats.hits == 3 and stats.hit_tokens == 3 * 3 * BLOCK, stats  # the system prompt's 3 whole blocks
    assert without.prefix_cache.stats.hits == 0
    for a, b in zip(cached, plain, strict=True):
        assert a.error is None and b.error is None
        assert a.tokens == b.tokens, TOK.decode(a.prompt)
        assert a.tokens == generate(model, a.prompt, a.params.max_tokens, temperature=0.0)[0]
        if a.params.logprobs:
            assert np.allclose(a.logprobs.chosen, b.logprobs.chosen, atol=1e-4)
    assert with_cache.steps["prefill_chunks"] >= 2  # the first question's rest (29 tokens), 16 a chunk beside `hold`
    counted = {name: with_cache.metrics.registry.get_sample_value(f"multimax_prefix_cache_{name}_total",
                                                                  {"model": "text"})
               for name in ("queries", "hits", "hit_tokens")}
    assert counted == {"queries": 4, "hits": 3, "hit_tokens": 9 * BLOCK}  # the first prompt's lookup missed
    assert with_cache.metrics.registry.get_sample_value("multimax_prefix_cache_bytes", {"model": "text"}) > 0


# ---- through the server, on a model transformers wrote ---------------------------------------------------------


def test_chats_sharing_a_system_prompt_hit_the_cache_and_answer_as_without_it(tmp_path: Path) -> None:
    """A Llama written by transformers' save_pretrained (the demo LLM's tokenizer and chat template), served as a
    folder twice: --prefix-cache-mb 0 and the default. Chats with one long system prompt and different questions
    get the same greedy answers and logprobs from both; the default server counts hits in /metrics."""
    import shutil

    import transformers
    from fastapi.testclient import TestClient

    from service.edge.app import create_app

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      eos_token_id=0, pad_token_id=0, bos_token_id=None, tie_word_embeddings=True)
    folder = tmp_path / "models" / "hf_llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "llama_seglu" / name, folder / name)
    system = "You answer questions about the weather in the north, briefly and politely, in plain words. " * 2
    questions = ["Will it rain today?", "Is it cold in the hills?", "What about the wind tonight?"]

    def answers(megabytes: float) -> tuple[list[dict[str, Any]], str]:
        app = create_app(Settings(model_dir=tmp_path / "models", models=("hf_llama",), intra_op_threads=1,
                                  backend="torch", warmup_calls=0, prefix_cache_mb=megabytes))  # the folder itself
        out = []
        with TestClient(app) as client:
            for q in questions:
                r = client.post("/v1/chat/completions", json={
                    "model": "hf_llama", "max_tokens": 8, "temperature": 0, "logprobs": True,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0])
            metrics = client.get("/metrics").text
        return out, metrics

    cached, metrics = answers(256)
    plain, plain_metrics = answers(0)
    for a, b in zip(cached, plain, strict=True):
        assert a["message"]["content"] == b["message"]["content"]
        got = [t["logprob"] for t in a["logprobs"]["content"]]
        want = [t["logprob"] for t in b["logprobs"]["content"]]
        assert np.allclose(got, want, atol=1e-4 * max(1.0, *map(abs, want)))
    assert 'multimax_prefix_cache_hits_total{model="hf_llama"} 2.0' in metrics  # the 2nd and 3rd chats
    assert 'multimax_prefix_cache_hits_total{model="hf_llama"}' not in plain_metrics or \
        'multimax_prefix_cache_hits_total{model="hf_llama"} 0.0' in plain_metrics
