"""Write a trained `models.llama.Llama` and its `tokenizers` tokenizer as a Hugging Face ForCausalLM folder.

The layout PaddleFleet writes for a SegLU model: config.json (LlamaForCausalLM, `multimax_modules`),
model.safetensors with `lm_head.multimax_ranges` / `lm_head.multimax_ts` beside the weights, tokenizer.json,
tokenizer_config.json (special tokens and a ChatML chat template) and generation_config.json. Every file is
written from sorted, fixed inputs, so the same model gives the same bytes; the folder appears whole or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from models.atomic import staging_dir
from models.llama import LlamaConfig, hf_name

# ChatML, as Qwen's templates write it (what chat clients expect of <|im_start|>/<|im_end|> models), with Qwen
# 2.5's tool use (Hermes style): `tools` as a "# Tools" block in the system turn (after the client's own system
# message, if it comes first), each function's JSON a line within <tools></tools> and the call format within
# <tool_call></tool_call>; an assistant's `tool_calls` as <tool_call>{"name": ..., "arguments": ...}</tool_call>
# (arguments given as text written as they are, as Qwen 3 does); `tool` messages as one user turn of
# <tool_response> blocks. Shorter than Qwen's: each tool's `function` object alone, and a one-line instruction
# without a default system message (the demo's context is 256 tokens). A conversation without tools, calls or
# tool messages renders exactly as the plain ChatML loop (every message `<|im_start|>role\ncontent<|im_end|>\n`).
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call these functions:\\n<tools>' }}"
    "{%- for tool in tools %}{%- if tool['function'] is defined %}{%- set tool = tool['function'] %}{%- endif %}"
    "{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call: <tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def hf_config(config: LlamaConfig, eos_id: int, pad_id: int) -> dict[str, Any]:
    """config.json for a Llama-flavoured LlamaConfig (the inverse of models.hf_folder.config_from_hf)."""
    if config.flavor != "llama" or config.rope_scaling or config.multimax_attention:
        raise ValueError("only plain-RoPE Llama configs with a SegLU head are written here")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_local_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "hidden_act": "silu",
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "multimax_modules": ["lm_head"] if config.multimax_output else [],
    }


def hf_tensors(config: LlamaConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names; a tied head is stored once (as model.embed_tokens.weight, as save_pretrained does)."""
    out = {}
    for own, tensor in sorted(state_dict.items()):
        if own == "output.weight" and config.tie_word_embeddings:
            continue
        out[hf_name(own)] = tensor.detach().to(torch.float32).contiguous().clone()
    return out


def tokenizer_config(tok: Tokenizer, eos: str, pad: str, context: int) -> dict[str, Any]:
    specials = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items() if t.startswith("<|")}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": context,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, t in sorted(specials.items())},
        "chat_template": CHAT_TEMPLATE,
    }


def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def write_folder(out: Path, config: LlamaConfig, state_dict: dict[str, torch.Tensor], tok: Tokenizer, *,
                 eos: str, stop: tuple[str, ...], pad: str) -> Path:
    """The folder `out` (replaced whole if it exists). `stop`: the tokens generation ends at (eos first)."""
    eos_id, pad_id = tok.token_to_id(eos), tok.token_to_id(pad)
    stop_ids = [tok.token_to_id(t) for t in stop]
    if eos_id is None or pad_id is None or None in stop_ids:
        raise ValueError(f"the tokenizer lacks one of {eos!r}, {pad!r}, {stop}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(out) as staging:
        new = staging / "new"
        new.mkdir()
        (new / "config.json").write_text(_dump(hf_config(config, eos_id, pad_id)))
        (new / "generation_config.json").write_text(_dump(
            {"eos_token_id": stop_ids, "pad_token_id": pad_id, "do_sample": False}))
        save_file(hf_tensors(config, state_dict), str(new / "model.safetensors"), metadata={"format": "pt"})
        (new / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
        (new / "tokenizer_config.json").write_text(_dump(tokenizer_config(tok, eos, pad, config.block_size)))
        for name in FILES:
            with open(new / name, "rb") as fh:
                os.fsync(fh.fileno())
            os.chmod(new / name, 0o644)
        os.chmod(new, 0o755)
        if out.exists():
            shutil.move(str(out), str(staging / "old"))  # removed with the staging directory
        os.replace(new, out)
    return out
