"""fairseq's `transformer_lm` decoder with the official MultiMax files, under the project's text contract.

The module tree mirrors fairseq's (`decoder.layers.{i}.self_attn.q_proj`, `decoder.ranges`, ...), so a
fairseq state dict loads key for key. Every switch that fairseq's configuration sets is a config field here
(pre- or post-norm, final LayerNorm, activation, embedding scale, positions, input/output projections, tied
output); `models.fairseq_checkpoint` reads them from the checkpoint, nothing is assumed.

The forward is fairseq's full (training) forward: in the official `multihead_attention.py` the attention
MultiMax sits in that path only (its incremental path has the modulation commented out). With an explicit
KV cache (the same contract as `models.gpt`) every step computes what the full forward computes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention_hook import Attend, AttentionLayer, LayerAttend, attention_layer, for_layer
from .config_base import ModelConfig
from .gpt import KV, PastKeyValues, build_attention_mask, empty_past, past_and_positions
from .multimax import PAPER_TABLE_8, attention_probs, modulate, paper_params

ACTIVATIONS = ("relu", "gelu", "gelu_accurate", "tanh", "linear", "swish")
POSITIONS = ("sinusoidal", "learned", "none")


@dataclass
class FairseqLMConfig(ModelConfig):
    KIND: ClassVar[str] = "fairseq LM"
    vocab_size: int = 8
    block_size: int = 512  # fairseq's max_target_positions
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32  # decoder_embed_dim
    input_dim: int | None = None  # decoder_input_dim (the token embedding width); None: n_embd
    output_dim: int | None = None  # decoder_output_dim (the output projection's input); None: n_embd
    ffn_dim: int = 128
    normalize_before: bool = False  # pre-norm layers
    final_norm: bool = False  # decoder.layer_norm (fairseq: normalize_before and not no_decoder_final_norm)
    layernorm_embedding: bool = False
    activation: str = "relu"
    scale_embedding: bool = True  # tokens times sqrt(n_embd)
    positions: str = "sinusoidal"
    padding_idx: int = 1  # the dictionary's <pad>; positions start at padding_idx + 1
    tied: bool = True  # output projection = token embedding
    ln_eps: float = 1e-5
    multimax_attention: bool = True
    multimax_output: bool = True
    variant: str = "second"  # the official fairseq files are second order only
    # The text contract's fields that this architecture does not vary (always softmax-based MultiMax here).
    attention_function: str | None = None
    attention_options: dict[str, float] | None = None
    output_function: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"FairseqLMConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.positions not in POSITIONS:
            raise ValueError(f"unknown positions {self.positions!r} (known: {', '.join(POSITIONS)})")
        if self.variant != "second":
            raise ValueError("the fairseq MultiMax files are second order: variant must be 'second'")
        if self.attention_function or self.output_function:
            raise ValueError("a fairseq LM uses MultiMax or softmax; other reweighting functions are not supported")
        if self.tied and self.output_width != self.embed_width:
            raise ValueError(f"tied output needs output_dim == input_dim, got {self.output_width} and "
                             f"{self.embed_width}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def embed_width(self) -> int:
        return self.input_dim or self.n_embd

    @property
    def output_width(self) -> int:
        return self.output_dim or self.n_embd

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


    @classmethod
    def presets(cls) -> Mapping[str, Mapping[str, Any]]:
        return FAIRSEQ_PRESETS


# No presets: a fairseq LM's shape, switches and vocabulary all come from its checkpoint's configuration and
# dictionary (`python -m models init` makes project-format models, which have neither).
FAIRSEQ_PRESETS: dict[str, dict[str, Any]] = {}


def sinusoidal_table(rows: int, dim: int, padding_idx: int) -> Tensor:
    """fairseq's SinusoidalPositionalEmbedding table: sin half then cos half, row `padding_idx` zero."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.float)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    table[padding_idx] = 0
    return table


def activation(name: str, x: Tensor) -> Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "gelu":
        return F.gelu(x)  # fairseq's gelu: the exact (erf) one
    if name == "gelu_accurate":
        return F.gelu(x, approximate="tanh")
    if name == "tanh":
        return torch.tanh(x)
    if name == "swish":
        return F.silu(x)
    return x  # linear


