"""Read a Hugging Face `ForCausalLM` model folder (Llama, Qwen2, Qwen3) with its MultiMax (SegLU) tensors.

A folder holds config.json, the weights (model.safetensors, or shards listed by model.safetensors.index.json;
pytorch_model.bin[.index.json] read with weights_only=True), tokenizer.json + tokenizer_config.json and
optionally generation_config.json. PaddleFleet adds `lm_head.multimax_ranges` / `lm_head.multimax_ts`
(`model.lm_head.multimax_*` for a shared multi-token-prediction head) and, for attention,
`model.layers.{i}.self_attn.multimax_ranges|ts`; transformers drops those silently, this loader never drops
anything: every tensor maps to exactly one parameter of `models.llama.Llama` or the load fails with one line
(a `CheckpointError`) naming the file, the tensor and both shapes, as does an unsupported architecture or option.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoint import Checkpoint, read_file
from .hf_tokenizer import HFTokenizer, read_json
from .llama import FLAVORS, ROPE_TYPES, Llama, LlamaConfig, hf_name, rope_frequencies
from .loading import CheckpointError
from .multimax import Modulation

# Hugging Face model_type -> the class name config.json's "architectures" gives it
ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
assert tuple(ARCHITECTURES) == FLAVORS
ARCH = "llama"  # the registry's architecture (models.llama) these folders load as
MULTIMAX_MODULES = ("lm_head", "attention")  # the places config.json's multimax_modules may name
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Hugging Face per-class defaults for keys a config.json may leave out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128},
}

_HF_ATTN_MULTIMAX = re.compile(r"^model\.layers\.(\d+)\.self_attn\.multimax_(ranges|ts)$")
# derived buffers some older exports saved; recomputed from the config, so reading them drops nothing
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_MTP_HEAD = "model.lm_head.multimax_"  # PaddleFleet's name when the head is shared with MTP heads


def is_model_folder(path: str | Path) -> bool:
    return Path(path).is_dir()


@dataclass
class HFFolder:
    """What was read from a folder, beside the model."""

    path: Path
    config: LlamaConfig
    hf_config: dict[str, Any]
    architecture: str
    dtype: torch.dtype
    tokenizer: HFTokenizer
    generation: dict[str, Any]
    weight_files: list[str]
    multimax: dict[str, Any] = field(default_factory=dict)  # placement and values, as read


# ---------------------------------------------------------------------------------------------------
# config.json

# the RoPE parameters each type honours (besides rope_type and rope_theta)
_ROPE_KEYS: dict[str, set[str]] = {
    "default": {"partial_rotary_factor"},
    "linear": {"factor", "partial_rotary_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
               "partial_rotary_factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate", "partial_rotary_factor"},
}

def _rope(hf: Mapping[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) from transformers 5's rope_parameters or 4's rope_theta/rope_scaling."""
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(params, Mapping):
        raise CheckpointError(f"{source}: rope_parameters is a {type(params).__name__}, not an object")
    if "rope_theta" not in params and any(isinstance(v, Mapping) for v in params.values()):
        raise CheckpointError(f"{source}: per-layer-type rope_parameters are not supported")
    params = dict(params)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{source}: unsupported rope_scaling type {rope_type!r} "
                              f"(supported: {', '.join(ROPE_TYPES)})")
    unknown = sorted(set(params) - _ROPE_KEYS[rope_type])
    if unknown:  # a parameter this implementation would not honour changes the model: refuse it
        raise CheckpointError(f"{source}: unsupported {rope_type} RoPE parameter(s) {', '.join(unknown)} "
                              f"(supported: {', '.join(sorted(_ROPE_KEYS[rope_type])) or 'none'})")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> tuple[LlamaConfig, str]:
    """LlamaConfig (no MultiMax yet: the tensors decide) and the architecture name; refuses what it cannot run."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(f"{t} ({a})" for t, a in ARCHITECTURES.items())
        raise CheckpointError(f"{source}: unsupported model_type {model_type!r} (supported: {supported})")
    arch = ARCHITECTURES[model_type]
    named = hf.get("architectures") or [arch]
    if list(named) != [arch]:
        raise CheckpointError(f"{source}: architectures {named} is not [{arch!r}] (the only class for model_type "
                              f"{model_type!r}; supported: {', '.join(ARCHITECTURES.values())})")
    hf = {**_DEFAULTS[model_type], **hf}
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise CheckpointError(f"{source}: unsupported hidden_act {act!r} (supported: silu)")
    types = set(hf.get("layer_types") or ["full_attention"])
    if hf.get("use_sliding_window") or types != {"full_attention"}:
        raise CheckpointError(f"{source}: unsupported sliding-window attention (supported: full attention only)")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method") if isinstance(hf["quantization_config"], dict) else None
        raise CheckpointError(f"{source}: unsupported quantization_config ({method or 'quantised weights'}; "
                              "supported: unquantised float32/bfloat16/float16 weights)")
    if int(hf.get("pretraining_tp") or 1) != 1:
        raise CheckpointError(f"{source}: unsupported pretraining_tp {hf['pretraining_tp']} (supported: 1)")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int):
            raise CheckpointError(f"{source}: {key} is missing or not an integer")
    theta, scaling = _rope(hf, source)
    bias = bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        flavor=model_type,
        vocab_size=hf["vocab_size"],
        block_size=int(hf["max_position_embeddings"]),
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_local_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        dim=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_base=theta,
        rope_scaling=scaling,
        qkv_bias=True if model_type == "qwen2" else bias,  # Qwen2: q/k/v always biased, o never
        o_bias=False if model_type == "qwen2" else bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    try:
        config = LlamaConfig.from_dict(fields)
        rope_frequencies(config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    return config, arch


# ---------------------------------------------------------------------------------------------------
# weights

def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a Mapping)
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) for damaged files
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({_first_line(exc)})") from None


def _read_bin(path: Path) -> dict[str, Tensor]:
    obj = read_file(path)  # torch.load(weights_only=True), one-line errors
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return {str(k): v for k, v in obj.items()}


def read_tensors(folder: Path) -> tuple[dict[str, Tensor], dict[str, Path]]:
    """Every tensor by name, and the file each came from (for messages)."""
    for single, index, reader in (("model.safetensors", "model.safetensors.index.json", _read_safetensors),
                                  ("pytorch_model.bin", "pytorch_model.bin.index.json", _read_bin)):
        if (folder / single).is_file():
            tensors = reader(folder / single)
            return tensors, dict.fromkeys(tensors, folder / single)
        if (folder / index).is_file():
            return _read_sharded(folder / index, reader)
    raise CheckpointError(f"{folder}: no weights (model.safetensors, model.safetensors.index.json, pytorch_model.bin "
                          "or pytorch_model.bin.index.json)")


def _read_sharded(index: Path, reader: Any) -> tuple[dict[str, Tensor], dict[str, Path]]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map")
    tensors: dict[str, Tensor] = {}
    origin: dict[str, Path] = {}
    for shard in sorted(set(weight_map.values())):
        path = index.parent / str(shard)
        if "/" in str(shard) or not path.is_file():
            raise CheckpointError(f"{index}: names shard {shard} which does not exist")
        listed = {k for k, v in weight_map.items() if v == shard}
        got = reader(path)
        missing = sorted(listed - set(got))
        if missing:
            raise CheckpointError(f"{path}: lacks tensor {missing[0]} that {index.name} places in it")
        for key in sorted(set(got) - listed):
            raise CheckpointError(f"{path}: holds tensor {key} that {index.name} does not list")
        tensors.update(got)
        origin.update(dict.fromkeys(got, path))
    return tensors, origin


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:160]


# ---------------------------------------------------------------------------------------------------
# MultiMax placement: the tensors, checked against config.json's multimax_modules

def _normalise_names(tensors: dict[str, Tensor], origin: dict[str, Path]) -> None:
    """model.lm_head.multimax_* (a head shared with MTP) is the LM head's SegLU; ignored derived buffers go."""
    for key in [k for k in tensors if k.startswith(_MTP_HEAD)]:
        plain = key.removeprefix("model.")
        if plain in tensors:
            raise CheckpointError(f"{origin[key]}: both {key} and {plain} present (one SegLU per head)")
        tensors[plain], origin[plain] = tensors.pop(key), origin.pop(key)
    for key in [k for k in tensors if _IGNORED.match(k)]:
        del tensors[key], origin[key]


