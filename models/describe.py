"""What the loader inferred about a checkpoint, for `python -m models info` (text or JSON)."""

from __future__ import annotations

from typing import Any

from torch import nn

from models import deit, fairseq_lm, gpt, llama, registry
from models.attention_function import function_name
from models.checkpoint import Checkpoint, config_of
from models.hf_folder import HFFolder
from models.onnx_contract import output_function

ORDER_NAMES = {"second": "second order", "first": "first order", "v2": "V2: affine t*x+b, then first order"}


def matching_preset(ckpt: Checkpoint) -> str | None:
    """The named preset whose architecture fields all equal the checkpoint's, if any."""
    for name, fields in registry.get(ckpt.arch).presets.items():
        if all(ckpt.config.get(k) == v for k, v in fields.items()):
            return name
    return None


def describe(model: nn.Module, ckpt: Checkpoint, info: dict[str, Any]) -> dict[str, Any]:
    config = config_of(ckpt)
    c = ckpt.config
    arch = registry.get(ckpt.arch)
    sizes = {shown: c[key] for shown, key in arch.size_fields if key in c}  # optional fields only where set
    layers = c[arch.depth_key]
    assert isinstance(config, deit.DeiTConfig | gpt.GPTConfig | llama.LlamaConfig | fairseq_lm.FairseqLMConfig)
    attention_layers = len(config.attention_layers) if isinstance(config, llama.LlamaConfig) else (
        layers if config.multimax_attention else 0)
    return {
        "format": info.get("format"),
        "architecture": ckpt.arch,
        "preset": info.get("preset") or matching_preset(ckpt),
        "sizes": sizes,
        "multimax": {
            "attention_layers": attention_layers,
            "total_layers": layers,
            "output": config.multimax_output,
            "variant": config.variant,
        },
        # the attention reweighting (models.reweighting): multimax, softmax or one of the others
        "attention": {"function": function_name(config), "options": config.attention_options or {}},
        # the output distribution (models.output_function): softmax, multimax, sparsemax, entmax15 or evsoftmax
        "output": output_function(config.to_dict()),
        "heads_from": info.get("heads_from", "config"),
        # a foreign checkpoint's reading: where its configuration and dictionary came from (fairseq)
        "read": {k: info[k] for k in ("config_from", "fairseq_arch", "dictionary") if info.get(k)},
        "parameters": sum(p.numel() for p in model.parameters()),
        "labels": ckpt.labels,
        "preprocess": ckpt.preprocess,
        "tokenizer": ckpt.tokenizer,
        "meta": {k: v for k, v in ckpt.meta.items() if k != "samples"},
    }


