"""GPT with MultiMax: KV cache exactness, padding, masking order, sampling, tokenizer, config and loading."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from models.generate import generate, left_pad, sample_next, stop_match, top_p_filter
from models.gpt import (
    GPT,
    GPT_PRESETS,
    GPTConfig,
    KVCache,
    adapt_state_dict,
    infer_config,
    set_paper_params,
)
from models.loading import CheckpointError
from models.multimax import PAPER_TABLE_8, Modulation, attention_probs, paper_params, sigma
from models.tokenizer import ByteTokenizer


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP barriers make them crawl."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(seed: int = 0, std: float = 0.2, **overrides) -> GPT:
    """2-layer MultiMax GPT with the paper's Table 8 parameters and weights large enough for peaked attention.

    GPT-2's init (std 0.02) gives near-uniform attention and near-flat logits, which hides cache and mask bugs.
    """
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**dict(n_layer=2, n_head=2, n_embd=32, block_size=96), **overrides})
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    set_paper_params(model)
    return model.eval()


def greedy(model: GPT, prompt: list[int], n: int, **kw) -> list[int]:
    return generate(model, prompt, n, temperature=0.0, **kw)[0]


# --------------------------------------------------------------------------- KV cache and padding


def test_cached_logits_match_uncached_at_every_step() -> None:
    model = tiny_model()
    seq = torch.tensor([[72, 101, 108, 108, 111, 44, 32]])
    cache = KVCache.empty(model.config, 1)
    with torch.no_grad():
        logits, cache.layers = model(seq, past_key_values=cache.layers)
        assert torch.allclose(logits, model(seq)[0], atol=1e-5, rtol=0)
        worst = 0.0
        for _ in range(64):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            logits, cache.layers = model(nxt, past_key_values=cache.layers)
            full = model(seq)[0][:, -1:]
            worst = max(worst, (logits - full).abs().max().item())
        assert cache.length == seq.shape[1]
    assert worst <= 1e-5, worst
    assert len(set(seq[0].tolist())) > 3  # the model really moves between tokens


def test_presents_are_past_plus_new() -> None:
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        _, past = model(ids[:, :5])
        _, presents = model(ids[:, 5:], past_key_values=past)
    h, d = model.config.n_head, model.config.head_dim
    for (pk, pv), (k, v) in zip(past, presents, strict=True):
        assert pk.shape == (2, h, 5, d) and k.shape == (2, h, 9, d)
        assert torch.equal(k[:, :, :5], pk) and torch.equal(v[:, :, :5], pv)


def test_batched_left_padded_generation_matches_single_prompts() -> None:
    model = tiny_model(seed=1)
    prompts = [[84, 104, 101], [65, 32, 108, 111, 110, 103, 101, 114, 32, 111, 110, 101], [88]]
    batched = generate(model, prompts, 20, temperature=0.0)
    singles = [greedy(model, p, 20) for p in prompts]
    assert batched == singles
    # Logits, not only argmaxes: padding must not leak into real positions.
    ids, mask = left_pad(prompts, pad_id=0)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)[0][:, -1]
        for row, p in enumerate(prompts):
            alone = model(torch.tensor([p]))[0][0, -1]
            assert torch.allclose(padded[row], alone, atol=1e-5, rtol=0)


def test_attention_mask_of_ones_equals_no_mask() -> None:
    model = tiny_model()
    ids = torch.randint(0, 256, (3, 11))
    with torch.no_grad():
        a = model(ids)[0]
        b = model(ids, attention_mask=torch.ones_like(ids))[0]
    assert torch.allclose(a, b, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- masking order


def test_mask_after_modulation_keeps_fully_masked_rows_finite() -> None:
    torch.manual_seed(0)
    mod = Modulation()
    mod.set_params(*paper_params(0, PAPER_TABLE_8))
    scores = torch.randn(1, 1, 4, 4) * 5
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[2] = False
    allowed[2, 1] = True  # row 2: everything masked but one key
    mask = torch.zeros(4, 4).masked_fill(~allowed, torch.finfo(torch.float32).min)
    probs = attention_probs(scores, mod, mask)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs[0, 0, 2], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(probs.sum(-1), torch.ones(1, 1, 4))

    # The wrong order (mask, then modulate) blows up: the quadratic term squares ~3e38 (inf), and a -inf
    # mask gives -inf + inf = NaN; softmax then turns the whole row into NaN.
    ranges, ts = (torch.tensor(v) for v in paper_params(0, PAPER_TABLE_8))
    for fill in (torch.finfo(torch.float32).min, float("-inf")):
        wrong = sigma(scores.masked_fill(~allowed, fill), ranges, ts)
        assert not torch.isfinite(wrong).all()
        assert torch.isnan(torch.softmax(wrong, dim=-1)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_padding_gives_no_nan(dtype: torch.dtype) -> None:
    model = tiny_model().to(dtype)
    ids = torch.randint(0, 256, (2, 8))
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [1] * 8])
    with torch.no_grad():
        logits, presents = model(ids, attention_mask=mask)
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in presents)


# --------------------------------------------------------------------------- sampling


def test_seed_reproducibility() -> None:
    model = tiny_model()
    a = generate(model, [[1, 2, 3], [7]], 30, temperature=1.0, seed=123)
    b = generate(model, [[1, 2, 3], [7]], 30, temperature=1.0, seed=123)
    c = generate(model, [[1, 2, 3], [7]], 30, temperature=1.0, seed=124)
    assert a == b
    assert a != c


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    model = tiny_model()
    ref = greedy(model, [5, 6, 7], 25)
    assert generate(model, [5, 6, 7], 25, temperature=1.3, top_k=1, seed=0)[0] == ref
    assert generate(model, [5, 6, 7], 25, temperature=1.3, top_p=1e-6, seed=0)[0] == ref


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: torch.isfinite(top_p_filter(logits, p)).sum().item()  # noqa: E731
    assert kept(0.4) == 1 and kept(0.6) == 2 and kept(0.85) == 3 and kept(0.99) == 4
    assert sample_next(logits, temperature=0.0).item() == 0
    with pytest.raises(ValueError):
        sample_next(logits, top_p=0.0)


def test_stop_sequences_truncate() -> None:
    model = tiny_model()
    tok = ByteTokenizer()
    prompt = [84, 104, 101, 32]
    ref = greedy(model, prompt, 40)
    # Single-byte stop (as str when ASCII): output ends right before its first occurrence.
    i = next(i for i in range(3, len(ref)) if ref[i] < 128)
    stop = chr(ref[i])
    assert greedy(model, prompt, 40, stop=[stop]) == ref[: ref.index(ref[i])]
    # Two-byte stop as bytes: cut at the first place the decoded output ends with it.
    j = next(j for j in range(5, len(ref) - 1) if ref[j] < 256 and ref[j + 1] < 256)
    stop_b = bytes(ref[j : j + 2])
    end = next(e for e in range(1, len(ref) + 1) if tok.decode_bytes(ref[:e]).endswith(stop_b))
    assert greedy(model, prompt, 40, stop=[b"\xff\xfe\xfd", stop_b]) == ref[: end - 2]
    # eos ends a row and is not returned.
    assert greedy(model, prompt, 40, eos_id=ref[6]) == ref[: ref.index(ref[6])]


class _WholeText:
    """A tokenizer without `concatenates`: stop_match decodes the whole text each time."""

    concatenates = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def decode_bytes(self, ids: Any) -> bytes:
        return bytes(self.inner.decode_bytes(ids))


def test_stop_match_on_the_last_tokens_answers_as_on_the_whole_text() -> None:
    """A concatenating tokenizer has only the last tokens holding the longest stop decoded: the same answers as
    the whole text, for stops inside, across and at the edges of tokens, among special tokens (no bytes), for
    the byte tokenizer and the demo LLM's byte-level BPE (multi-byte tokens, one holding a stop and more)."""
    from models.demo import DEMO_DIR
    from models.hf_text import HFTextTokenizer
    from models.hf_tokenizer import HFTokenizer

    rng = random.Random(0)
    byte = ByteTokenizer()
    bpe = HFTextTokenizer(HFTokenizer.from_folder(DEMO_DIR / "llama_seglu"))
    assert bpe.concatenates  # (the byte tokenizer concatenates by construction)
    bpe_ids = [bpe.encode(w)[0] for w in ("a", "b", " the", "ab", "\n", " function", "e")]
    for tok, alphabet in ((byte, [97, 98, 10, 0xC3, 0xA9, 256, 257]), (bpe, [*bpe_ids, *sorted(bpe.special_ids)])):
        stop_sets = [(b"ab",), (b"\n\n", b"b\xc3\xa9"), (b"a",), (b"the f", b"nction"), (b"a" * 30,)]
        found = 0
        for _ in range(3000):
            tokens = [rng.choice(alphabet) for _ in range(rng.randrange(0, 14))]
            stops = rng.choice(stop_sets)
            got = stop_match(tokens, stops, tok)
            assert got == stop_match(tokens, stops, _WholeText(tok)), (tokens, stops)
            found += got is not None
        assert found > 100, found  # the stops were met often, not only missed