class SelfAttention(nn.Module):
    """fairseq's MultiheadAttention (separate q/k/v projections with bias), the official MultiMax's `ranges`/`ts`
    held by the module itself as in `multihead_attention.py`."""

    order = 2

    def __init__(self, config: FairseqLMConfig) -> None:
        super().__init__()
        c = config.n_embd
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(c, c) for _ in range(4))
        if config.multimax_attention:
            self.ranges = nn.Parameter(torch.zeros(4))
            self.ts = nn.Parameter(torch.zeros(4))

    def forward(self, x: Tensor, mask: Tensor | None, past: KV | None,
                attend: LayerAttend | None = None) -> tuple[Tensor, KV]:
        B, T, C = x.shape
        if attend is not None:  # one attention node per layer (models.attention_hook): its scale is 1/sqrt(head_dim)
            y, present = attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), past, mask)
            return self.out_proj(y), present

        def heads(t: Tensor) -> Tensor:
            return t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        scores = (q / math.sqrt(self.head_dim)) @ k.transpose(-2, -1)  # the official order: scale q, then q.k
        probs = attention_probs(scores, self if hasattr(self, "ranges") else None, mask)  # modulate, mask, softmax
        y = (probs @ v).transpose(1, 2).reshape(B, T, C)
        return self.out_proj(y), (k, v)


class DecoderLayer(nn.Module):
    """fairseq's TransformerDecoderLayer without encoder attention: post-norm, or pre-norm (normalize_before)."""

    def __init__(self, config: FairseqLMConfig) -> None:
        super().__init__()
        self.pre, self.act = config.normalize_before, config.activation
        self.self_attn = SelfAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.n_embd, eps=config.ln_eps)
        self.fc1 = nn.Linear(config.n_embd, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, config.n_embd)
        self.final_layer_norm = nn.LayerNorm(config.n_embd, eps=config.ln_eps)

    def forward(self, x: Tensor, mask: Tensor | None, past: KV | None,
                attend: LayerAttend | None = None) -> tuple[Tensor, KV]:
        h = self.self_attn_layer_norm(x) if self.pre else x
        a, present = self.self_attn(h, mask, past, attend)
        x = x + a
        if not self.pre:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre else x
        x = x + self.fc2(activation(self.act, self.fc1(h)))
        if not self.pre:
            x = self.final_layer_norm(x)
        return x, present


class Decoder(nn.Module):
    """fairseq's TransformerDecoder as the official `transformer_decoder.py` has it: output MultiMax on the logits
    (`decoder.ranges` / `decoder.ts`)."""

    order = 2

    def __init__(self, config: FairseqLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_scale = math.sqrt(config.n_embd) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embed_width, padding_idx=config.padding_idx)
        if config.embed_width != config.n_embd:
            self.project_in_dim = nn.Linear(config.embed_width, config.n_embd, bias=False)
        rows = config.block_size + config.padding_idx + 1
        if config.positions == "learned":
            self.embed_positions = nn.Embedding(rows, config.n_embd, padding_idx=config.padding_idx)
        elif config.positions == "sinusoidal":
            # computed, not stored (fairseq saves none, or a placeholder `_float_tensor` the loader drops)
            self.register_buffer("sinusoidal", sinusoidal_table(rows, config.n_embd, config.padding_idx),
                                 persistent=False)
        if config.layernorm_embedding:
            self.layernorm_embedding = nn.LayerNorm(config.n_embd, eps=config.ln_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layer))
        if config.final_norm:
            self.layer_norm = nn.LayerNorm(config.n_embd, eps=config.ln_eps)
        if config.output_width != config.n_embd:
            self.project_out_dim = nn.Linear(config.n_embd, config.output_width, bias=False)
        self.output_projection = nn.Linear(config.output_width, config.vocab_size, bias=False)
        if config.tied:
            self.output_projection.weight = self.embed_tokens.weight
        if config.multimax_output:
            self.ranges = nn.Parameter(torch.zeros(4))
            self.ts = nn.Parameter(torch.zeros(4))

    def positions(self, position_ids: Tensor) -> Tensor | None:
        rows = position_ids + self.config.padding_idx + 1  # fairseq's make_positions offset
        if self.config.positions == "learned":
            return cast(Tensor, self.embed_positions(rows))
        if self.config.positions == "sinusoidal":
            return cast(Tensor, self.sinusoidal)[rows]
        return None

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, mask: Tensor | None, past_key_values: PastKeyValues | None,
        attend: Attend | None = None,
    ) -> tuple[Tensor, PastKeyValues]:
        x = self.embed_scale * self.embed_tokens(input_ids)
        if hasattr(self, "project_in_dim"):
            x = self.project_in_dim(x)
        pos = self.positions(position_ids)
        if pos is not None:
            x = x + pos.to(x.dtype)
        if hasattr(self, "layernorm_embedding"):
            x = self.layernorm_embedding(x)
        presents: PastKeyValues = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, mask, past_key_values[i] if past_key_values else None, for_layer(attend, i))
            presents.append(present)
        if hasattr(self, "layer_norm"):
            x = self.layer_norm(x)
        if hasattr(self, "project_out_dim"):
            x = self.project_out_dim(x)
        logits = self.output_projection(x)
        return (modulate(logits, self) if hasattr(self, "ranges") else logits), presents