def _multimax_placement(tensors: Mapping[str, Tensor], hf: Mapping[str, Any], config: LlamaConfig,
                        folder: Path) -> tuple[bool, list[int]]:
    output = any(k.startswith("lm_head.multimax_") for k in tensors)
    # a layer beyond num_hidden_layers is left to the key check, which names it as an unexpected tensor
    found = {int(m.group(1)) for k in tensors if (m := _HF_ATTN_MULTIMAX.match(k))}
    layers = sorted(i for i in found if i < config.n_layer)
    modules = hf.get("multimax_modules")
    if modules is None:
        return output, layers
    source = folder / "config.json"
    if not isinstance(modules, list) or any(m not in MULTIMAX_MODULES for m in modules):
        raise CheckpointError(f"{source}: multimax_modules {modules!r} names an unsupported place "
                              f"(supported: {', '.join(MULTIMAX_MODULES)})")
    if "lm_head" in modules and not output:
        raise CheckpointError(f"{folder}: missing tensor lm_head.multimax_ranges (shape (4,)) that config.json's "
                              f"multimax_modules {modules} names")
    if output and "lm_head" not in modules:
        raise CheckpointError(f"{folder}: tensor lm_head.multimax_ranges present but config.json's multimax_modules "
                              f"{modules} leaves out lm_head")
    if "attention" in modules:
        for i in range(config.n_layer):
            if i not in layers:
                raise CheckpointError(f"{folder}: missing tensor model.layers.{i}.self_attn.multimax_ranges (shape "
                                      f"(4,)) that config.json's multimax_modules {modules} names")
    elif layers:
        raise CheckpointError(f"{folder}: tensor model.layers.{layers[0]}.self_attn.multimax_ranges present but "
                              f"config.json's multimax_modules {modules} leaves out attention")
    return output, layers


