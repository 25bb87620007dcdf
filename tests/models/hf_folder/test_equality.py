"""Hugging Face ForCausalLM folders with MultiMax (SegLU) tensors, proved against transformers itself: logits,
cached decoding, greedy text, sampling, the tokenizer, RoPE scalings, half precision, .bin and sharded folders, the
project's checkpoint round trip (the reference and the folders: tests/models/hf_folder/reference.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from models.generate import generate  # noqa: E402
from models.hf_folder import load_folder  # noqa: E402
from models.llama import Llama, LlamaConfig, hf_name, rope_frequencies  # noqa: E402
from models.loading import CheckpointError  # noqa: E402
from tests.models.hf_folder.reference import CORPUS, Reference, arch_configs, make_folder, table8  # noqa: E402

TOL = 1e-4  # fp32 logits
ARCHS = ("llama", "qwen2", "qwen3")
MAX_DIFF: dict[str, float] = {}


# ---- equality with transformers ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_transformers_with_seglu(arch: str, loaded: dict) -> None:
    model, info, ref = loaded[arch]
    assert info.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM"}[arch]
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for batch, length in ((1, 1), (1, 17), (3, 12), (5, 40)):
        ids = torch.randint(0, 299, (batch, length), generator=g)
        ours, presents = model(ids)
        want = ref.logits(ids)
        assert want.std() > 0.5  # logits of order 1: the SegLU's ranges lie inside their spread
        worst = max(worst, float((ours - want).abs().max()))
        assert presents[0][0].shape == (batch, model.config.n_local_heads, length, model.config.head_dim)
    # left and right padding with attention masks: compare the real positions
    ids = torch.randint(0, 299, (4, 15), generator=g)
    lengths = [15, 9, 4, 12]
    for side in ("left", "right"):
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            if side == "left":
                mask[row, ids.shape[1] - n:] = 1
            else:
                mask[row, :n] = 1
        ours, _ = model(ids, attention_mask=mask)
        want = ref.logits(ids, mask)
        real = mask.bool()
        worst = max(worst, float((ours[real] - want[real]).abs().max()))
    assert worst < TOL, f"{arch}: max |logit difference| {worst:.3g}"
    MAX_DIFF[arch] = worst
    print(f"\n{arch}: max |logit difference| to transformers+SegLU {worst:.3g}")


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_decoding_equals_transformers(arch: str, loaded: dict) -> None:
    """Prefill then one token at a time through the KV cache, against transformers' full forward."""
    model, _, ref = loaded[arch]
    ids = torch.randint(0, 299, (2, 20), generator=torch.Generator().manual_seed(2))
    want = ref.logits(ids)
    logits, past = model(ids[:, :8])
    steps = [logits]
    for t in range(8, 20):
        logits, past = model(ids[:, t:t + 1], past_key_values=past)
        steps.append(logits)
    assert float((torch.cat(steps, dim=1) - want).abs().max()) < TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_text_equals_transformers(arch: str, loaded: dict) -> None:
    """32 greedy tokens through models.generate (KV cache, left-padded batch) = transformers' generate + SegLU."""
    model, info, ref = loaded[arch]
    tok = info.tokenizer
    prompts = [tok.encode("The quick brown fox"), tok.encode("MultiMax"), tok.encode("def add(a, b):\n    return")]
    ours = generate(model, prompts, 32, temperature=0)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    theirs = ref.greedy(ids, mask, 32)
    assert [len(o) for o in ours] == [32, 32, 32]
    assert ours == theirs
    assert [tok.decode(o) for o in ours] == [tok.decode(o) for o in theirs]


