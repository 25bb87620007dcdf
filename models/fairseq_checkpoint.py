"""fairseq `transformer_lm` checkpoints (the paper's WikiText-103 models) -> FairseqLMConfig and a state dict.

fairseq's trainer writes `{"args", "cfg", "model", "criterion", "optimizer_history", ...}`. Its configuration is
`cfg` as a plain dict (fairseq 0.12), an `argparse.Namespace` in `args` (older fairseq) or an omegaconf
`DictConfig`. `torch.load(weights_only=True)` refuses the last two; `SAFE_GLOBALS` lets it rebuild them as
inert stand-ins (plain data, no omegaconf code runs, nothing else is allowed), which `plain` turns into dicts.
A pickle that asks for any other global (a `__reduce__` payload) is still refused before anything runs.

Every architecture switch is read from the configuration (`_config`); adaptive input / adaptive softmax and the
other variants this model does not implement are refused by name.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from .fairseq_dict import tokenizer_for
from .fairseq_lm import FairseqLMConfig
from .loading import CheckpointError


class _Inert:
    """A stand-in for an omegaconf object: keeps the pickled state as data and has no behaviour."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.state = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _DictConfig(_Inert):
    pass


class _ListConfig(_Inert):
    pass


class _ValueNode(_Inert):
    pass


class _Metadata(_Inert):
    pass


class _Marker:
    """What a pickled type reference (typing.Any, builtins.dict as a metadata field) becomes: just a name."""

    def __init__(self, *args: Any) -> None:
        self.args = args


_NODES = ("AnyNode", "StringNode", "IntegerNode", "FloatNode", "BooleanNode", "EnumNode", "ValueNode",
          "BytesNode", "PathNode")
# full pickle name -> stand-in; used as torch.serialization.safe_globals([(stand-in, name), ...])
SAFE_GLOBALS: list[tuple[Any, str]] = [
    (_DictConfig, "omegaconf.dictconfig.DictConfig"),
    (_ListConfig, "omegaconf.listconfig.ListConfig"),
    (_Metadata, "omegaconf.base.ContainerMetadata"),
    (_Metadata, "omegaconf.base.Metadata"),
    *[(_ValueNode, f"omegaconf.nodes.{n}") for n in _NODES],
    # type references in omegaconf's metadata (ref_type, object_type, key_type) and its resolver cache
    *[(_Marker, name) for name in ("typing.Any", "builtins.dict", "builtins.list", "builtins.int", "builtins.float",
                                   "builtins.str", "builtins.bool", "builtins.object", "collections.defaultdict")],
]


def plain(obj: Any, depth: int = 0) -> Any:
    """Stand-ins, Namespaces and containers -> dicts, lists and scalars (the config as data)."""
    if depth > 50:
        raise CheckpointError("fairseq configuration nested too deeply")
    if isinstance(obj, argparse.Namespace):
        return {k: plain(v, depth + 1) for k, v in vars(obj).items()}
    if isinstance(obj, _DictConfig):
        content = _content(obj)
        if content is None or isinstance(content, str):  # a None or interpolation ("${...}") node
            return content
        return {str(k): plain(v, depth + 1) for k, v in dict(content).items()}
    if isinstance(obj, _ListConfig):
        content = _content(obj)
        return content if content is None or isinstance(content, str) else [plain(v, depth + 1) for v in content]
    if isinstance(obj, _ValueNode):
        state = obj.state if isinstance(obj.state, Mapping) else {}
        return plain(state.get("_val"), depth + 1)
    if isinstance(obj, Mapping):
        return {k: plain(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v, depth + 1) for v in obj]
    if isinstance(obj, _Inert | _Marker):
        raise CheckpointError(f"fairseq configuration holds an unexpected {type(obj).__name__}")
    return obj


def _content(node: _Inert) -> Any:
    state = node.state if isinstance(node.state, Mapping) else {}
    content = state.get("_content")
    if content is not None and not isinstance(content, Mapping | list | tuple | str):
        raise CheckpointError(f"fairseq configuration: unreadable container ({type(content).__name__})")
    return content


_INTERPOLATION = re.compile(r"^\$\{([\w.]+)\}$")


def resolve(value: Any, root: Mapping[str, Any], depth: int = 0) -> Any:
    """omegaconf's plain interpolations (`${task.tokens_per_sample}`, as fairseq's dataclasses use) looked up in
    the configuration itself; anything else (resolvers, missing paths) stays as written."""
    if isinstance(value, Mapping):
        return {k: resolve(v, root, depth) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, root, depth) for v in value]
    m = _INTERPOLATION.match(value) if isinstance(value, str) else None
    if m is None or depth > 10:
        return value
    target: Any = root
    for part in m.group(1).split("."):
        if not isinstance(target, Mapping) or part not in target:
            return value
        target = target[part]
    return resolve(target, root, depth + 1)


