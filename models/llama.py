"""One decoder class for Llama, Qwen2 and Qwen3 (in the manner of gpt-fast's model.py), with MultiMax (SegLU).

The three differ only by switches of `LlamaConfig`: grouped-query attention (`n_local_heads`), biases on
q/k/v (Qwen2) or on q/k/v/o (Llama's `attention_bias`), RMSNorm on each head's q and k (Qwen3), tied or
untied embeddings, and the RoPE scaling (`rope_scaling`: default, linear, llama3, yarn).

MultiMax sits where the weights put it: on the LM-head logits (PaddleFleet's SegLU, `output_multimax`) and/or
on the attention scores of some layers (`multimax_layers`): modulate the scaled scores, then add the mask, then
softmax (models.multimax.attention_probs). The forward has the signature of `models.gpt.GPT.forward` and the
same explicit KV cache (a list of per-layer (key, value), here with `n_local_heads` heads: code that builds
a past for it must use those, not `n_head`); `models.generate.generate` drives either model. The Hugging Face
folder layout is read by `models.hf_folder`; the parameter names here are the project's own, and `hf_name` (the
load hook, below) maps each to its Hugging Face tensor name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config_base import ModelConfig

from .attention_function import config_dict, make_attention_function, normalise_config
from .attention_hook import Attend, AttentionLayer, LayerAttend, attention_layer, for_layer
from .cache_growth import extend, traced
from .gpt import PastKeyValues, build_attention_mask, empty_past, past_and_positions
from .multimax import PAPER_TABLE_8, Modulation, attention_probs, paper_params

FLAVORS = ("llama", "qwen2", "qwen3")  # the Hugging Face model_type each config switch set comes from
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SEGLU_VARIANTS = ("second", "first")  # V2's affine t, b has no place in the SegLU layout


@dataclass
class LlamaConfig(ModelConfig):
    KIND: ClassVar[str] = "Llama"
    flavor: str = "llama"
    vocab_size: int = 32000
    block_size: int = 2048  # the context: Hugging Face's max_position_embeddings
    n_layer: int = 32
    n_head: int = 32
    n_local_heads: int = 0  # key/value heads (grouped-query attention); 0: n_head
    dim: int = 4096
    intermediate_size: int = 11008
    head_dim: int = 0  # 0: dim // n_head
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    # None (plain RoPE) or {"rope_type": "linear" | "llama3" | "yarn", ...} with Hugging Face's parameter names
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    multimax_output: bool = False  # SegLU on the LM-head logits
    multimax_attention: bool = False
    multimax_layers: list[int] | None = None  # the layers whose attention is MultiMax; None: all (if attention)
    variant: str = "second"
    attention_function: str | None = None  # models.reweighting's other functions, as GPTConfig
    attention_options: dict[str, float] | None = None
    output_function: str | None = None

    def __post_init__(self) -> None:
        normalise_config(self)
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r}; supported: {', '.join(FLAVORS)}")
        self.n_local_heads = self.n_local_heads or self.n_head
        self.head_dim = self.head_dim or (self.dim // self.n_head if self.n_head else 0)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_local_heads", "dim", "intermediate_size",
                     "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_head % self.n_local_heads:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_local_heads ({self.n_local_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.variant not in SEGLU_VARIANTS:
            raise ValueError(f"unsupported MultiMax variant {self.variant!r} here; supported: {SEGLU_VARIANTS}")
        if self.multimax_layers is not None:
            layers = sorted(set(int(i) for i in self.multimax_layers))
            if any(not 0 <= i < self.n_layer for i in layers):
                raise ValueError(f"multimax_layers {layers} outside 0..{self.n_layer - 1}")
            if layers and not self.multimax_attention:
                raise ValueError("multimax_layers given but multimax_attention is off")
            self.multimax_layers = layers
        rope_frequencies(self)  # validates rope_scaling

    @property
    def attention_layers(self) -> list[int]:
        """The layers whose attention is MultiMax."""
        if not self.multimax_attention:
            return []
        return list(range(self.n_layer)) if self.multimax_layers is None else list(self.multimax_layers)

    @classmethod
    def presets(cls) -> Mapping[str, Mapping[str, Any]]:
        return LLAMA_PRESETS

    def to_dict(self) -> dict[str, Any]:
        return config_dict(asdict(self))



# Named shapes. The "-tiny" ones are test sizes; the others are the shapes (not the weights) of public models.
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(flavor="llama", vocab_size=300, block_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=128),
    "qwen2-tiny": dict(flavor="qwen2", vocab_size=300, block_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=128, norm_eps=1e-6, rope_base=1e6, qkv_bias=True, tie_word_embeddings=True),
    "qwen3-tiny": dict(flavor="qwen3", vocab_size=300, block_size=256, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       head_dim=32, intermediate_size=128, norm_eps=1e-6, rope_base=1e6, qk_norm=True,
                       tie_word_embeddings=True),
    "llama-3.2-1b": dict(flavor="llama", vocab_size=128256, block_size=131072, n_layer=16, n_head=32,
                         n_local_heads=8, dim=2048, intermediate_size=8192, rope_base=500000.0,
                         tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2.5-0.5b": dict(flavor="qwen2", vocab_size=151936, block_size=32768, n_layer=24, n_head=14, n_local_heads=2,
                         dim=896, intermediate_size=4864, norm_eps=1e-6, rope_base=1e6, qkv_bias=True,
                         tie_word_embeddings=True),
    "qwen3-0.6b": dict(flavor="qwen3", vocab_size=151936, block_size=40960, n_layer=28, n_head=16, n_local_heads=8,
                       dim=1024, head_dim=128, intermediate_size=3072, norm_eps=1e-6, rope_base=1e6, qk_norm=True,
                       tie_word_embeddings=True),
}


# ---------------------------------------------------------------------------------------------------
# RoPE: inverse frequencies per scaling type (the formulas of each method's paper, as Hugging Face names them).

def _get(params: Mapping[str, Any], key: str, rope_type: str) -> float:
    if params.get(key) is None:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs {key!r}")
    return float(params[key])


def rope_frequencies(config: LlamaConfig) -> tuple[Tensor, float]:
    """(inverse frequencies (head_dim / 2,), factor on cos/sin) for the config's RoPE; ValueError if unsupported."""
    dim, base = config.head_dim, float(config.rope_base)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = dict(config.rope_scaling or {})
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("unsupported rope option partial_rotary_factor != 1")
    if rope_type == "default":
        return inv_freq, 1.0
    factor = _get(params, "factor", rope_type)
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    original = float(params.get("original_max_position_embeddings") or config.block_size)
    if rope_type == "llama3":
        low, high = _get(params, "low_freq_factor", rope_type), _get(params, "high_freq_factor", rope_type)
        wavelen = 2 * math.pi / inv_freq
        # long waves are slowed by `factor`, short ones kept, the band between blended linearly in 1/wavelength
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        middle = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(middle, blended, scaled), 1.0
    # yarn (Peng et al. 2023): interpolate the low frequencies, keep the high ones, ramp between them
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    inv_freq = (inv_freq / factor) * (1 - keep) + inv_freq * keep

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all else mscale(factor)
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    inv_freq: Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        inv_freq, self.scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # derived from the config, not a weight

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin of shape (B, T, head_dim), computed in fp32 and cast to the activations' dtype."""
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, T, D) rotated by position; cos/sin (B, T, D)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalised in fp32 (a bf16/fp16 sum of squares loses too much), scaled in the weights' dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _grouped(a: Tensor, b: Tensor, groups: int) -> Tensor:
    """a (B, n_head, T, X) @ b (B, n_local_heads, X, Y) -> (B, n_head, T, Y), query head h on key/value head
    h // groups (Hugging Face's repeat_kv order) without materialising the repeated cache: the `groups` query
    heads of one key/value head are stacked along T and share one matmul."""
    if groups == 1:
        return a @ b
    B, H, T, X = a.shape
    out = a.reshape(B, H // groups, groups * T, X) @ b
    return out.view(B, H, T, out.shape[-1])


KV = tuple[Tensor, Tensor]


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, multimax: bool) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        q_out, kv_out = config.n_head * config.head_dim, config.n_local_heads * config.head_dim
        self.wq = nn.Linear(config.dim, q_out, bias=config.qkv_bias)
        self.wk = nn.Linear(config.dim, kv_out, bias=config.qkv_bias)
        self.wv = nn.Linear(config.dim, kv_out, bias=config.qkv_bias)
        self.wo = nn.Linear(q_out, config.dim, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.multimax = Modulation(config.variant, affine=False) if multimax else None  # type: ignore[arg-type]
        self.reweight = make_attention_function(config.attention_function, config.n_head, config.attention_options)
        self.max_length = config.block_size  # the cache buffer never grows past the context

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, past: KV | None,
                attend: LayerAttend | None = None) -> tuple[Tensor, KV]:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim)
        k = self.wk(x).view(B, T, self.n_local_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if attend is not None:  # one attention node per layer (models.attention_hook): rotated q, k as (B, T, H*D)
            flat = [t.transpose(1, 2).reshape(B, T, -1) for t in (q, k, v)]
            y, present = attend(flat[0], flat[1], flat[2], past, mask)
            return self.wo(y), present
        if past is not None:  # in place in the past's buffer where it has room (models.cache_growth)
            k = extend(past[0], k, self.max_length)
            v = extend(past[1], v, self.max_length)
        groups = self.n_head // self.n_local_heads
        scores = _grouped(q, k.transpose(-2, -1), groups) * self.scale
        if self.reweight is not None:
            probs = self.reweight(scores, mask)
        else:
            probs = attention_probs(scores, self.multimax, mask)  # modulate, then mask, then softmax
        y = _grouped(probs.to(v.dtype), v, groups).transpose(1, 2).reshape(B, T, -1)
        return self.wo(y), (k, v)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (Hugging Face: gate_proj, up_proj, down_proj)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=config.mlp_bias)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=config.mlp_bias)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig, multimax: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, multimax)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, past: KV | None,
                attend: LayerAttend | None = None) -> tuple[Tensor, KV]:
        a, present = self.attention(self.attention_norm(x), cos, sin, mask, past, attend)
        x = x + a
        return x + self.feed_forward(self.ffn_norm(x)), present


