"""Model folders served by their own backends (service.engine.model_folders): an onnxruntime-genai folder
(ONNX Runtime) batches prompts of different lengths, decodes in place through joins and leaves, prefills a long
prompt in chunks beside a running stream; the genai and Hugging Face folder backends grow their cache once to what
the rows may reach."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from benchmarks.server import running  # noqa: E402
from models.demo import DEMO_DIR  # noqa: E402
from models.generate import generate  # noqa: E402
from service.base.config import Settings  # noqa: E402


@pytest.mark.parametrize("multimax", ["none", "attention,output"], ids=["softmax-gqa", "multimax"])
def test_genai_folder_is_served_and_batches_prompts_of_different_lengths(
        tmp_path: Path, multimax: str, capsys: pytest.CaptureFixture[str]) -> None:
    """onnxruntime's GroupQueryAttention (the softmax graph) reads each row's cache from the start of its buffer;
    the server's batches are left-padded, so its rows are realigned around each call: every prompt of a mixed
    batch gets exactly the greedy text of the model alone."""
    from export.genai_folder import write_folder
    from models.checkpoint import load
    from models.cli import main as models_main
    from models.tokenizer import ByteTokenizer

    assert models_main(["init", "gpt-nano", "--multimax", multimax, "-o", str(tmp_path / "m.pt")]) == 0
    model, ckpt, _ = load(tmp_path / "m.pt")
    repo = tmp_path / "repo"
    repo.mkdir()
    write_folder(model, ckpt, repo / "nano-genai", with_library=False)
    capsys.readouterr()
    tok = ByteTokenizer()
    prompts = ["The", "If the file is missing, the server", "Return the", "MultiMax reweights the attention before"]
    want = [tok.decode(generate(model, tok.encode(p), 12, temperature=0.0)[0]) for p in prompts]
    with running("--model-dir", str(repo), "--intra-op-threads", "1") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        card = client.models.retrieve("nano-genai").model_dump()
        assert card["format"] == "onnxruntime-genai-folder" and card["backend"] == "onnxruntime"
        assert card["tokenizer"]["type"] == "hf-tokenizers" and card["context_length"] == 128
        assert card["multimax"]["output"] is (multimax != "none")
        r = client.completions.create(model="nano-genai", prompt=prompts, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})  # one request: prefilled as one batch
        assert [c.text for c in r.choices] == want
        results: dict[int, str] = {}

        def one(i: int) -> None:  # and sequences joining a running batch at other lengths
            results[i] = client.completions.create(model="nano-genai", prompt=prompts[i], max_tokens=12,
                                                   temperature=0, extra_body={"ignore_eos": True}).choices[0].text

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [results[i] for i in range(len(prompts))] == want


@pytest.mark.parametrize("multimax", ["none", "attention,output"], ids=["softmax-gqa", "multimax-attention"])
def test_genai_backend_decodes_in_place_through_joins_and_leaves(tmp_path: Path, multimax: str) -> None:
    """The server's decode loop on a genai folder, driven step by step: rows of different lengths prefilled
    together, the longest leaving, a newcomer merged; each row's greedy tokens equal the model's alone, and decode
    steps write into the buffer they were given. GroupQueryAttention's cache is right-padded throughout (never
    realigned), MultiMaxAttention's left-padded (its fused kernel writes in place)."""
    from export.genai_folder import write_folder
    from models.checkpoint import load
    from models.cli import main as models_main
    from plugins import ort_ops
    from service.engine.backends.cache_ops import LEFT, RIGHT, Past
    from service.engine.model_folders import GenaiTextBackend

    assert models_main(["init", "gpt-nano", "--multimax", multimax, "-o", str(tmp_path / "m.pt")]) == 0
    model, ckpt, _ = load(tmp_path / "m.pt")
    folder = write_folder(model, ckpt, tmp_path / "nano-genai", with_library=multimax != "none")
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    backend = GenaiTextBackend(folder, decoder, Settings(intra_op_threads=1))
    layout = RIGHT if multimax == "none" else LEFT
    assert backend.right_padded is (multimax == "none") and backend.cache.layout == layout
    runs_before = ort_ops.run_counts()
    prompts = [[5, 9, 77, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [100, 7]]
    newcomer = [60, 61, 62, 63, 64, 65]
    want = {i: generate(model, p, 10, temperature=0.0)[0] for i, p in enumerate([*prompts, newcomer])}

    def prefill(batch: list[list[int]]) -> tuple[list[int], Past, np.ndarray]:
        longest = max(map(len, batch))
        ids, mask = np.zeros((len(batch), longest), np.int64), np.zeros((len(batch), longest), np.int64)
        for i, p in enumerate(batch):
            ids[i, longest - len(p):], mask[i, longest - len(p):] = p, 1
        logits, past = backend.run_text(ids, mask, np.maximum(mask.cumsum(1) - 1, 0), backend.empty_past(len(batch)))
        return [int(t) for t in logits[:, -1].argmax(-1)], past, mask

    got: dict[int, list[int]] = {}
    in_place = 0
    logits_buffers: list[np.ndarray] = [np.zeros(0)]
    last, past, mask = prefill(prompts)
    rows = [0, 1, 2]
    for i, t in zip(rows, last, strict=True):
        got[i] = [t]
    for step in range(9):
        if step == 3:  # the longest prompt's row leaves; a newcomer joins
            keep = [0, 2]
            past, mask = backend.cache.select(past, mask, [rows.index(r) for r in keep])
            rows, last = keep, [last[rows.index(r)] for r in keep]
            first, new_past, new_mask = prefill([newcomer])
            past, mask = backend.cache.merge(past, mask, new_past, new_mask)
            rows, last = [*rows, 3], [*last, first[0]]
            got[3] = [first[0]]
        ids = np.array([[t] for t in last], np.int64)
        positions = mask.sum(axis=1, keepdims=True)
        mask = np.concatenate([mask, np.ones((len(rows), 1), np.int64)], axis=1)
        before = past[0][0].ctypes.data if past[0][0].shape[2] >= mask.shape[1] else None
        logits, past = backend.run_text(ids, mask, positions, past)
        assert past[0][0].shape[2] >= mask.shape[1]
        if before is not None:  # a buffer with room: written in place, not copied
            assert past[0][0].ctypes.data == before
            in_place += 1
        if logits is not logits_buffers[-1]:
            logits_buffers.append(logits)
        last = [int(t) for t in logits[:, -1].argmax(-1)]
        for r, t in zip(rows, last, strict=True):
            got[r].append(t)
    assert got[0] == want[0] and got[2] == want[2]
    assert got[1] == want[1][:4] and got[3] == want[3][:len(got[3])]
    assert in_place >= 6  # most steps wrote into the buffer they were given
    # the logits land in the backend's own buffer, bound with the cache's: a new one only with new cache buffers
    # (the first step, the leave, the join), not one read back each step
    assert len(logits_buffers) - 1 <= 3, len(logits_buffers)
    if layout == RIGHT:  # the shortest row's cache has zeros (never written) after its own positions
        k = past[0][0]
        assert not np.asarray(k[rows.index(2), :, int(mask[rows.index(2)].sum()):]).any()
    elif ort_ops.library().available:  # the fused MultiMaxAttention wrote its present into the past's buffer
        runs, in_place_runs = (a - b for a, b in zip(ort_ops.run_counts(), runs_before, strict=True))
        assert runs > 0 and in_place_runs >= runs // 2, (runs, in_place_runs)


@pytest.mark.parametrize("multimax", ["none", "attention,output"], ids=["softmax-gqa", "multimax-attention"])
def test_genai_folder_prefills_a_long_prompt_in_chunks_beside_a_running_stream(tmp_path: Path, multimax: str) -> None:
    """The decode loop over a genai folder (GroupQueryAttention's right-padded cache, MultiMaxAttention's
    left-padded one): long prompts arriving while a sequence decodes are prefilled 8 tokens a call between its
    steps (each chunk a call with the prompt's cache so far), and every sequence's greedy text is the model's."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from export.genai_folder import write_folder
    from models.checkpoint import load
    from models.cli import main as models_main
    from service.base.metrics import Metrics
    from service.engine.model_folders import load_genai_folder
    from service.engine.text.sampler import SamplingParams
    from service.engine.text.scheduler import GenSequence, TextScheduler

    assert models_main(["init", "gpt-nano", "--multimax", multimax, "-o", str(tmp_path / "m.pt")]) == 0
    model, ckpt, _ = load(tmp_path / "m.pt")
    folder = write_folder(model, ckpt, tmp_path / "nano-genai", with_library=multimax != "none")
    entry = load_genai_folder("nano-genai", folder, Settings(intra_op_threads=1))
    prompts = [[7, 8, 9], list(range(40, 80)), list(range(100, 131))]  # a running one, then 40 and 31 tokens

    async def main() -> tuple[TextScheduler, list[GenSequence]]:
        sched = TextScheduler("nano-genai", entry.backend, entry.tokenizer, 128, ThreadPoolExecutor(1),
                              Metrics(), 8, 64, prefill_chunk=8)
        sched.start()
        seqs = [GenSequence(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for p, n in zip(prompts, (80, 10, 10), strict=True)]
        sched.submit(seqs[:1])
        while seqs[0].generated < 3:
            await seqs[0].changed.wait()
            seqs[0].changed.clear()
        sched.submit(seqs[1:2])
        sched.submit(seqs[2:])
        for seq in seqs:
            while not seq.done:
                await seq.changed.wait()
                seq.changed.clear()
        await sched.close()
        return sched, seqs

    sched, seqs = asyncio.run(main())
    assert sched.steps["prefill_chunks"] == 5 + 4
    for seq in seqs:
        assert seq.error is None and seq.tokens == generate(model, seq.prompt, seq.params.max_tokens,
                                                            temperature=0.0)[0]


def _greedy_alone(backend: Any, prompt: list[int], reserve: int, steps: int,
                  buffer_of: Any) -> tuple[list[int], list[int]]:
    """`prompt` prefilled alone, the backend told `reserve`, then `steps` greedy decode steps: the tokens, and the
    positions of each distinct cache buffer the steps used (buffer_of(key) -> (its address, its positions))."""
    ids = np.array([prompt], np.int64)
    mask = np.ones_like(ids)
    logits, past = backend.run_text(ids, mask, np.arange(len(prompt))[None], backend.empty_past(1))
    backend.reserve(reserve)
    tokens, buffers = [int(logits[0, -1].argmax())], []
    for _ in range(steps):
        positions = mask.sum(axis=1, keepdims=True)
        mask = np.ones((1, mask.shape[1] + 1), np.int64)
        logits, past = backend.run_text(np.array([[tokens[-1]]], np.int64), mask, positions, past)
        where = buffer_of(past[0][0])
        if not buffers or where[0] != buffers[-1][0]:
            buffers.append(where)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens, [size for _, size in buffers]


@pytest.mark.parametrize("multimax", ["none", "attention,output"], ids=["softmax-gqa", "multimax-attention"])
def test_genai_backend_grows_its_cache_once_to_what_the_rows_may_reach(tmp_path: Path, multimax: str) -> None:
    """A decode step without room grows the cache buffers to what the decode loop said the rows may reach
    (`reserve`, at most the context and four times what the step must hold), so 80 steps after a 40-token prompt
    copy the cache once; without the hint the buffers double (82, then 128 positions: two copies). The tokens
    are the same either way."""
    from export.genai_folder import write_folder
    from models.checkpoint import load
    from models.cli import main as models_main
    from service.engine.model_folders import GenaiTextBackend

    assert models_main(["init", "gpt-nano", "--multimax", multimax, "-o", str(tmp_path / "m.pt")]) == 0
    model, ckpt, _ = load(tmp_path / "m.pt")
    folder = write_folder(model, ckpt, tmp_path / "nano-genai", with_library=multimax != "none")
    backend = GenaiTextBackend(folder, json.loads((folder / "genai_config.json").read_text())["model"]["decoder"],
                               Settings(intra_op_threads=1), context=128)
    prompt = list(range(5, 45))

    def decode(reserve: int, steps: int, prompt: list[int] = prompt) -> tuple[list[int], list[int]]:
        return _greedy_alone(backend, prompt, reserve, steps, lambda key: (key.ctypes.data, key.shape[2]))

    doubled, widths = decode(0, 80)
    assert widths == [82, 128]  # twice what the first step must hold, then the context
    reserved, widths = decode(len(prompt) + 80, 80)
    assert widths == [120] and reserved == doubled
    _, widths = decode(10_000, 10)
    assert widths == [128]  # never past the context
    _, widths = decode(10_000, 10, [5, 9, 77, 3])
    assert widths == [64]  # nor more than four times what the step must hold (a chat that may reach the context)


def test_hf_folder_backend_grows_its_cache_once_to_what_the_rows_may_reach() -> None:
    """The PyTorch backend of a Hugging Face folder (the demo LLM) takes the same hint: a decode step without room
    gets buffers for what the rows may reach, and models.cache_growth writes every later step in place; without
    the hint the cache doubles (130, then 256 positions). The tokens are the same either way."""
    from models.cache_growth import capacity
    from service.engine.model_folders import load_hf_folder

    backend = load_hf_folder("llama_seglu", DEMO_DIR / "llama_seglu", Settings(intra_op_threads=1)).backend
    assert backend.grows_in_place and backend.context == 256
    prompt = [5, 9, 77, 3]

    def decode(reserve: int, steps: int) -> tuple[list[int], list[int]]:
        return _greedy_alone(backend, prompt, reserve, steps,
                             lambda key: (key.untyped_storage().data_ptr(), capacity(key)))

    # the prefill's own buffer has room for 64 positions (models.cache_growth); then twice what a step must hold
    doubled, capacities = decode(0, 250)
    assert capacities == [64, 130, 256]
    reserved, capacities = decode(len(prompt) + 250, 250)
    assert capacities == [64, 254] and reserved == doubled
    _, capacities = decode(10_000, 100)
    assert capacities == [64, 256]  # never past the context