class FairseqLM(nn.Module):
    """The text contract's forward (ids, positions, mask, past -> logits, presents) over fairseq's decoder."""

    # the text-model capabilities (models.registry.TextModel): every position's logits; the past is concatenated
    keeps_last_logits = False
    grows_cache_in_place = False

    def __init__(self, config: FairseqLMConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = Decoder(config)

    def attention_layers(self) -> list[AttentionLayer]:
        """Per layer what an attention node needs (models.attention_hook): scores (q / sqrt(d)) . k, MultiMax."""
        c = self.config
        attns = [cast(SelfAttention, d.self_attn) for d in self.decoder.layers]
        scale = 1 / math.sqrt(c.head_dim)
        return [attention_layer(c.n_head, c.n_head, c.head_dim, scale, a if hasattr(a, "ranges") else None)
                for a in attns]

    def empty_past(self, batch_size: int, dtype: torch.dtype | None = None, device: Any = None) -> PastKeyValues:
        """A zero-length cache as `forward` takes it: per layer (key, value) of (B, n_head, 0, head_dim)."""
        weight, c = self.decoder.embed_tokens.weight, self.config
        return empty_past(c.n_layer, c.n_head, c.head_dim, batch_size, dtype or weight.dtype, device or weight.device)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: PastKeyValues | None = None,
        attend: Attend | None = None,
    ) -> tuple[Tensor, PastKeyValues]:
        """input_ids (B, T); position_ids default to past_len..past_len+T-1 (0-based, without fairseq's offset);
        attention_mask (B, past_len + T) with 1 for real tokens. `attend`: each layer's attention by that instead
        (models.attention_hook)."""
        T = input_ids.shape[1]
        # no context check here: as before (left-padded rows count from their first real token, as fairseq's)
        past_len, position_ids = past_and_positions(input_ids, position_ids, attention_mask, past_key_values, None)
        dtype = self.decoder.embed_tokens.weight.dtype
        mask = attention_mask if attend is not None else build_attention_mask(
            T, past_len, attention_mask, dtype, input_ids.device)
        return cast(tuple[Tensor, PastKeyValues], self.decoder(input_ids, position_ids, mask, past_key_values, attend))


@torch.no_grad()
def set_paper_params(model: FairseqLM, table: tuple[tuple[float, ...], ...] = PAPER_TABLE_8) -> None:
    """Table 8's learned parameters: row i for attention layer i, the last row for the output MultiMax."""
    owners = [cast(SelfAttention, layer.self_attn) for layer in model.decoder.layers]
    for i, attn in enumerate(owners):
        if hasattr(attn, "ranges"):
            ranges, ts = paper_params(i, table)
            attn.ranges.copy_(torch.tensor(ranges))
            attn.ts.copy_(torch.tensor(ts))
    if hasattr(model.decoder, "ranges"):
        ranges, ts = paper_params(len(table) - 1, table)
        model.decoder.ranges.copy_(torch.tensor(ranges))
        model.decoder.ts.copy_(torch.tensor(ts))