def test_stop_inside_a_token_with_text_after_it_ends_the_text_exactly_before_it() -> None:
    """Token by token, as the decode loop calls it, the first hit ends the text exactly where the whole text's
    earliest stop starts, also when the stop lies inside the last token with text after it (` function` and a
    stop `unc`; a stop `ju` inside a token `jum` went unseen before: only a text ending with the stop was one)."""
    from models.demo import DEMO_DIR
    from models.hf_text import HFTextTokenizer
    from models.hf_tokenizer import HFTokenizer

    bpe = HFTextTokenizer(HFTokenizer.from_folder(DEMO_DIR / "llama_seglu"))
    [function] = bpe.encode(" function", bos=False)
    hit = stop_match([bpe.encode("a", bos=False)[0], function], [b"unc"], bpe)
    assert hit is not None and hit.keep == 1 and hit.tail == b" f"
    rng = random.Random(1)
    words = [bpe.encode(w, bos=False)[0] for w in ("a", "b", " the", "ab", " function", "e", "\n")]
    stop_sets = [(b"nc",), (b"ea", b"he f"), (b"b t",), (b"on\na",)]
    checked = 0
    for _ in range(2000):
        tokens = [rng.choice(words) for _ in range(rng.randrange(1, 12))]
        stops = rng.choice(stop_sets)
        whole = bpe.decode_bytes(tokens)
        starts = [i for i in (whole.find(s) for s in stops) if i >= 0]
        for n in range(1, len(tokens) + 1):
            hit = stop_match(tokens[:n], stops, bpe)
            if hit is not None:
                break
        if not starts:
            assert hit is None
            continue
        assert hit is not None, (tokens, stops)
        assert bpe.decode_bytes(tokens[:hit.keep]) + hit.tail == whole[:min(starts)], (tokens, stops)
        checked += 1
    assert checked > 100


