"""A small decoder-only GPT whose attention and output softmax can be MultiMax.

Shaped for serving: an explicit KV cache that is a plain list of (key, value) tensors per layer, so
the same forward maps one to one onto ONNX inputs `past_key_values.{i}.key|value` and outputs
`present.{i}.key|value`. Attention is written out (no F.scaled_dot_product_attention) because
MultiMax has to modulate the raw scores before the mask is added.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config_base import ModelConfig

from .attention_function import config_dict, make_attention_function, normalise_config
from .attention_hook import Attend, AttentionLayer, LayerAttend, attention_layer, for_layer
from .loading import CheckpointError, load_exact, strip_prefixes
from .multimax import PAPER_TABLE_8, VARIANTS, Modulation, Variant, attention_probs, paper_params

KV = tuple[Tensor, Tensor]  # one layer's (key, value), each (B, n_head, length, head_dim)
PastKeyValues = list[KV]


@dataclass
class GPTConfig(ModelConfig):
    KIND: ClassVar[str] = "GPT"
    vocab_size: int = 259  # ByteTokenizer: 256 bytes + bos, eos, pad
    block_size: int = 256  # maximum context (learned position table size)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_ratio: int = 4
    bias: bool = True
    ln_eps: float = 1e-5
    multimax_attention: bool = True
    multimax_output: bool = True
    variant: Variant = "second"  # one of models.multimax.VARIANTS
    dropout: float = 0.0
    # Another reweighting for attention (models.reweighting: sparsemax, entmax15, ...; None: as multimax_attention)
    attention_function: str | None = None
    attention_options: dict[str, float] | None = None  # its hyperparameters (top-k's k; length-scaled eps, m)
    # The output distribution when not softmax (models.output_function: sparsemax, entmax15, evsoftmax); the
    # logits stay the model's output. Excludes MultiMax's output (multimax_output is turned off).
    output_function: str | None = None

    def __post_init__(self) -> None:
        normalise_config(self)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown MultiMax variant {self.variant!r}; expected one of {VARIANTS}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def presets(cls) -> Mapping[str, Mapping[str, Any]]:
        return GPT_PRESETS

    def to_dict(self) -> dict[str, Any]:
        return config_dict(asdict(self))



# Named shapes (overrides of the GPTConfig defaults). "gpt-lm-6" is the paper's WikiText-103 LM shape
# (6 layers, 512 wide, 8 heads, FFN 2048), with learned positions and the byte vocabulary.
GPT_PRESETS: dict[str, dict[str, Any]] = {
    "gpt-nano": dict(n_layer=2, n_head=2, n_embd=64, block_size=128),
    "gpt-micro": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),
    "gpt-mini": dict(n_layer=6, n_head=6, n_embd=192, block_size=256),
    "gpt-lm-6": dict(n_layer=6, n_head=8, n_embd=512, mlp_ratio=4, block_size=512),
}


class CacheShape(Protocol):
    """What sizes a cache: GPTConfig, or any text model's config (models.fairseq_lm)."""

    n_layer: int
    n_head: int

    @property
    def head_dim(self) -> int: ...


@dataclass
class KVCache:
    """Per-layer (key, value), each (B, n_head, length, head_dim); what `GPT.forward` takes and returns."""

    layers: PastKeyValues = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    @classmethod
    def empty(
        cls, config: CacheShape, batch_size: int, dtype: torch.dtype = torch.float32, device: Any = None
    ) -> KVCache:
        """Zero-length past: the prefill then runs the same code path as every decode step (and as ONNX)."""
        return cls(empty_past(config.n_layer, config.n_head, config.head_dim, batch_size, dtype, device))


def empty_past(
    n_layer: int, heads: int, head_dim: int, batch_size: int, dtype: torch.dtype = torch.float32, device: Any = None
) -> PastKeyValues:
    """Per layer a zero-length (key, value) of (B, heads, 0, head_dim): every text model's `empty_past`."""
    shape = (batch_size, heads, 0, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(n_layer)]


def _tracing() -> bool:
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def past_and_positions(
    input_ids: Tensor,
    position_ids: Tensor | None,
    attention_mask: Tensor | None,
    past_key_values: PastKeyValues | None,
    block_size: int | None,
) -> tuple[int, Tensor]:
    """A decoder call's cached length and positions: the text models' forward preamble.

    `block_size`: refuse a call beyond the context (None: the model checks nothing here). Positions default to
    the count of real tokens before each one (left-padded rows count from their first real token), else
    past_len..past_len+T-1.
    """
    B, T = input_ids.shape
    past_len = past_key_values[0][0].shape[2] if past_key_values else 0
    if block_size is not None and not _tracing() and past_len + T > block_size:
        raise ValueError(
            f"sequence of {past_len + T} tokens ({past_len} cached + {T} new) exceeds the context of {block_size}"
        )
    if position_ids is None:
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
        else:
            position_ids = torch.arange(past_len, past_len + T, device=input_ids.device)[None].expand(B, T)
    return past_len, position_ids


