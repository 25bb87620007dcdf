"""The real pretrained SmolLM2-135M-Instruct (tests/pretrained.py), plain and with SegLU on its head, loaded by
this project (models.hf_folder) and by transformers: logits, greedy chat text, the tokenizer and the chat template.

The random folders of test_equality.py have logits of order 1; these span tens of units (max |logit| about 38 on
a chat prompt), where an absolute limit would be loose for one and tight for the other, so the limit scales with
the reference's largest logit. The SegLU reference is transformers' model with MULTIMAX.md's formula applied to
its logits (tests/models/hf_folder/reference.py), with the values tests/pretrained.py wrote into the folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from export import limits  # noqa: E402
from models.generate import generate  # noqa: E402
from models.hf_folder import load_folder  # noqa: E402
from tests.models.hf_folder.reference import Reference, SegLUProcessor, seglu  # noqa: E402
from tests.pretrained import SHAPE, seglu_tensors  # noqa: E402

# fp32 against fp32, by the project's one rule (export/limits.py: tol x max(1, max |reference|)); the same
# computation in the same precision, so tighter than the export's fp32 tol (ONNX Runtime against PyTorch):
# measured 1.5e-6 plain (5.8e-5 on logits of 37.6), 1.2e-6 with SegLU (8.8e-5 on 76)
REL_TOL = 1e-5
GREEDY_TOKENS = 48
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green and blue."},
     {"role": "user", "content": "And three more?"}],
]
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "unseen wörds ✓ 日本語 🙂",
         "def f(x):\n    return x ** 2  # 0123456789", "<|im_start|>user\nspecial tokens inline<|im_end|>"]


def _limit(reference: torch.Tensor) -> float:
    found = limits.limit(REL_TOL, limits.scale([reference.numpy()]))
    assert found is not None
    return found


@pytest.fixture(autouse=True)
def no_grad() -> Any:
    with torch.no_grad():
        yield


@pytest.fixture(scope="module", params=["plain", "seglu"])
def pretrained(request: pytest.FixtureRequest) -> tuple[str, Path, Any, Any, Reference, Any]:
    """(variant, folder, our model, our folder info, transformers' reference, transformers' tokenizer)."""
    folder = request.getfixturevalue("smollm2_seglu" if request.param == "seglu" else "smollm2")
    model, info = load_folder(folder)
    values = seglu_tensors()
    # the plain folder's reference has no SegLU: zero ts make the formula the identity
    head = (torch.tensor(values["lm_head.multimax_ranges"]),
            torch.tensor(values["lm_head.multimax_ts"]) * (request.param == "seglu"))
    ref = Reference(folder, head, {})
    return request.param, folder, model, info, ref, transformers.AutoTokenizer.from_pretrained(folder)


def _chat_ids(tok: Any, chat: list[dict[str, str]]) -> list[int]:
    return list(tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))["input_ids"])


def test_folder_is_read_as_the_real_model(pretrained: tuple) -> None:
    variant, _, model, info, _, _ = pretrained
    cfg = model.config
    assert info.architecture == "LlamaForCausalLM"
    assert (cfg.n_layer, cfg.dim, cfg.vocab_size, cfg.block_size) == tuple(SHAPE.values())
    assert (cfg.n_head, cfg.n_local_heads, cfg.tie_word_embeddings) == (9, 3, True)
    assert cfg.multimax_output is (variant == "seglu") and not cfg.multimax_attention
    if variant == "seglu":
        values = seglu_tensors()
        head = model.output_multimax
        assert head.ranges.tolist() == pytest.approx(values["lm_head.multimax_ranges"])
        assert head.ts.tolist() == pytest.approx(values["lm_head.multimax_ts"])
        assert info.multimax["lm_head"]["ts"] == pytest.approx(values["lm_head.multimax_ts"], abs=1e-6)
    else:
        assert model.output_multimax is None and info.multimax["lm_head"] is None


def test_logits_equal_transformers(pretrained: tuple) -> None:
    """One chat prompt alone and all of them left-padded in one batch (as the server batches them)."""
    variant, _, model, _, ref, tok = pretrained
    prompts = [_chat_ids(tok, chat) for chat in CHATS]
    ids = torch.tensor([prompts[0]])
    want = ref.logits(ids)
    assert float(want.abs().max()) > 20  # real logits: tens of units, the regime random models never reach
    ours, _ = model(ids)
    worst = float((ours - want).abs().max())
    assert worst < _limit(want), f"{variant}: max |logit difference| {worst:.3g}, limit {_limit(want):.3g}"
    width = max(len(p) for p in prompts)
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    want = ref.logits(batch, mask)
    ours, _ = model(batch, attention_mask=mask)
    real = mask.bool()
    worst = float((ours[real] - want[real]).abs().max())
    assert worst < _limit(want[real]), f"{variant}: padded batch, max |logit difference| {worst:.3g}"
    print(f"\n{variant}: max |logit| {float(want[real].abs().max()):.1f}, max |difference| {worst:.3g}")


@pytest.mark.parametrize("pretrained", ["seglu"], indirect=True)
def test_seglu_changes_the_real_models_logits(pretrained: tuple) -> None:
    """On logits of tens of units the head's quadratic terms move them by units, not by rounding."""
    _, _, model, _, ref, tok = pretrained
    ids = torch.tensor([_chat_ids(tok, CHATS[0])])
    plain = ref.model(ids).logits
    ours, _ = model(ids)
    assert float((ours - plain).abs().max()) > 1.0
    values = seglu_tensors()
    formula = seglu(plain, torch.tensor(values["lm_head.multimax_ranges"]), torch.tensor(values["lm_head.multimax_ts"]))
    assert float((ours - formula).abs().max()) < _limit(formula)


