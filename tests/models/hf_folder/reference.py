"""The reference for Hugging Face ForCausalLM folders with MultiMax (SegLU) tensors: transformers itself.

Tiny models of each architecture are made here with transformers (random config, save_pretrained) plus the
SegLU tensors as PaddleFleet writes them (paper Table 8 values) and a BPE tokenizer trained with `tokenizers`.
The reference is transformers' own model with SegLU applied to its logits (and, where the folder has attention
MultiMax, transformers' attention with the scores modulated before the mask: a registered attention function).
Other tests make their folders with these builders (tests/service/protocols/test_chat_serving.py,
tests/export/test_genai_llm_export.py, ...).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AttentionInterface, GenerationConfig, LogitsProcessor, LogitsProcessorList  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: E402

from models.multimax import PAPER_TABLE_8, paper_row_to_params  # noqa: E402

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


# ---- the folders: a trained tokenizer, transformers' random weights, PaddleFleet's tensors -------------------


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
