"""The architecture registry (in the manner of timm's): architecture name -> everything the packages need.

One entry per architecture: its config and model classes, its task ("vision": image classification,
"text": causal language modelling), its presets, how to adapt a foreign checkpoint layout, and what the
project's checkpoint stores beside the weights. Export-side parts (exporter, validator) are registered
against the task by `export.tasks`, so this package never imports `export`. Code that must branch on the
architecture asks this table instead of comparing strings.

A new architecture: write its config (with `from_dict` / `to_dict` / `from_preset`) and model, then call
`register(Architecture(...))` below; a new task also needs an entry in `export.tasks` and a runtime in
`service.runtime`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from models import deit, fairseq_checkpoint, fairseq_lm, gpt, llama
from models.loading import CheckpointError
from models.tokenizer import ByteTokenizer

Task = Literal["vision", "text"]
# The models of the text task: each takes (ids, positions, mask, past) and returns (logits, presents), and its
# config has vocab_size, block_size, n_layer and output_function; `empty_past(batch)` gives its cache's shape.
TextModel = gpt.GPT | llama.Llama | fairseq_lm.FairseqLM
VISION: Task = "vision"
TEXT: Task = "text"

# foreign checkpoint object + hints -> (config, state dict, how it was read)
Adapter = Callable[..., tuple[Any, dict[str, Any], dict[str, Any]]]


@dataclass(frozen=True)
class Architecture:
    name: str
    task: Task
    config_cls: type
    model_cls: type[nn.Module]
    presets: Mapping[str, Mapping[str, Any]]
    depth_key: str  # the config field that counts the transformer blocks
    set_paper_params: Callable[[Any], Any]  # the paper's MultiMax parameters (Tables 7/8), in place
    adapt_checkpoint: Adapter | None = None  # foreign layouts (official MultiMax / timm / fairseq), if any
    # what a checkpoint read from a foreign layout stores beside the weights: (config, adapter info) -> fields
    foreign_fields: Callable[[Any, dict[str, Any]], dict[str, Any]] = lambda config, info: {}
    detect: Callable[[Mapping[str, Any]], bool] | None = None  # does a foreign checkpoint dict hold this arch
    # what a new checkpoint of this architecture stores beside the weights (preprocess or tokenizer)
    new_checkpoint_fields: Callable[[], dict[str, Any]] = dict
    init_options: tuple[str, ...] = ()  # `python -m models init` options that reach this config
    # `python -m models info`: (shown name, config field) of the sizes worth showing (where the config has it)
    size_fields: tuple[tuple[str, str], ...] = ()

    def config(self, fields: Mapping[str, Any]) -> Any:
        return self.config_cls.from_dict(dict(fields))  # type: ignore[attr-defined]

    def model(self, config: Any) -> nn.Module:
        return self.model_cls(config)

    def preset_config(self, preset: str, **overrides: Any) -> Any:
        return self.config_cls.from_preset(preset, **overrides)  # type: ignore[attr-defined]


_REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    if arch.name in _REGISTRY:
        raise ValueError(f"architecture {arch.name!r} is registered already")
    _REGISTRY[arch.name] = arch
    return arch


def get(name: str) -> Architecture:
    """The entry for `name`; a KeyError naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown architecture {name!r} (known: {', '.join(_REGISTRY)})") from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def task_of(name: str) -> Task:
    return get(name).task


def task_or_none(name: str | None) -> Task | None:
    """The task of `name`, None for an unknown architecture (the caller says what it does with that)."""
    arch = _REGISTRY.get(name or "")
    return arch.task if arch is not None else None


def for_preset(preset: str) -> Architecture | None:
    """The architecture that has a preset of this name."""
    return next((a for a in _REGISTRY.values() if preset in a.presets), None)


def all_presets() -> list[str]:
    return [p for a in _REGISTRY.values() for p in a.presets]


def for_foreign(obj: Mapping[str, Any]) -> Architecture | None:
    """The architecture whose detector recognises a checkpoint dict in a foreign layout."""
    return next((a for a in _REGISTRY.values() if a.detect is not None and a.detect(obj)), None)