class Llama(nn.Module):
    """Decoder-only LM for Llama / Qwen2 / Qwen3 configs; forward as `GPT.forward`, logits in float32."""

    # the text-model capabilities (models.registry.TextModel): forward takes `logits_to_keep`, and the attention
    # extends a past with room in place (models.cache_growth.extend)
    keeps_last_logits = True
    grows_cache_in_place = True

    # A fused SegLU, fn(logits, ranges, ts) -> sigma(logits), that inference on CPU calls instead of the reference
    # (set by plugins.cpu_sigma.use_cpu_sigma; None here: models never import plugins).
    fused_sigma: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        attention = set(config.attention_layers)
        self.layers = nn.ModuleList(TransformerBlock(config, i in attention) for i in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope = RotaryEmbedding(config)
        # SegLU on the logits (PaddleFleet's lm_head.multimax_ranges / multimax_ts)
        self.output_multimax = (
            Modulation(config.variant, affine=False) if config.multimax_output else None  # type: ignore[arg-type]
        )
        self.init_weights()

    def block_list(self) -> list[TransformerBlock]:
        return [cast(TransformerBlock, b) for b in self.layers]

    def init_weights(self, std: float = 0.02) -> None:
        """N(0, std) weights, zero biases; norms keep ones, MultiMax its own initialisation."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    nn.init.zeros_(bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def attention_layers(self) -> list[AttentionLayer]:
        """Per layer what an attention node needs (models.attention_hook): grouped key/value heads, MultiMax."""
        c = self.config
        return [attention_layer(c.n_head, c.n_local_heads, c.head_dim, b.attention.scale, b.attention.multimax)
                for b in self.block_list()]

    def empty_past(self, batch_size: int, dtype: torch.dtype | None = None, device: Any = None) -> PastKeyValues:
        """A zero-length cache: per layer (key, value) of shape (B, n_local_heads, 0, head_dim)."""
        c = self.config
        device = device or self.tok_embeddings.weight.device
        return empty_past(c.n_layer, c.n_local_heads, c.head_dim, batch_size, dtype or self.dtype, device)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: PastKeyValues | None = None,
        attend: Attend | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[Tensor, PastKeyValues]:
        """Logits (B, T, V) in float32 (after SegLU where the model has it) and the presents.

        logits_to_keep: N > 0 computes the logits (LM head and SegLU) of the last N positions only, (B, N, V), as
        transformers' argument of that name: a prefill that samples needs one row, not T (the SegLU is a dozen
        elementwise passes over every logit it is given).

        attention_mask: (B, past_len + T), 1 for real tokens, 0 for padding (left or right).
        past_key_values / presents: per layer (key, value) (B, n_local_heads, length, head_dim); present =
        concat(past, new), grown in place (models.cache_growth: extend a past once). position_ids default to the
        count of real tokens before each one. `attend`: each layer's attention by that instead
        (models.attention_hook).
        """
        T = input_ids.shape[1]
        past_len, position_ids = past_and_positions(
            input_ids, position_ids, attention_mask, past_key_values, self.config.block_size
        )
        x = self.tok_embeddings(input_ids)
        mask = attention_mask if attend is not None else build_attention_mask(
            T, past_len, attention_mask, x.dtype, input_ids.device)
        cos, sin = self.rope(position_ids, x.dtype)
        presents: PastKeyValues = []
        for i, block in enumerate(self.block_list()):
            x, present = block(x, cos, sin, mask, past_key_values[i] if past_key_values else None,
                               for_layer(attend, i))
            presents.append(present)
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        logits = self.output(self.norm(x)).float()
        if self.output_multimax is not None:  # fp32: the squared terms overflow half precision
            head, fused = self.output_multimax, self.fused_sigma
            if fused is not None and logits.device.type == "cpu" and not torch.is_grad_enabled() and not traced():
                logits = fused(logits, head.ranges, head.ts)
            else:
                logits = head(logits)
        return logits, presents


def multimax_modules(model: Llama) -> list[Modulation]:
    """Attention MultiMax layers in depth order, then the SegLU on the logits (where present)."""
    mods = [b.attention.multimax for b in model.block_list() if b.attention.multimax is not None]
    return mods + ([model.output_multimax] if model.output_multimax is not None else [])


@torch.no_grad()
def set_paper_params(model: Llama, table: tuple[tuple[float, ...], ...] = PAPER_TABLE_8) -> None:
    """The paper's LM parameters (Table 8): attention layer i gets row i (cyclically), the SegLU the last row."""
    for i, block in enumerate(model.block_list()):
        if block.attention.multimax is not None:
            block.attention.multimax.set_params(*paper_params(i, table))
    if model.output_multimax is not None:
        model.output_multimax.set_params(*paper_params(len(table) - 1, table))


# ---------------------------------------------------------------------------------------------------
# Load hook for the Hugging Face layout (the folder itself is read by models.hf_folder).

# own parameter name (models.llama) <-> Hugging Face tensor name, per layer and at the top
_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.multimax.ranges": "self_attn.multimax_ranges",
    "attention.multimax.ts": "self_attn.multimax_ts",
    **{f"attention.{own}.{p}": f"self_attn.{hf}.{p}" for own, hf in
       (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")) for p in ("weight", "bias")},
    **{f"feed_forward.{own}.{p}": f"mlp.{hf}.{p}" for own, hf in
       (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")) for p in ("weight", "bias")},
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "output_multimax.ranges": "lm_head.multimax_ranges",
    "output_multimax.ts": "lm_head.multimax_ts",
}
_OWN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(own: str) -> str:
    """The Hugging Face tensor name of a `models.llama.Llama` parameter."""
    m = _OWN_LAYER.match(own)
    if m:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return _TOP_NAMES[own]