def format_text(d: dict[str, Any]) -> str:
    mm = d["multimax"]
    used = mm["attention_layers"] or mm["output"]
    where = []
    if mm["attention_layers"]:
        where.append(f"attention in {mm['attention_layers']}/{mm['total_layers']} layers")
    if mm["output"]:
        where.append("output layer")
    multimax = f"{' + '.join(where)} ({ORDER_NAMES[mm['variant']]})" if used else "none (plain softmax)"
    sizes = ", ".join(f"{k} {v}" for k, v in d["sizes"].items())
    labels = d["labels"]
    if labels:
        shown = ", ".join(labels[:10]) + (", ..." if len(labels) > 10 else "")
        label_text = f"{len(labels)}: {shown}"
    elif registry.task_of(d["architecture"]) == registry.VISION:
        label_text = "none stored (served with class indices as names; --labels FILE names them)"
    else:
        label_text = "none stored"
    rows = [
        ("format", d["format"]),
        ("architecture", d["architecture"]),
        ("preset", d["preset"] or "custom"),
        ("sizes", sizes),
        ("heads from", d["heads_from"]),
        *[(k.replace("_", " "), str(v)) for k, v in d["read"].items()],
        ("multimax", multimax),
        ("attention", _function_text(d["attention"])),
        ("output", d["output"]),
        ("parameters", f"{d['parameters']:,} ({d['parameters'] / 1e6:.2f}M)"),
        ("labels", label_text),
    ]
    if d["preprocess"]:
        p = d["preprocess"]
        rows.append(("preprocess", f"{p['channels']} {p['resize']}->{p['image_size']} mean {p['mean']} std {p['std']}"))
    if d["tokenizer"]:
        rows.append(("tokenizer", f"{d['tokenizer'].get('type')} ({d['tokenizer'].get('vocab_size')} tokens)"))
    metrics = d["meta"].get("metrics")
    if metrics:
        rows.append(("metrics", ", ".join(f"{k} {_value(v)}" for k, v in metrics.items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _function_text(attention: dict[str, Any]) -> str:
    options = ", ".join(f"{k}={_value(v)}" for k, v in attention["options"].items())
    return attention["function"] + (f" ({options})" if options else "")


def _value(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):  # e.g. accuracy per kind of input
        return "(" + ", ".join(f"{k} {_value(x)}" for k, x in v.items()) + ")"
    return str(v)


# ---- a Hugging Face model folder (models.hf_folder) -----------------------------------------------------

def describe_folder(model: nn.Module, folder: HFFolder) -> dict[str, Any]:
    """What `python -m models info DIR` shows of a Llama / Qwen2 / Qwen3 folder."""
    c = folder.config
    seglu = folder.multimax
    return {
        "format": "hf-folder",
        "architecture": folder.architecture,
        "model_type": c.flavor,
        "weights": folder.weight_files,
        "dtype": str(folder.dtype).removeprefix("torch."),
        "sizes": {"hidden": c.dim, "layers": c.n_layer, "heads": c.n_head, "kv_heads": c.n_local_heads,
                  "head_dim": c.head_dim, "intermediate": c.intermediate_size, "vocab": c.vocab_size},
        "context": c.block_size,
        "rope": {"theta": c.rope_base, **(c.rope_scaling or {"rope_type": "default"})},
        "options": {"norm_eps": c.norm_eps, "qkv_bias": c.qkv_bias, "o_bias": c.o_bias, "mlp_bias": c.mlp_bias,
                    "qk_norm": c.qk_norm, "tied_embeddings": c.tie_word_embeddings},
        # SegLU (MultiMax) where the weights put it, with its learned values
        "multimax": {"lm_head": seglu.get("lm_head"), "attention": seglu.get("attention") or {},
                     "config_modules": folder.hf_config.get("multimax_modules"), "variant": c.variant},
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer": folder.tokenizer.to_dict(),
        "generation": {k: v for k, v in folder.generation.items()
                       if not k.startswith("_") and k != "transformers_version"},
    }


def format_folder_text(d: dict[str, Any]) -> str:
    sizes = ", ".join(f"{k} {v}" for k, v in d["sizes"].items())
    rope = d["rope"]
    rope_text = f"{rope['rope_type']} (theta {rope['theta']:g}" + "".join(
        f", {k} {_value(v)}" for k, v in rope.items() if k not in ("rope_type", "theta") and v is not None) + ")"
    options = ", ".join(k if v is True else f"{k} {_value(v)}" for k, v in d["options"].items() if v is not False)
    mm = d["multimax"]
    seglu = []
    if mm["lm_head"]:
        seglu.append(f"lm_head (ranges {_floats(mm['lm_head']['ranges'])}, ts {_floats(mm['lm_head']['ts'])})")
    for layer, values in mm["attention"].items():
        seglu.append(f"attention layer {layer} (ranges {_floats(values['ranges'])}, ts {_floats(values['ts'])})")
    tok = d["tokenizer"]
    bos = "none" if tok["bos"] is None else f"{tok['bos']!r} ({tok['bos_id']})"
    tok_text = (f"tokenizer.json, {tok['vocab_size']} tokens, bos {bos}, eos "
                f"{tok['eos']!r} {tok['eos_ids']}, pad {tok['pad']!r}, chat template "
                f"{'yes' if tok['chat_template'] else 'no'}")
    rows = [
        ("format", f"{d['format']} ({', '.join(d['weights'])})"),
        ("architecture", f"{d['architecture']} (model_type {d['model_type']})"),
        ("dtype", d["dtype"]),
        ("sizes", sizes),
        ("context", f"{d['context']} tokens"),
        ("rope", rope_text),
        ("options", options or "none"),
        ("multimax", "SegLU on " + "; ".join(seglu) if seglu else "none (plain softmax)"),
        ("parameters", f"{d['parameters']:,} ({d['parameters'] / 1e6:.2f}M)"),
        ("tokenizer", tok_text),
    ]
    if d["generation"]:
        rows.append(("generation", ", ".join(f"{k} {_value(v)}" for k, v in d["generation"].items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _floats(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"