# ---------------------------------------------------------------------------------------------------
# the whole folder

def _dtype(hf: Mapping[str, Any], tensors: Mapping[str, Tensor], source: Path) -> torch.dtype:
    named = hf.get("dtype") or hf.get("torch_dtype")
    if named is not None and named != "auto":
        if named not in DTYPES:
            raise CheckpointError(f"{source}: unsupported dtype {named!r} (supported: {', '.join(DTYPES)})")
        return DTYPES[named]
    embed = tensors.get("model.embed_tokens.weight")
    return embed.dtype if embed is not None and embed.dtype in DTYPES.values() else torch.float32


def _check(model: Llama, tensors: Mapping[str, Tensor], origin: Mapping[str, Path], folder: Path,
           arch: str) -> dict[str, Tensor]:
    """The model's state dict from the file's tensors: each one used, each one present, each shape right."""
    expected = {hf_name(k): (k, tuple(v.shape)) for k, v in model.state_dict().items()}
    tied = model.config.tie_word_embeddings
    optional = {"lm_head.weight"} if tied else set()
    for name, (_, shape) in expected.items():
        if name not in tensors and name not in optional:
            raise CheckpointError(f"{folder}: missing tensor {name} (config.json implies shape {shape})")
    for name, tensor in tensors.items():
        if name not in expected:
            raise CheckpointError(f"{origin[name]}: unexpected tensor {name} with shape {tuple(tensor.shape)} "
                                  f"(no such parameter in this {arch})")
        shape = expected[name][1]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{origin[name]}: tensor {name} has shape {tuple(tensor.shape)}, config.json "
                                  f"implies {shape}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{origin[name]}: tensor {name} is {tensor.dtype}, not floating point "
                                  "(quantised weights are not supported)")
    if tied and "lm_head.weight" in tensors and not torch.equal(
            tensors["lm_head.weight"].float(), tensors["model.embed_tokens.weight"].float()):
        raise CheckpointError(f"{origin['lm_head.weight']}: lm_head.weight differs from model.embed_tokens.weight but "
                              "config.json says tie_word_embeddings")
    return {own: tensors[name] for name, (own, _) in expected.items() if name in tensors} | (
        {"output.weight": tensors["model.embed_tokens.weight"]} if tied else {})


