"""The architecture registry (in the manner of timm's): architecture name -> everything the packages need.

One entry per architecture: its config and model classes, its task ("vision": image classification,
"text": causal language modelling), its presets, how to adapt a foreign checkpoint layout, and what the
project's checkpoint stores beside the weights. Export-side parts (exporter, validator) are registered
against the task by `export.tasks`, so this package never imports `export`. Code that must branch on the
architecture asks this table instead of comparing strings.

A new architecture: write its config (with `from_dict` / `to_dict` / `from_preset`) and model, then call
`register(Architecture(...))` (here, or from any module: the table is open) with a `describe` hook that turns its
config into the architecture-neutral `models.spec.ModelSpec`; nothing outside `models/` reads its config fields.
A new task also needs an entry in `models.tasks` and its per-layer parts (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from models import deit, fairseq_checkpoint, fairseq_lm, gpt, llama
from models import spec as specs
from models.loading import CheckpointError
from models.onnx_contract import OnnxMetadata, attention_function, output_function
from models.spec import TEXT, VISION, ModelSpec, Reweighting, Task, TextSpec, VisionSpec
from models.tokenizer import ByteTokenizer, tokenizer_from_dict

# `Task`, `VISION`, `TEXT`: models.spec's (re-exported here: `registry.TEXT`, `registry.task_of(arch)`).
# A text model (any registered architecture of the text task) takes (ids, positions, mask, past) and returns
# (logits, presents); `empty_past(batch, dtype=None, device=None)` gives its zero-length cache. Its sizes are
# in its spec (`describe`), never read from its config outside models/.


class TextModel(Protocol):
    """A model of the text task, whatever its architecture (GPT, Llama, the fairseq LM, a registered other).

    Two capabilities each text model class declares (class attributes; models.generate and the PyTorch backend
    read them, nothing probes a model's signature or class):
    - `keeps_last_logits`: its forward takes `logits_to_keep=N` (N > 0: the logits of the last N positions only,
      (B, N, V); a prefill that samples needs one row);
    - `grows_cache_in_place`: its attention extends a past whose buffer has room in place
      (models.cache_growth.extend), so a caller may hand it a past with room to spare; False: it concatenates,
      and room would be copied for nothing.
    """

    config: Any
    training: bool
    keeps_last_logits: bool
    grows_cache_in_place: bool

    def __call__(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                 past_key_values: Any = None, attend: Any = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]: ...

    def attention_layers(self) -> list[Any]: ...  # models.attention_hook.AttentionLayer, one per layer

    def to(self, *args: Any, **kwargs: Any) -> Any: ...

    def empty_past(self, batch_size: int, dtype: torch.dtype | None = None,
                   device: Any = None) -> list[tuple[Tensor, Tensor]]: ...

    def eval(self) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...


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
    # config -> what the model takes and gives (models.spec): sizes, cache layout, reweighting placement
    describe: Callable[[Any], ModelSpec] | None = None
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
    if arch.describe is None:
        raise ValueError(f"architecture {arch.name!r} has no describe hook (config -> models.spec.ModelSpec)")
    _REGISTRY[arch.name] = arch
    return arch


def unregister(name: str) -> None:
    """Forget an architecture (a test's own, registered for the test's duration)."""
    _REGISTRY.pop(name, None)


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


def complete(spec: ModelSpec, labels: list[str] | None = None, preprocess: Mapping[str, Any] | None = None,
             tokenizer: Mapping[str, Any] | None = None) -> ModelSpec:
    """An architecture's spec with what a checkpoint or file stores beside its config: labels and preprocessing
    (vision), the tokenizer entry and its special ids (text)."""
    if isinstance(spec, VisionSpec):
        return dataclasses.replace(spec, labels=tuple(labels) if labels is not None else None, preprocess=preprocess)
    if tokenizer is None:
        return dataclasses.replace(spec, tokenizer=None)
    try:
        tok = tokenizer_from_dict(dict(tokenizer))
    except (TypeError, ValueError, KeyError):  # an unusable entry: the service refuses it with its own reason
        return dataclasses.replace(spec, tokenizer=tokenizer)
    def known(i: int) -> int | None:  # a Hugging Face tokenizer says -1 for an id it has none of
        return None if i < 0 else i
    return dataclasses.replace(spec, tokenizer=tokenizer, bos_id=known(tok.bos_id), eos_id=known(tok.eos_id),
                               pad_id=known(tok.pad_id))


def spec_of(arch: str, config: Mapping[str, Any], labels: list[str] | None = None,
            preprocess: Mapping[str, Any] | None = None, tokenizer: Mapping[str, Any] | None = None) -> ModelSpec:
    """The spec of a model of `arch` with this config dict (a checkpoint's, or a file's legacy metadata);
    KeyError for an unknown architecture, ValueError/TypeError for a config the architecture refuses."""
    entry = get(arch)
    assert entry.describe is not None
    return complete(entry.describe(entry.config(config)), labels, preprocess, tokenizer)


def describe_model(model: nn.Module | TextModel) -> ModelSpec:
    """The spec of a model object of a registered architecture (from its `config`), without checkpoint fields."""
    arch = next((a for a in _REGISTRY.values() if type(model) is a.model_cls), None) or next(
        (a for a in _REGISTRY.values() if isinstance(model, a.model_cls)), None)
    if arch is None or arch.describe is None:
        raise KeyError(f"{type(model).__name__} is not the model of a registered architecture")
    return arch.describe(model.config)


def describe_text_model(model: TextModel) -> TextSpec:
    """`describe_model` of a text model (TypeError for a model of another task)."""
    spec = describe_model(model)
    if not isinstance(spec, TextSpec):
        raise TypeError(f"{type(model).__name__} is not a text model")
    return spec


def read_spec(meta: OnnxMetadata) -> ModelSpec:
    """A file's spec: its `multimax.spec` key, or (a file exported before that key existed) the compatibility
    reader: its legacy `arch` + `config` keys through the architecture's describe hook. ValueError if neither
    gives a usable one."""
    if meta.spec is not None:
        return specs.from_dict(meta.spec, meta.labels, meta.preprocess, meta.tokenizer)
    if meta.arch is None or meta.arch not in _REGISTRY:
        raise ValueError(f"no spec metadata, and architecture {meta.arch!r} is not registered")
    try:
        return spec_of(meta.arch, meta.config, meta.labels, meta.preprocess, meta.tokenizer)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"its {meta.arch} config cannot be described: {exc}") from None


def _reweighting(config: Any, layers: list[int]) -> Reweighting:
    """The placement of a config of this project's kind (attention_function / multimax_* / output_function)."""
    fields = dataclasses.asdict(config)
    attention = attention_function(fields)
    return Reweighting(attention, tuple(layers) if attention != "softmax" else (), output_function(fields),
                       getattr(config, "variant", None), dict(getattr(config, "attention_options", None) or {}))


def _describe_deit(c: deit.DeiTConfig) -> VisionSpec:
    return VisionSpec(c.in_chans, c.img_size, c.num_classes, _reweighting(c, list(range(c.depth))),
                      tokens=(c.img_size // c.patch_size) ** 2)


def _describe_gpt(c: gpt.GPTConfig) -> TextSpec:
    return TextSpec((c.n_head,) * c.n_layer, c.head_dim, c.vocab_size, c.block_size,
                    _reweighting(c, list(range(c.n_layer))))


def _describe_llama(c: llama.LlamaConfig) -> TextSpec:
    layers = c.attention_layers if c.multimax_attention else list(range(c.n_layer))
    return TextSpec((c.n_local_heads,) * c.n_layer, c.head_dim, c.vocab_size, c.block_size, _reweighting(c, layers))


def _describe_fairseq(c: fairseq_lm.FairseqLMConfig) -> TextSpec:
    return TextSpec((c.n_head,) * c.n_layer, c.n_embd // c.n_head, c.vocab_size, c.block_size,
                    _reweighting(c, list(range(c.n_layer))))


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
    init_options=("num_classes", "pool"), describe=_describe_deit,
    size_fields=(("embed_dim", "embed_dim"), ("depth", "depth"), ("num_heads", "num_heads"),
                 ("mlp_ratio", "mlp_ratio"), ("patch_size", "patch_size"), ("image_size", "img_size"),
                 ("in_chans", "in_chans"), ("num_classes", "num_classes"), ("qkv_bias", "qkv_bias"),
                 ("pool", "pool"), ("ln_eps", "ln_eps"), ("qk_scale", "qk_scale")),
))
register(Architecture(
    "gpt", TEXT, gpt.GPTConfig, gpt.GPT, gpt.GPT_PRESETS, "n_layer", gpt.set_paper_params,
    new_checkpoint_fields=lambda: {"tokenizer": ByteTokenizer().to_dict()}, describe=_describe_gpt,
    size_fields=(("n_embd", "n_embd"), ("n_layer", "n_layer"), ("n_head", "n_head"),
                 ("block_size", "block_size"), ("vocab_size", "vocab_size")),
))
# Llama / Qwen2 / Qwen3 (one model, switched by its config); Hugging Face folders are read by models.hf_folder,
# which is not a checkpoint dict, so no `detect` here.
register(Architecture(
    "llama", TEXT, llama.LlamaConfig, llama.Llama, llama.LLAMA_PRESETS, "n_layer", llama.set_paper_params,
    describe=_describe_llama,
    size_fields=(("dim", "dim"), ("n_layer", "n_layer"), ("n_head", "n_head"), ("n_local_heads", "n_local_heads"),
                 ("head_dim", "head_dim"), ("intermediate_size", "intermediate_size"), ("block_size", "block_size"),
                 ("vocab_size", "vocab_size")),
))
register(Architecture(
    # fairseq's transformer_lm with the official MultiMax files (the paper's WikiText-103 language models)
    "fairseq_lm", TEXT, fairseq_lm.FairseqLMConfig, fairseq_lm.FairseqLM, fairseq_lm.FAIRSEQ_PRESETS, "n_layer",
    fairseq_lm.set_paper_params, adapt_checkpoint=fairseq_checkpoint.adapt_checkpoint,
    detect=fairseq_checkpoint.looks_like_fairseq, foreign_fields=lambda config, info: {"tokenizer": info["tokenizer"]},
    describe=_describe_fairseq,
    size_fields=(("n_embd", "n_embd"), ("n_layer", "n_layer"), ("n_head", "n_head"), ("ffn_dim", "ffn_dim"),
                 ("block_size", "block_size"), ("vocab_size", "vocab_size"), ("normalize_before", "normalize_before"),
                 ("final_norm", "final_norm"), ("activation", "activation"), ("positions", "positions"),
                 ("tied", "tied")),
))