def test_greedy_chat_text_equals_transformers(pretrained: tuple) -> None:
    """48 greedy tokens through models.generate (KV cache, a left-padded batch, stopping at <|im_end|>) equal
    transformers' generate with the SegLU as a logits processor, ids and text. These SegLU values keep the order
    of the largest logits (sigma rises past ranges[1]), so both folders answer alike: the logits test above is the
    one that tells SegLU from none; this one proves the cached, padded decoding on real weights."""
    variant, _, model, info, ref, tok = pretrained
    prompts = [_chat_ids(tok, chat) for chat in CHATS]
    eos = info.tokenizer.eos_ids
    assert eos == (tok.convert_tokens_to_ids("<|im_end|>"),)
    ours = generate(model, prompts, GREEDY_TOKENS, temperature=0, eos_id=eos)
    theirs = []
    for prompt in prompts:  # one at a time: transformers pads finished rows, so no trimming guesswork
        config = transformers.GenerationConfig(max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=list(eos),
                                               pad_token_id=eos[0])
        out = ref.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 generation_config=config,
                                 logits_processor=transformers.LogitsProcessorList([SegLUProcessor(*ref.lm_head)]))
        row = out[0, len(prompt):].tolist()
        theirs.append(row[:row.index(eos[0])] if eos[0] in row else row)
    assert all(len(o) >= 4 for o in ours), ours  # real answers, not an immediate end
    assert ours == theirs
    texts = [info.tokenizer.decode(o) for o in ours]
    assert texts == [tok.decode(o, skip_special_tokens=True) for o in theirs]
    assert "Paris" in texts[0] or variant == "seglu", texts[0]  # the plain model knows it
    print(f"\n{variant}: {texts}")


def test_tokenizer_and_chat_template_equal_transformers(pretrained: tuple) -> None:
    """The folder keeps its template in chat_template.jinja (transformers 5's layout, not tokenizer_config.json)."""
    _, folder, _, info, _, tok = pretrained
    assert (folder / "chat_template.jinja").is_file() and "chat_template" not in (
        folder / "tokenizer_config.json").read_text()
    ours = info.tokenizer
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == tok(text)["input_ids"], text
        assert ours.decode(ids) == tok.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special=False) == tok.decode(ids)
    assert (ours.bos_id, ours.eos_ids, ours.pad_id) == (1, (2,), 2)
    assert ours.vocab_size == SHAPE["vocab_size"]
    for chat in CHATS:  # the first has no system message: the template inserts SmolLM's own
        for prompt in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == tok.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=prompt)
    assert "You are a helpful AI assistant named SmolLM" in ours.apply_chat_template(CHATS[0])