def _looks_like_deit(obj: Mapping[str, Any]) -> bool:
    for key in ("model", "model_ema", "state_dict"):
        if isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    return any(str(k).endswith("patch_embed.proj.weight") for k in obj)


def _adapt_deit(obj: Any, source: str = "checkpoint", dictionary: str | None = None,
                **hints: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    if dictionary is not None:
        raise CheckpointError(f"{source}: --dict applies to fairseq language models, not to a DeiT checkpoint")
    return deit.adapt_checkpoint(obj, **hints)


def _deit_foreign_fields(config: deit.DeiTConfig, info: dict[str, Any]) -> dict[str, Any]:
    size = config.img_size
    return {"preprocess": dict(deit.IMAGENET_PREPROCESS) | {"image_size": size, "resize": round(size / 0.875)}}


register(Architecture(
    "deit", VISION, deit.DeiTConfig, deit.DeiT, deit.DEIT_PRESETS, "depth", deit.set_paper_params,
    adapt_checkpoint=_adapt_deit, detect=_looks_like_deit, foreign_fields=_deit_foreign_fields,
    new_checkpoint_fields=lambda: {"preprocess": dict(deit.IMAGENET_PREPROCESS)},
    init_options=("num_classes", "pool"),
    size_fields=(("embed_dim", "embed_dim"), ("depth", "depth"), ("num_heads", "num_heads"),
                 ("mlp_ratio", "mlp_ratio"), ("patch_size", "patch_size"), ("image_size", "img_size"),
                 ("in_chans", "in_chans"), ("num_classes", "num_classes"), ("qkv_bias", "qkv_bias"),
                 ("pool", "pool"), ("ln_eps", "ln_eps"), ("qk_scale", "qk_scale")),
))
register(Architecture(
    "gpt", TEXT, gpt.GPTConfig, gpt.GPT, gpt.GPT_PRESETS, "n_layer", gpt.set_paper_params,
    new_checkpoint_fields=lambda: {"tokenizer": ByteTokenizer().to_dict()},
    size_fields=(("n_embd", "n_embd"), ("n_layer", "n_layer"), ("n_head", "n_head"),
                 ("block_size", "block_size"), ("vocab_size", "vocab_size")),
))
# Llama / Qwen2 / Qwen3 (one model, switched by its config); Hugging Face folders are read by models.hf_folder,
# which is not a checkpoint dict, so no `detect` here.
register(Architecture(
    "llama", TEXT, llama.LlamaConfig, llama.Llama, llama.LLAMA_PRESETS, "n_layer", llama.set_paper_params,
    size_fields=(("dim", "dim"), ("n_layer", "n_layer"), ("n_head", "n_head"), ("n_local_heads", "n_local_heads"),
                 ("head_dim", "head_dim"), ("intermediate_size", "intermediate_size"), ("block_size", "block_size"),
                 ("vocab_size", "vocab_size")),
))
register(Architecture(
    # fairseq's transformer_lm with the official MultiMax files (the paper's WikiText-103 language models)
    "fairseq_lm", TEXT, fairseq_lm.FairseqLMConfig, fairseq_lm.FairseqLM, fairseq_lm.FAIRSEQ_PRESETS, "n_layer",
    fairseq_lm.set_paper_params, adapt_checkpoint=fairseq_checkpoint.adapt_checkpoint,
    detect=fairseq_checkpoint.looks_like_fairseq, foreign_fields=lambda config, info: {"tokenizer": info["tokenizer"]},
    size_fields=(("n_embd", "n_embd"), ("n_layer", "n_layer"), ("n_head", "n_head"), ("ffn_dim", "ffn_dim"),
                 ("block_size", "block_size"), ("vocab_size", "vocab_size"), ("normalize_before", "normalize_before"),
                 ("final_norm", "final_norm"), ("activation", "activation"), ("positions", "positions"),
                 ("tied", "tied")),
))
