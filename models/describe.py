"""What the loader inferred about a checkpoint, for `python -m models info` (text or JSON)."""

from __future__ import annotations

from typing import Any

from torch import nn

from models import deit, fairseq_lm, gpt, registry
from models.attention_function import function_name
from models.checkpoint import Checkpoint, config_of
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
    sizes = {shown: c[key] for shown, key in arch.size_fields}
    layers = c[arch.depth_key]
    assert isinstance(config, deit.DeiTConfig | gpt.GPTConfig | fairseq_lm.FairseqLMConfig)
    return {
        "format": info.get("format"),
        "architecture": ckpt.arch,
        "preset": info.get("preset") or matching_preset(ckpt),
        "sizes": sizes,
        "multimax": {
            "attention_layers": layers if config.multimax_attention else 0,
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