def test_context_limits() -> None:
    model = tiny_model()
    block = model.config.block_size
    with pytest.raises(ValueError, match="does not fit"):
        generate(model, list(range(block + 1)), 5)
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(1, block + 1, dtype=torch.long))
    with torch.no_grad():
        _, past = model(torch.zeros(1, block - 1, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(1, 2, dtype=torch.long), past_key_values=past)
    # Generation stops when the context is full.
    assert len(greedy(model, [1] * (block - 5), 50)) == 5
    assert generate(model, list(range(block)), 5) == [[]]
    with pytest.raises(ValueError):
        generate(model, [[1, 2], []], 5)


# --------------------------------------------------------------------------- tokenizer and config


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 259
    text = "Grüße, 世界! naïve café 🙂 — ok"
    ids = tok.encode(text, bos=True)
    assert ids[0] == 256 and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode([*ids, 257], skip_special=False) == "<|bos|>" + text + "<|eos|>"
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # truncated UTF-8 is replaced, not an error
    assert ByteTokenizer.from_dict(tok.to_dict()).to_dict() == tok.to_dict()
    assert tok.to_dict() == {
        "type": "byte",
        "special_tokens": {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258},
        "vocab_size": 259,
    }
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        ByteTokenizer.from_dict({"type": "bpe"})
    with pytest.raises(ValueError):
        tok.decode([300])


def test_config_round_trip_and_validation() -> None:
    cfg = GPTConfig.from_preset("gpt-mini", variant="v2", dropout=0.1)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.head_dim == 32
    lm = GPTConfig.from_preset("gpt-lm-6")
    assert (lm.n_layer, lm.n_head, lm.n_embd, lm.mlp_ratio * lm.n_embd) == (6, 8, 512, 2048)
    with pytest.raises(ValueError, match="gpt-nano"):
        GPTConfig.from_preset("gpt-huge")
    with pytest.raises(ValueError, match="heads"):
        GPTConfig.from_dict({**cfg.to_dict(), "heads": 3})
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="variant"):
        GPTConfig(variant="third")