def build_attention_mask(
    q_len: int, past_len: int, attention_mask: Tensor | None, dtype: torch.dtype, device: Any
) -> Tensor:
    """Additive mask (1 or B, 1, q_len, past_len + q_len): 0 where allowed, finfo(dtype).min elsewhere.

    finfo.min, not -inf: a row that is masked everywhere stays finite instead of turning into NaN.
    """
    total = past_len + q_len
    q_pos = torch.arange(past_len, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None]
    if attention_mask is not None:
        # A padding query would see no key at all; letting it see itself keeps every row well defined
        # (real queries never see padding, so their outputs do not change).
        allowed = allowed & (attention_mask[:, None, :].bool() | (k_pos == q_pos)[None])
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed[:, None], zero, torch.finfo(dtype).min)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.multimax = Modulation(config.variant) if config.multimax_attention else None
        self.reweight = make_attention_function(config.attention_function, config.n_head, config.attention_options)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None, past: KV | None,
                attend: LayerAttend | None = None) -> tuple[Tensor, KV]:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        if attend is not None:  # one attention node per layer (models.attention_hook): mask is the 0/1 one
            y, present = attend(q, k, v, past, mask)
            return self.resid_dropout(self.c_proj(y)), present
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if self.reweight is not None:
            probs = self.attn_dropout(self.reweight(scores, mask))
        else:
            probs = self.attn_dropout(attention_probs(scores, self.multimax, mask))  # modulate, mask, softmax
        y = (probs @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y)), (k, v)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))  # exact (erf) GELU


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.ln_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.ln_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, mask: Tensor | None, past: KV | None,
                attend: LayerAttend | None = None) -> tuple[Tensor, KV]:
        a, present = self.attn(self.ln_1(x), mask, past, attend)
        x = x + a
        return x + self.mlp(self.ln_2(x)), present


class GPT(nn.Module):
    # the text-model capabilities (models.registry.TextModel): every position's logits; the past is concatenated
    keeps_last_logits = False
    grows_cache_in_place = False

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.ln_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: the state dict carries both keys, one tensor
        # Output MultiMax on the logits, like fairseq's decoder-level `ranges`/`ts`; V2 puts t/b on attention only.
        self.multimax = Modulation(config.variant, affine=False) if config.multimax_output else None
        self.init_weights()

    def block_list(self) -> list[Block]:
        """The blocks, typed (nn.ModuleList's items are typed as any Module)."""
        return [cast(Block, b) for b in self.blocks]

    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 n_layer).

        LayerNorm keeps ones/zeros and every `Modulation` keeps its own (official) initialisation.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    nn.init.zeros_(bias)
        for block in self.block_list():
            for proj in (block.attn.c_proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: PastKeyValues | None = None,
        attend: Attend | None = None,
    ) -> tuple[Tensor, PastKeyValues]:
        """Logits (B, T, V) (after the output MultiMax, i.e. what softmax/cross-entropy take) and presents.

        attention_mask: (B, past_len + T), 1 for real tokens, 0 for (left) padding.
        past_key_values / presents: per layer (key, value) of shape (B, n_head, length, head_dim);
        present = concat(past, new). `attend`: each layer's attention by that instead (models.attention_hook).
        """
        T = input_ids.shape[1]
        past_len, position_ids = past_and_positions(
            input_ids, position_ids, attention_mask, past_key_values, self.config.block_size
        )
        dtype = self.wte.weight.dtype
        mask = attention_mask if attend is not None else build_attention_mask(
            T, past_len, attention_mask, dtype, input_ids.device)

        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        presents: PastKeyValues = []
        for i, block in enumerate(self.blocks):
            x, present = block(x, mask, past_key_values[i] if past_key_values else None, for_layer(attend, i))
            presents.append(present)
        logits = self.lm_head(self.ln_f(x))
        if self.multimax is not None:
            logits = self.multimax(logits)
        return logits, presents

    def attention_layers(self) -> list[AttentionLayer]:
        """Per layer what an attention node needs (models.attention_hook; every text architecture has this)."""
        c = self.config
        return [attention_layer(c.n_head, c.n_head, c.head_dim, b.attn.scale, b.attn.multimax)
                for b in self.block_list()]

    def empty_past(self, batch_size: int, dtype: torch.dtype | None = None, device: Any = None) -> PastKeyValues:
        """A zero-length cache as `forward` takes it (every text architecture has this method: the exporter and
        validation ask the model for its cache's shape instead of reading config fields)."""
        weight, c = self.wte.weight, self.config
        return empty_past(c.n_layer, c.n_head, c.head_dim, batch_size, dtype or weight.dtype, device or weight.device)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Tensor],
        config: GPTConfig | None = None,
        base: GPTConfig | None = None,
        source: str = "checkpoint",
    ) -> GPT:
        """Build a model for `state_dict` (config inferred from the weights unless given) and load it exactly."""
        state_dict = adapt_state_dict(state_dict)
        config = config or infer_config(state_dict, base)
        model = cls(config)
        load_exact(model, state_dict, source)
        return model