def looks_like_fairseq(obj: Mapping[str, Any]) -> bool:
    """fairseq's trainer layout: `model` a state dict with `decoder.*` keys beside `cfg` or `args`."""
    model = obj.get("model")
    return (("cfg" in obj or "args" in obj) and isinstance(model, Mapping)
            and any(str(k).startswith("decoder.") for k in model))


def model_config(obj: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(model fields, task fields, where they came from) from `cfg` (dict or DictConfig) or `args`."""
    cfg = obj.get("cfg")
    if cfg is not None:
        cfg = plain(cfg)
        if isinstance(cfg, Mapping):
            cfg = resolve(cfg, cfg)
        if not isinstance(cfg, Mapping) or not isinstance(cfg.get("model"), Mapping):
            raise CheckpointError("fairseq checkpoint: cfg has no model section")
        task = cfg.get("task") if isinstance(cfg.get("task"), Mapping) else {}
        kind = "cfg (omegaconf DictConfig)" if isinstance(obj["cfg"], _DictConfig) else "cfg (dict)"
        model = dict(cfg["model"])
        if isinstance(model.get("_name"), str):
            model.setdefault("arch", model["_name"])
        return model, dict(task or {}), kind
    args = obj.get("args")
    if args is None:
        raise CheckpointError("fairseq checkpoint: neither cfg nor args holds the configuration")
    fields = plain(args)
    if not isinstance(fields, Mapping):
        raise CheckpointError(f"fairseq checkpoint: args is a {type(args).__name__}, not a namespace")
    kind = "args (argparse.Namespace)" if isinstance(args, argparse.Namespace) else "args"
    return dict(fields), dict(fields), kind


# configuration switches that change the computation and that this model does not implement
_REFUSED = {
    "adaptive_input": "adaptive input (--adaptive-input)",
    "character_embeddings": "character embeddings (--character-embeddings)",
    "scale_attn": "scaled attention (--scale-attn)",
    "scale_fc": "scaled FFN (--scale-fc)",
    "scale_heads": "scaled heads (--scale-heads)",
    "scale_resids": "scaled residuals (--scale-resids)",
    "decoder_xformers_att_config": "xformers attention",
    "add_bos_token": "--add-bos-token (the LM input would not start with </s>)",
}


def _refuse(model: Mapping[str, Any], sd: Mapping[str, Any]) -> None:
    arch = str(model.get("arch") or model.get("_name") or "")
    if arch and not arch.startswith("transformer_lm"):
        raise CheckpointError(f"fairseq architecture {arch!r} is not supported (only transformer_lm and its variants)")
    if any(str(k).startswith("encoder.") for k in sd):
        raise CheckpointError("fairseq encoder-decoder models are not supported (only transformer_lm decoders)")
    if model.get("adaptive_softmax_cutoff") or any(".adaptive_softmax." in str(k) for k in sd):
        raise CheckpointError("fairseq adaptive softmax (--adaptive-softmax-cutoff) is not supported")
    for key, what in _REFUSED.items():
        if model.get(key):
            raise CheckpointError(f"fairseq {what} is not supported")
    if float(model.get("quant_noise_pq") or 0) > 0:
        raise CheckpointError("fairseq quant-noise (--quant-noise-pq) is not supported")
    if int(model.get("base_layers") or 0) > 0:
        raise CheckpointError("fairseq BASE layers (--base-layers) are not supported")


def _need(model: Mapping[str, Any], key: str) -> Any:
    if model.get(key) is None:
        raise CheckpointError(f"fairseq configuration lacks {key}; cannot tell the architecture")
    return model[key]


def _flag(model: Mapping[str, Any], key: str) -> bool:
    """A boolean switch; absent means fairseq's default (False) for every switch read this way."""
    value = model.get(key, False)
    if not isinstance(value, bool | int) and value is not None:
        raise CheckpointError(f"fairseq configuration: {key} is {value!r}, not a boolean")
    return bool(value)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _config(model: Mapping[str, Any], task: Mapping[str, Any], sd: Mapping[str, Tensor]) -> FairseqLMConfig:
    embed = sd.get("decoder.embed_tokens.weight")
    if not isinstance(embed, Tensor) or embed.dim() != 2:
        raise CheckpointError("fairseq checkpoint: no decoder.embed_tokens.weight matrix")
    n_embd = int(_need(model, "decoder_embed_dim"))
    layers = {int(m.group(1)) for k in sd if (m := _LAYER.match(k))}
    n_layer = int(model.get("decoder_layers") or 0)
    if n_layer != len(layers):
        raise CheckpointError(f"fairseq configuration says {n_layer} decoder layers, the weights hold {len(layers)}")
    normalize_before = _flag(model, "decoder_normalize_before")
    if "decoder_normalize_before" not in model:
        raise CheckpointError("fairseq configuration lacks decoder_normalize_before; cannot tell pre- from post-norm")
    learned = _flag(model, "decoder_learned_pos")
    positions = "none" if _flag(model, "no_token_positional_embeddings") else "learned" if learned else "sinusoidal"
    block = model.get("max_target_positions") or task.get("max_target_positions") or task.get("tokens_per_sample")
    if positions == "learned":
        block = int(sd["decoder.embed_positions.weight"].shape[0]) - 2 if "decoder.embed_positions.weight" in sd \
            else block
    if not block:
        raise CheckpointError("fairseq configuration lacks max_target_positions / tokens_per_sample")
    activation = str(model.get("activation_fn") or "relu")
    try:
        return FairseqLMConfig(
            vocab_size=int(embed.shape[0]),
            block_size=int(block),
            n_layer=n_layer,
            n_head=int(_need(model, "decoder_attention_heads")),
            n_embd=n_embd,
            input_dim=int(model.get("decoder_input_dim") or n_embd),
            output_dim=int(model.get("decoder_output_dim") or n_embd),
            ffn_dim=int(_need(model, "decoder_ffn_embed_dim")),
            normalize_before=normalize_before,
            final_norm=normalize_before and not _flag(model, "no_decoder_final_norm"),
            layernorm_embedding=_flag(model, "layernorm_embedding"),
            activation=activation,
            scale_embedding=not _flag(model, "no_scale_embedding"),
            positions=positions,
            padding_idx=1,
            tied=_flag(model, "share_decoder_input_output_embed"),
            multimax_attention="decoder.layers.0.self_attn.ranges" in sd,
            multimax_output="decoder.ranges" in sd,
        )
    except ValueError as exc:
        raise CheckpointError(f"fairseq configuration: {exc}") from None


def _state_dict(raw: Mapping[str, Any], config: FairseqLMConfig) -> dict[str, Tensor]:
    """fairseq's decoder keys as the model's; bookkeeping entries dropped, the tied output restored if absent."""
    sd: dict[str, Tensor] = {}
    for key, value in raw.items():
        key = str(key)
        if key in ("decoder.version", "decoder.embed_positions._float_tensor"):
            continue  # bookkeeping: a version number and the old sinusoidal placeholder
        sd[key] = value
    if config.tied and "decoder.output_projection.weight" not in sd:
        sd["decoder.output_projection.weight"] = sd["decoder.embed_tokens.weight"]
    if not config.tied and "decoder.embed_out" in sd:  # fairseq < 0.10 named the untied output embed_out
        sd["decoder.output_projection.weight"] = sd.pop("decoder.embed_out")
    return sd


def adapt_checkpoint(
    obj: Mapping[str, Any], *, source: str = "checkpoint", dictionary: str | None = None, **_: Any
) -> tuple[FairseqLMConfig, dict[str, Tensor], dict[str, Any]]:
    """(config, state dict, how it was read) of a fairseq transformer_lm checkpoint, and its tokenizer."""
    raw = obj["model"]
    model, task, kind = model_config(obj)
    _refuse(model, raw)
    config = _config(model, task, raw)
    tokenizer, dict_path = tokenizer_for(Path(source), dictionary, config.vocab_size, _bpe(obj, model, task))
    info = {
        "layout": "fairseq",
        "config_from": kind,
        "fairseq_arch": model.get("arch") or model.get("_name"),
        "dictionary": dict_path,
        "tokenizer": tokenizer,
    }
    return config, _state_dict(raw, config), info


def _bpe(obj: Mapping[str, Any], model: Mapping[str, Any], task: Mapping[str, Any]) -> str | None:
    cfg = plain(obj.get("cfg")) if obj.get("cfg") is not None else None
    if isinstance(cfg, Mapping) and isinstance(cfg.get("bpe"), Mapping):
        return cfg["bpe"].get("_name")
    value = model.get("bpe") or task.get("bpe")
    return str(value) if value else None