def test_sampling_stops_and_eos(loaded: dict) -> None:
    """models.generate's sampling, stop sequences (decoded by the folder's tokenizer) and several eos ids."""
    model, info, _ = loaded["qwen3"]
    tok = info.tokenizer
    prompt = tok.encode("The quick brown fox")
    first = generate(model, prompt, 24, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    assert first == generate(model, prompt, 24, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    assert first != generate(model, prompt, 24, temperature=0.9, top_k=50, top_p=0.95, seed=8)
    assert all(0 <= t < model.config.vocab_size for t in first[0])
    greedy = generate(model, prompt, 32, temperature=0)[0]
    # stop at the text of the greedy output's tokens 3..5: the output ends right before it
    stop = tok.decode(greedy[3:6])
    cut = generate(model, prompt, 32, temperature=0, stop=[stop], tokenizer=tok)[0]
    assert stop not in tok.decode(cut) and tok.decode(greedy).startswith(tok.decode(cut))
    assert len(cut) <= 6
    # an eos id ends the row (several may be given, as generation_config.json allows)
    assert generate(model, prompt, 32, temperature=0, eos_id=[999, greedy[4]])[0] == greedy[:greedy.index(greedy[4])]


def test_seglu_changes_the_model(loaded: dict) -> None:
    """The tensors transformers drops make a different model: its plain logits differ from ours."""
    model, _, ref = loaded["qwen2"]
    ids = torch.randint(0, 299, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = ref.model(ids).logits
    ours, _ = model(ids)
    assert float((ours - plain).abs().max()) > 0.05


def test_tokenizer_equals_transformers(hf_folders: dict[str, Path], loaded: dict) -> None:
    _, info, _ = loaded["llama"]
    theirs = transformers.AutoTokenizer.from_pretrained(hf_folders["llama"])
    for text in [*CORPUS, "unseen wörds ✓"]:
        assert info.tokenizer.encode(text) == theirs(text)["input_ids"]
        ids = info.tokenizer.encode(text)
        assert info.tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert (info.tokenizer.bos_id, info.tokenizer.eos_ids, info.tokenizer.pad_id) == (0, (1,), 2)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hello "}]
    assert info.tokenizer.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False,
                                                                                  add_generation_prompt=True)


def test_folder_config_and_placement(loaded: dict) -> None:
    llama, qwen2, qwen3 = (loaded[a][0].config for a in ARCHS)
    assert (llama.multimax_output, llama.attention_layers, llama.o_bias, llama.mlp_bias) == (True, [0, 1], True, True)
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert (qwen2.attention_layers, qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings) == ([], True, False, True)
    assert (qwen3.attention_layers, qwen3.qk_norm, qwen3.head_dim) == ([1], True, 32)
    shards = json.loads((loaded["qwen2"][1].path / "model.safetensors.index.json").read_text())["weight_map"]
    assert loaded["qwen2"][1].weight_files == sorted(set(shards.values())) and len(set(shards.values())) > 1
    values = loaded["qwen3"][1].multimax
    assert values["lm_head"]["ranges"] == pytest.approx(table8(5)[0].tolist(), abs=1e-6)
    assert values["attention"][1]["ts"] == pytest.approx(table8(1)[1].tolist(), abs=1e-6)
    assert hf_name("layers.3.feed_forward.w1.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert hf_name("output_multimax.ts") == "lm_head.multimax_ts"


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.707, "mscale_all_dim": 1.0},
])
def test_rope_scalings_equal_transformers(scaling: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024,
                                  rope_scaling=dict(scaling), rope_theta=50000.0)
    want, want_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    ours, scale = rope_frequencies(LlamaConfig(dim=256, n_head=4, block_size=1024, rope_base=50000.0,
                                               rope_scaling=dict(scaling)))
    assert torch.allclose(ours, want, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_folder(tmp_path: Path, hf_folders: dict[str, Path], arch: str, dtype: torch.dtype) -> None:
    """A bf16/fp16 folder runs in its dtype with the MultiMax parameters in fp32, and equals transformers in that
    dtype (SegLU on fp32 logits; attention MultiMax on fp32 scores, as PaddleFleet's kernels compute it)."""
    config, how = arch_configs()[arch]
    folder = make_folder(tmp_path / "half", hf_folders[arch].parent / "tokenizer", config,
                         **(how | {"shard": None}), dtype=dtype)
    model, info = load_folder(folder)
    assert info.dtype == dtype and model.tok_embeddings.weight.dtype == dtype
    assert model.output_multimax is not None and model.output_multimax.ranges.dtype == torch.float32
    ref = Reference(folder, table8(5), {i: table8(i) for i in how["attention_layers"]}, dtype=dtype)
    ids = torch.randint(0, 299, (3, 24), generator=torch.Generator().manual_seed(4))
    ours, _ = model(ids)
    want = ref.logits(ids)
    assert ours.dtype == torch.float32
    diff = float((ours - want).abs().max())
    assert diff < 1e-5, diff  # measured 2.4e-07: the same half-precision arithmetic, then SegLU in fp32
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


def test_pytorch_bin_folder(tmp_path: Path, hf_folders: dict[str, Path], loaded: dict) -> None:
    """pytorch_model.bin is read with weights_only=True: plain tensors load, a pickle that runs code is refused."""
    folder = tmp_path / "bin"
    shutil.copytree(hf_folders["qwen3"], folder)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    model, _ = load_folder(folder)
    ids = torch.randint(0, 299, (1, 9))
    assert torch.equal(model(ids)[0], loaded["qwen3"][0](ids)[0])

    class Evil:
        def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
            return (print, ("ran code",))

    torch.save({"model.embed_tokens.weight": Evil()}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refused"):
        load_folder(folder)


def test_sharded_pytorch_bin_folder(tmp_path: Path, hf_folders: dict[str, Path], loaded: dict) -> None:
    """pytorch_model.bin.index.json and its shards, as older transformers wrote them."""
    folder = Path(shutil.copytree(hf_folders["qwen2"], tmp_path / "bin"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    renamed = {}
    for shard in sorted(set(index["weight_map"].values())):
        renamed[shard] = shard.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
        torch.save(load_file(folder / shard), folder / renamed[shard])
        (folder / shard).unlink()
    (folder / "model.safetensors.index.json").unlink()
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    model, info = load_folder(folder)
    assert info.weight_files == sorted(renamed.values())
    ids = torch.randint(0, 299, (2, 9))
    assert torch.equal(model(ids)[0], loaded["qwen2"][0](ids)[0])


def test_project_checkpoint_round_trip(tmp_path: Path, loaded: dict) -> None:
    """A folder's model saved in the project's format (registry architecture "llama") loads back the same."""
    from models import checkpoint as ckpt_io

    model, info, _ = loaded["llama"]
    ckpt = ckpt_io.Checkpoint("llama", model.config.to_dict(), model.state_dict(), tokenizer=info.tokenizer.to_dict())
    path = ckpt_io.save_checkpoint(ckpt, tmp_path / "llama.pt")
    again, back, _ = ckpt_io.load(path)
    assert isinstance(again, Llama) and back.config == model.config.to_dict()
    ids = torch.randint(0, 299, (2, 11))
    assert torch.equal(again(ids)[0], model(ids)[0])