def _build(config: LlamaConfig, state_dict: Mapping[str, Tensor], dtype: torch.dtype) -> Llama:
    """The model without a random init (built on the meta device), weights in `dtype`, MultiMax kept in fp32."""
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty gives each module its own new tensor: one matrix again, as built
        model.output.weight = model.tok_embeddings.weight
    owners = {id(p) for m in model.modules() if isinstance(m, Modulation) for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in owners:
            p.data = p.data.to(dtype)
    model.load_state_dict(dict(state_dict), strict=True)
    model.rope.inv_freq.copy_(rope_frequencies(config)[0])  # to_empty left the derived buffer uninitialised
    return model.eval()


def _multimax_values(model: Llama) -> dict[str, Any]:
    out: dict[str, Any] = {"lm_head": None, "attention": {}}

    def values(m: nn.Module) -> dict[str, list[float]]:
        return {name: [round(float(v), 6) for v in getattr(m, name).detach().tolist()] for name in ("ranges", "ts")}

    if model.output_multimax is not None:
        out["lm_head"] = values(model.output_multimax)
    for i, block in enumerate(model.block_list()):
        if block.attention.multimax is not None:
            out["attention"][i] = values(block.attention.multimax)
    return out


def load_folder(path: str | Path) -> tuple[Llama, HFFolder]:
    """(model in eval mode, what was read) for a Hugging Face model folder; CheckpointError on anything wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: a directory without config.json (a Hugging Face model folder needs one; "
                              "a checkpoint is a file)")
    hf = read_json(config_path)
    config, arch = config_from_hf(hf, str(config_path))
    if not (folder / "tokenizer.json").is_file():  # before the (long) weight read
        raise CheckpointError(f"{folder / 'tokenizer.json'}: no such file (a model folder needs its tokenizer.json)")
    generation: dict[str, Any] = {}
    if (folder / "generation_config.json").is_file():
        generation = read_json(folder / "generation_config.json")
    tensors, origin = read_tensors(folder)
    _normalise_names(tensors, origin)
    output, layers = _multimax_placement(tensors, hf, config, folder)
    config = LlamaConfig.from_dict(config.to_dict() | dict(
        multimax_output=output, multimax_attention=bool(layers),
        multimax_layers=None if not layers or len(layers) == config.n_layer else layers))
    dtype = _dtype(hf, tensors, config_path)
    with torch.device("meta"):
        shapes = Llama(config)
    state_dict = _check(shapes, tensors, origin, folder, arch)
    model = _build(config, state_dict, dtype)
    eos = generation.get("eos_token_id", hf.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else [int(e) for e in eos or []]
    tokenizer = HFTokenizer.from_folder(folder, eos_ids)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{folder / 'tokenizer.json'}: {tokenizer.vocab_size} tokens but the model's embedding "
                              f"has {config.vocab_size} rows")
    files = sorted({p.name for p in origin.values()})
    info = HFFolder(folder, config, dict(hf), arch, dtype, tokenizer, generation, files, _multimax_values(model))
    return model, info


def folder_checkpoint(info: HFFolder) -> Checkpoint:
    """The checkpoint record of a loaded folder (architecture, config, tokenizer summary; the weights stay in the
    model): what an export's metadata is made from, the whole tokenizer included (a single .onnx serves alone)."""
    return Checkpoint(arch=ARCH, config=info.config.to_dict(), state_dict={}, tokenizer=info.tokenizer.to_entry(),
                      meta={"source_layout": f"Hugging Face {info.architecture}"})