def multimax_modules(model: GPT) -> list[Modulation]:
    """Attention MultiMax layers in depth order, then the output one (where present)."""
    mods = [b.attn.multimax for b in model.block_list() if b.attn.multimax is not None]
    return mods + ([model.multimax] if model.multimax is not None else [])


@torch.no_grad()
def set_paper_params(model: GPT, table: tuple[tuple[float, ...], ...] = PAPER_TABLE_8) -> None:
    """Give every MultiMax the learned parameters of the paper (default Table 8, the 6-layer LM).

    Attention layer i gets `paper_params(i, table)` (rows reused cyclically beyond the table). The paper
    reports no row for the output MultiMax, so it gets the table's LAST row (the deepest layer's).
    V2's `t`/`b` are left at their init (1, 0).
    """
    for i, block in enumerate(model.block_list()):
        if block.attn.multimax is not None:
            block.attn.multimax.set_params(*paper_params(i, table))
    if model.multimax is not None:
        model.multimax.set_params(*paper_params(len(table) - 1, table))


# ---------------------------------------------------------------------------------------------------
# Load hook: raw state dicts (DDP / torch.compile wrapped) to a config and an exact load.

_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")


def adapt_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Strip `module.` / `_orig_mod.` wrappers; restore the tied `lm_head.weight` if it was left out."""
    sd = strip_prefixes(state_dict)
    if "lm_head.weight" not in sd and "wte.weight" in sd:
        sd["lm_head.weight"] = sd["wte.weight"]
    return sd


def infer_config(state_dict: Mapping[str, Tensor], base: GPTConfig | None = None) -> GPTConfig:
    """Config from the weights: vocab, context, width, depth, MLP ratio, bias, MultiMax places and V2.

    The weights do not hold n_head, ln_eps, dropout, nor first vs second order; those come from `base`,
    else from the preset with the same depth and width (else n_head is an error).
    """
    sd = adapt_state_dict(state_dict)
    for key in ("wte.weight", "wpe.weight", "blocks.0.mlp.fc.weight"):
        if key not in sd:
            raise CheckpointError(f"not a GPT state dict: key {key} is missing")
    vocab_size, n_embd = sd["wte.weight"].shape
    n_layer = 1 + max(int(m.group(1)) for k in sd if (m := _BLOCK_KEY.match(k)))
    hidden = sd["blocks.0.mlp.fc.weight"].shape[0]
    if hidden % n_embd:
        raise CheckpointError(f"MLP width {hidden} is not a multiple of the embedding width {n_embd}")
    inferred: dict[str, Any] = dict(
        vocab_size=int(vocab_size),
        block_size=int(sd["wpe.weight"].shape[0]),
        n_embd=int(n_embd),
        n_layer=n_layer,
        mlp_ratio=hidden // n_embd,
        bias="blocks.0.attn.c_attn.bias" in sd,
        multimax_attention="blocks.0.attn.multimax.ranges" in sd,
        multimax_output="multimax.ranges" in sd,
    )
    if any(k.endswith(".t") for k in sd):
        inferred["variant"] = "v2"
    if base is not None:
        rest = {k: v for k, v in base.to_dict().items() if k not in inferred}
    else:
        same = [p for p in GPT_PRESETS.values() if (p["n_layer"], p["n_embd"]) == (n_layer, n_embd)]
        if not same:
            raise CheckpointError(
                f"n_head is not stored in the weights and no preset has {n_layer} layers x {n_embd} wide; "
                "pass base=GPTConfig(n_head=...)"
            )
        rest = {"n_head": same[0]["n_head"]}
    try:
        return GPTConfig.from_dict({**rest, **inferred})
    except ValueError as e:
        raise CheckpointError(f"cannot build a config for these weights: {e}") from e
