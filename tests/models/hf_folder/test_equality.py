"""Hugging Face ForCausalLM folders with MultiMax (SegLU) tensors, proved against transformers itself.

Tiny models of each architecture are made here with transformers (random config, save_pretrained) plus the
SegLU tensors as PaddleFleet writes them (paper Table 8 values) and a BPE tokenizer trained with `tokenizers`.
The reference is transformers' own model with SegLU applied to its logits (and, where the folder has attention
MultiMax, transformers' attention with the scores modulated before the mask: a registered attention function).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AttentionInterface, GenerationConfig, LogitsProcessor, LogitsProcessorList  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: E402

from models.cli import main  # noqa: E402
from models.generate import generate  # noqa: E402
from models.hf_folder import load_folder  # noqa: E402
from models.llama import Llama, LlamaConfig, hf_name, rope_frequencies  # noqa: E402
from models.loading import CheckpointError  # noqa: E402
from models.multimax import PAPER_TABLE_8, paper_row_to_params  # noqa: E402

TOL = 1e-4  # fp32 logits


@pytest.fixture(autouse=True)
def one_thread_no_grad():
    """Tiny models gain nothing from intra-op threads (on a busy machine OpenMP barriers make them crawl)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        yield
    torch.set_num_threads(before)
CORPUS = [
    "MultiMax reweights the attention scores with a learned piecewise modulation before the softmax.",
    "The quick brown fox jumps over the lazy dog, and the dog sleeps in the warm afternoon sun.",
    "Language models are trained at scale; the modulation is called SegLU there and sits on the LM head.",
    "def add(a, b):\n    return a + b  # numbers 0123456789 and punctuation !?;:",
]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def seglu(x: torch.Tensor, ranges: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    """MULTIMAX.md's sigma, written out here independently of models.multimax."""
    r = torch.relu
    return (x + ts[0] * r(ranges[0] - x) + ts[1] * r(x - ranges[1])
            + ts[2] * r(ranges[2] - x) ** 2 + ts[3] * r(x - ranges[3]) ** 2)


def table8(row: int) -> tuple[torch.Tensor, torch.Tensor]:
    ranges, ts = paper_row_to_params(PAPER_TABLE_8[row])
    return torch.tensor(ranges), torch.tensor(ts)


# ---- the reference: transformers, with MultiMax on the scores where the folder has it ----------------------

def _multimax_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention, with the layer's SegLU on the scaled scores before the mask is added
    (in fp32 for half-precision scores, as PaddleFleet's kernels and the project compute it)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    params = getattr(module, "seglu", None)
    if params is not None:
        scores = seglu(scores.float(), *params)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


AttentionInterface.register("multimax_eager", _multimax_attention)
AttentionMaskInterface.register("multimax_eager", eager_mask)


class SegLUProcessor(LogitsProcessor):
    def __init__(self, ranges: torch.Tensor, ts: torch.Tensor) -> None:
        self.ranges, self.ts = ranges, ts

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return seglu(scores.float(), self.ranges, self.ts)


class Reference:
    """transformers' model of a folder plus the folder's SegLU values."""

    def __init__(self, folder: Path, lm_head: tuple[torch.Tensor, torch.Tensor],
                 attention: dict[int, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype = torch.float32) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="multimax_eager", dtype=dtype).eval()
        self.lm_head = lm_head
        for i, params in attention.items():
            self.model.model.layers[i].self_attn.seglu = params

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return seglu(self.model(ids, attention_mask=mask).logits.float(), *self.lm_head)

    @torch.no_grad()
    def greedy(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> list[list[int]]:
        config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = self.model.generate(ids, attention_mask=mask, generation_config=config,
                                  logits_processor=LogitsProcessorList([SegLUProcessor(*self.lm_head)]))
        return out[:, ids.shape[1]:].tolist()


# ---- fixtures: built once per session ------------------------------------------------------------------

def train_tokenizer(out: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)


def add_tensors(folder: Path, extra: dict[str, torch.Tensor]) -> None:
    """Write tensors beside the weights as PaddleFleet does (into the single file, or the first shard)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        shard = sorted(set(meta["weight_map"].values()))[0]
        meta["weight_map"].update(dict.fromkeys(extra, shard))
        index.write_text(json.dumps(meta, indent=2))
        path = folder / shard
    else:
        path = folder / "model.safetensors"
    tensors = load_file(path) | extra
    save_file(tensors, path, metadata={"format": "pt"})


def make_folder(out: Path, tokenizer: Path, config: Any, head_prefix: str, attention_layers: list[int],
                modules: list[str] | None, shard: str | None = None, dtype: torch.dtype = torch.float32) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # beyond the N(0, 0.02) init: non-zero biases, norms away from 1, logits of order 1
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(out, max_shard_size=shard) if shard else model.to(dtype).save_pretrained(out)
    for name in tokenizer.iterdir():
        shutil.copy(name, out / name.name)
    extra = dict(zip((f"{head_prefix}multimax_ranges", f"{head_prefix}multimax_ts"), table8(5), strict=True))
    for i in attention_layers:
        extra |= dict(zip((f"model.layers.{i}.self_attn.multimax_ranges", f"model.layers.{i}.self_attn.multimax_ts"),
                          table8(i), strict=True))
    add_tensors(out, extra)
    if modules is not None:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(cfg | {"multimax_modules": modules}, indent=2))
    return out


SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)


def arch_configs() -> dict[str, tuple[Any, dict[str, Any]]]:
    """Per architecture: its transformers config and how the SegLU tensors are written."""
    return {
        # untied, every projection biased, llama3 RoPE, SegLU on the head and attention MultiMax in every layer
        "llama": (transformers.LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5,
                                           rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}),
                  dict(head_prefix="lm_head.", attention_layers=[0, 1], modules=["lm_head", "attention"])),
        # tied, q/k/v bias, theta 1e6, sharded safetensors with an index
        "qwen2": (transformers.Qwen2Config(**SMALL, tie_word_embeddings=True, rope_theta=1e6),
                  dict(head_prefix="lm_head.", attention_layers=[], modules=["lm_head"], shard="100KB")),
        # q/k norm, head_dim 32 != 64/4, yarn RoPE, the MTP-shared head name, attention MultiMax in layer 1 only
        "qwen3": (transformers.Qwen3Config(**SMALL, head_dim=32, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                               "original_max_position_embeddings": 64}),
                  dict(head_prefix="model.lm_head.", attention_layers=[1], modules=None)),
    }


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    train_tokenizer(root / "tokenizer")
    return {name: make_folder(root / name, root / "tokenizer", config, **how)
            for name, (config, how) in arch_configs().items()}


@pytest.fixture(scope="session")
def loaded(hf_folders: dict[str, Path]) -> dict[str, tuple[Llama, Any, Reference]]:
    out = {}
    for name, folder in hf_folders.items():
        model, info = load_folder(folder)
        how = arch_configs()[name][1]
        ref = Reference(folder, table8(5), {i: table8(i) for i in how["attention_layers"]})
        out[name] = (model, info, ref)
    return out


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


# ---- bad input: exit 2, one line naming the file and the reason -------------------------------------------

def run_info(folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["info", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def copy_of(hf_folders: dict[str, Path], arch: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(hf_folders[arch], tmp_path / arch))


def edit_config(folder: Path, **changes: Any) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | changes))


def edit_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_info_describes_folder(hf_folders: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(hf_folders["llama"])]) == 0
    out = capsys.readouterr().out
    for needle in ("LlamaForCausalLM (model_type llama)", "kv_heads 2", "llama3 (theta 10000, factor 4",
                   "SegLU on lm_head (ranges [0.1752, 0.05374, -0.1327, -0.08826]", "attention layer 1",
                   "300 tokens", "chat template yes", "256 tokens"):
        assert needle in out, (needle, out)
    assert main(["info", str(hf_folders["qwen2"]), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["architecture"] == "Qwen2ForCausalLM" and d["multimax"]["config_modules"] == ["lm_head"]
    assert d["options"]["tied_embeddings"] and d["tokenizer"]["eos_ids"] == [1]


def test_readme_info_block_is_what_info_prints(hf_folders: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """README's `python -m models info tiny-qwen3` block (not run by tests/test_readme.py: it needs a folder
    that only transformers makes) is this fixture's output, line for line."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("$ python -m models info tiny-qwen3\n", 1)[1].split("\n$ ", 1)[0].splitlines()
    folder = Path(shutil.copytree(hf_folders["qwen3"], tmp_path / "tiny-qwen3"))
    assert main(["info", str(folder)]) == 0
    assert capsys.readouterr().out.splitlines() == block
    (folder / "tokenizer.json").unlink()
    err = run_info(folder, capsys)
    assert err.replace(str(tmp_path) + "/", "") in readme


def test_missing_tokenizer(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen3", tmp_path)
    (folder / "tokenizer.json").unlink()
    assert "tokenizer.json: no such file" in run_info(folder, capsys)


def last_shard(folder: Path) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / sorted(set(index["weight_map"].values()))[-1]


def test_bad_tokenizer_and_generation_config(hf_folders: dict, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen3", tmp_path)
    (folder / "generation_config.json").write_text("{not json")
    assert "generation_config.json: not valid JSON" in run_info(folder, capsys)
    (folder / "generation_config.json").unlink()
    (folder / "tokenizer.json").write_text('{"model": 3}')
    assert "tokenizer.json: not a tokenizers file" in run_info(folder, capsys)


def test_entry_point_exit_code(hf_folders: dict, tmp_path: Path) -> None:
    """The real command: exit code 2 and one line on stderr, no traceback."""
    import subprocess
    import sys

    folder = copy_of(hf_folders, "llama", tmp_path)
    edit_config(folder, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "models", "info", str(folder)], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: {folder}/config.json: unsupported rope_scaling type 'longrope' "
                                   "(supported: default, linear, llama3, yarn)")


def test_truncated_shard(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen2", tmp_path)
    shard = last_shard(folder)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    err = run_info(folder, capsys)
    assert f"{shard}: truncated or corrupt safetensors file" in err


def test_index_names_missing_shard(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen2", tmp_path)
    shard = last_shard(folder)
    shard.unlink()
    err = run_info(folder, capsys)
    assert f"model.safetensors.index.json: names shard {shard.name} which does not exist" in err


def test_config_does_not_match_tensors(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "llama", tmp_path)
    edit_config(folder, intermediate_size=96)
    err = run_info(folder, capsys)
    assert "model.safetensors: tensor model.layers.0.mlp.down_proj.weight has shape (64, 128)" in err
    assert "config.json implies (64, 96)" in err


def test_unknown_model_type(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "llama", tmp_path)
    edit_config(folder, model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    err = run_info(folder, capsys)
    assert "config.json: unsupported model_type 'gemma2'" in err
    assert "llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM)" in err


def test_unsupported_rope_type(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "llama", tmp_path)
    edit_config(folder, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    err = run_info(folder, capsys)
    assert "config.json: unsupported rope_scaling type 'dynamic' (supported: default, linear, llama3, yarn)" in err


def test_old_style_rope_scaling_is_read(hf_folders: dict, tmp_path: Path, loaded: dict) -> None:
    """transformers 4 wrote rope_theta and rope_scaling {"type": ...}: the same model."""
    folder = copy_of(hf_folders, "llama", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    theta = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    (folder / "config.json").write_text(json.dumps(cfg | {"rope_theta": theta, "rope_scaling": params}))
    model, _ = load_folder(folder)
    ids = torch.randint(0, 299, (1, 30))
    assert torch.equal(model(ids)[0], loaded["llama"][0](ids)[0])


@pytest.mark.parametrize("case, needle", [
    ("missing_ts", "missing tensor lm_head.multimax_ts (config.json implies shape (4,))"),
    ("wide_ranges", "tensor lm_head.multimax_ranges has shape (8,), config.json implies (4,)"),
    ("unexpected", "unexpected tensor model.layers.0.self_attn.extra_bias with shape (3,)"),
    ("layer_beyond", "unexpected tensor model.layers.2.self_attn.multimax_ranges with shape (4,)"),
    ("modules_disagree", "tensor model.layers.0.self_attn.multimax_ranges present but config.json's multimax_modules"),
    ("modules_name_missing", "missing tensor lm_head.multimax_ranges (shape (4,)) that config.json's multimax_modules"),
    ("modules_unknown", "multimax_modules ['lm_head', 'experts'] names an unsupported place"),
    ("untied_lm_head", "lm_head.weight differs from model.embed_tokens.weight but config.json says"),
])
def test_multimax_tensors_are_never_dropped(case: str, needle: str, hf_folders: dict, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "llama", tmp_path)
    if case == "missing_ts":
        edit_tensors(folder, lambda t: t.pop("lm_head.multimax_ts"))
    elif case == "wide_ranges":
        edit_tensors(folder, lambda t: t.update({"lm_head.multimax_ranges": torch.zeros(8)}))
    elif case == "unexpected":
        edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.extra_bias": torch.zeros(3)}))
    elif case == "layer_beyond":
        edit_tensors(folder, lambda t: t.update({f"model.layers.2.self_attn.multimax_{n}": torch.zeros(4)
                                                 for n in ("ranges", "ts")}))
    elif case == "modules_disagree":
        edit_config(folder, multimax_modules=["lm_head"])
    elif case == "modules_name_missing":
        edit_tensors(folder, lambda t: [t.pop(f"lm_head.multimax_{n}") for n in ("ranges", "ts")])
    elif case == "modules_unknown":
        edit_config(folder, multimax_modules=["lm_head", "experts"])
    elif case == "untied_lm_head":
        edit_config(folder, tie_word_embeddings=True)
    assert needle in run_info(folder, capsys)


def test_unsupported_options_are_refused(hf_folders: dict, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen2", tmp_path)
    edit_config(folder, use_sliding_window=True)
    assert "unsupported sliding-window attention" in run_info(folder, capsys)
    edit_config(folder, use_sliding_window=False, hidden_act="gelu")
    assert "unsupported hidden_act 'gelu' (supported: silu)" in run_info(folder, capsys)
    edit_config(folder, hidden_act="silu", architectures=["Qwen2ForSequenceClassification"])
    assert "is not ['Qwen2ForCausalLM']" in run_info(folder, capsys)
    edit_config(folder, architectures=["Qwen2ForCausalLM"], quantization_config={"quant_method": "gptq"})
    assert "unsupported quantization_config (gptq;" in run_info(folder, capsys)
    edit_config(folder, quantization_config=None,
                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6, "short_factor": [1.0]})
    assert "unsupported linear RoPE parameter(s) short_factor (supported: factor, partial_rotary_factor)" in run_info(
        folder, capsys)
