"""The Llama cache grows in place (models.cache_growth) and the prefill computes only the rows it is asked for."""

from __future__ import annotations

import torch

from models.cache_growth import MIN_CAPACITY, capacity, extend
from models.generate import generate
from models.llama import Llama, LlamaConfig

SHAPE = dict(flavor="llama", vocab_size=97, block_size=300, n_layer=2, n_head=4, n_local_heads=2, dim=32,
             intermediate_size=48, multimax_output=True, multimax_attention=True,
             multimax_layers=[1])


def model() -> Llama:
    torch.manual_seed(0)
    m = Llama(LlamaConfig.from_dict(SHAPE)).eval()
    with torch.no_grad():
        for mod in (m.output_multimax, m.block_list()[1].attention.multimax):
            assert mod is not None
            mod.set_params([0.5, 1.0, -0.5, 2.0], [0.3, -0.2, 0.1, -0.05])
    return m


@torch.inference_mode()
def test_extend_writes_in_place_and_equals_concat() -> None:
    past = torch.randn(3, 2, 5, 8)
    steps = [torch.randn(3, 2, 1, 8) for _ in range(MIN_CAPACITY + 10)]
    grown, plain = past, past
    pointers = set()
    for new in steps:
        grown, plain = extend(grown, new, max_length=1000), torch.cat([plain, new], dim=2)
        assert torch.equal(grown, plain)
        pointers.add(grown.data_ptr())
    # one buffer for the first MIN_CAPACITY positions, one of twice the length after: not one copy per step
    assert len(pointers) == 2
    assert capacity(grown) == 2 * (MIN_CAPACITY + 1)
    assert capacity(torch.randn(3, 2, 5, 8)) == 5  # a tensor of its own has no room
    assert capacity(grown[:, :, 1:]) == grown.shape[2] - 1  # a view that does not start the buffer: none either


@torch.inference_mode()
def test_buffer_never_grows_past_the_context() -> None:
    grown = torch.zeros(1, 1, 0, 4)
    for _ in range(300):
        grown = extend(grown, torch.ones(1, 1, 1, 4), max_length=300)
    assert capacity(grown) == 300
    assert grown.shape[2] == 300


def test_autograd_concatenates() -> None:
    past = torch.randn(1, 1, 2, 4, requires_grad=True)
    out = extend(past, torch.randn(1, 1, 1, 4), max_length=10)
    assert capacity(out) == 3  # a fresh tensor: training never writes into a buffer autograd saved
    out.sum().backward()
    assert past.grad is not None


@torch.inference_mode()
def test_grown_cache_decoding_equals_full_forward() -> None:
    """Step by step from a left-padded batch (the server's layout) against one forward over everything."""
    m = model()
    ids = torch.randint(0, 97, (2, 90))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    full, _ = m(ids, attention_mask=mask)
    logits, past = m(ids[:, :40], attention_mask=mask[:, :40], past_key_values=m.empty_past(2))
    assert torch.allclose(logits, full[:, :40], atol=1e-5)
    for t in range(40, 90):
        step, past = m(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=past)
        assert torch.allclose(step[:, 0], full[:, t], atol=1e-4), t
    assert capacity(past[0][0]) > past[0][0].shape[2]  # the cache still has room: it was not rebuilt each step


@torch.inference_mode()
def test_logits_to_keep_is_the_last_rows() -> None:
    m = model()
    ids = torch.randint(0, 97, (2, 12))
    full, _ = m(ids)
    last, presents = m(ids, logits_to_keep=1)
    assert last.shape == (2, 1, 97)
    assert torch.allclose(last, full[:, -1:], atol=1e-6)
    assert presents[0][0].shape[2] == 12  # the cache still holds every position
    three, _ = m(ids, logits_to_keep=3)
    assert torch.allclose(three, full[:, -3:], atol=1e-6)


def test_generate_equals_uncached_greedy() -> None:
    """generate (one-row prefill, grown cache) against argmax over a full forward at every step."""
    m = model()
    prompt = [5, 17, 3, 88, 41]
    got = generate(m, prompt, max_new_tokens=40, temperature=0.0)[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(40):
            ids.append(int(m(torch.tensor([ids]))[0][0, -1].argmax()))
    assert got == ids[len(prompt):]


def test_a_cache_made_in_inference_mode_extends_outside_it() -> None:
    """PyTorch forbids writing into an inference tensor outside inference mode: that step concatenates."""
    with torch.inference_mode():
        past = extend(torch.zeros(1, 1, 0, 4), torch.ones(1, 1, 3, 4), max_length=100)
    assert capacity(past) > 3
    with torch.no_grad():
        out = extend(past, torch.full((1, 1, 1, 4), 2.0), max_length=100)
    assert out.shape[2] == 4 and float(out[0, 0, 3, 0]) == 2.0