def test_multimax_keys_and_paper_params() -> None:
    model = tiny_model(n_layer=3)
    keys = set(model.state_dict())
    assert {"blocks.0.attn.multimax.ranges", "blocks.2.attn.multimax.ts", "multimax.ranges", "multimax.ts"} <= keys
    for i in range(3):
        assert model.blocks[i].attn.multimax.ranges.tolist() == pytest.approx(paper_params(i, PAPER_TABLE_8)[0])
    assert model.multimax.ts.tolist() == pytest.approx(paper_params(5, PAPER_TABLE_8)[1])
    plain = GPT(GPTConfig.from_preset("gpt-nano", multimax_attention=False, multimax_output=False))
    assert not any("multimax" in k for k in plain.state_dict())


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize(
    "overrides",
    [
        dict(n_embd=48, n_head=3, bias=False, multimax_attention=False, multimax_output=True),
        dict(n_layer=3, variant="v2", mlp_ratio=2, block_size=40),
        dict(variant="first", ln_eps=1e-6),
    ],
)
def test_infer_config_recovers_config(overrides: dict) -> None:
    model = tiny_model(**overrides)
    cfg = model.config
    sd = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    # Only what the weights lack is taken from `base`: heads, LayerNorm eps, dropout, first vs second order.
    base = GPTConfig(n_embd=16 * cfg.n_head, n_head=cfg.n_head, ln_eps=cfg.ln_eps, variant=cfg.variant)
    assert infer_config(sd, base) == cfg
    loaded = GPT.from_state_dict(sd, base=base).eval()
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids)[0], model(ids)[0])


def test_infer_config_without_base_uses_presets() -> None:
    cfg = GPTConfig.from_preset("gpt-nano")
    sd = GPT(cfg).state_dict()
    del sd["lm_head.weight"]  # tied: a saver may drop it
    assert infer_config(sd) == cfg
    assert "lm_head.weight" in adapt_state_dict(sd)
    odd = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)).state_dict()
    with pytest.raises(CheckpointError, match="n_head"):
        infer_config(odd)
    assert set(GPT_PRESETS) >= {"gpt-nano", "gpt-micro", "gpt-mini", "gpt-lm-6"}


def test_wrong_shape_or_key_is_a_checkpoint_error() -> None:
    cfg = GPTConfig.from_preset("gpt-nano")
    sd = GPT(cfg).state_dict()
    bad = dict(sd, **{"blocks.1.attn.multimax.ranges": torch.zeros(5)})
    with pytest.raises(CheckpointError, match=r"blocks\.1\.attn\.multimax\.ranges"):
        GPT.from_state_dict(bad, config=cfg)
    missing = {k: v for k, v in sd.items() if k != "blocks.0.mlp.proj.bias"}
    with pytest.raises(CheckpointError, match=r"blocks\.0\.mlp\.proj\.bias"):
        GPT.from_state_dict(missing, config=cfg)
    with pytest.raises(CheckpointError, match=r"wte\.weight"):
        infer_config({"foo": torch.zeros(1)})


# --------------------------------------------------------------------------- training corpus


def test_stdlib_docstrings_corpus_is_deterministic() -> None:
    from models.training.text import split_docs, stdlib_docstring_list, stdlib_docstrings

    # A capped corpus (parsing the whole stdlib takes several seconds; the cap stops early).
    text = stdlib_docstrings(300_000)
    assert len(text.encode()) > 200_000
    assert text.isascii()
    assert stdlib_docstring_list.__wrapped__(300_000) == stdlib_docstring_list(300_000)  # fresh rebuild
    train, held = split_docs(stdlib_docstring_list(300_000))
    assert train and held and len(held) < 0.1 * len(text)


def test_train_text_smoke() -> None:
    from models.training.text import stdlib_docstring_list, train_text

    out = train_text(
        preset="gpt-nano", steps=4, batch_size=4, seq_len=32, n_samples=1, sample_tokens=8,
        max_eval_bytes=4096, docs=stdlib_docstring_list(300_000), progress=False,
    )
    m = out["metrics"]
    assert math.isfinite(m["heldout_bpb"]) and math.isfinite(m["train_loss"]) and m["steps"] == 4
    assert len(out["samples"]) == 1 and out["samples"][0].startswith("Return the")
    cfg = GPTConfig.from_dict(out["config"])
    assert cfg.multimax_attention and cfg.multimax_output
    GPT.from_state_dict(out["state_dict"], config=cfg)
    assert ByteTokenizer.from_dict(out["tokenizer"]).vocab_size == cfg.vocab_size
