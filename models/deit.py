"""DeiT with MultiMax attention and output, with parameter names exactly as the official code.

The official MultiMax DeiT (ZhouYuxuanYX/MultiMax, `vision_transformer.py`) has no class token,
average-pools the tokens, has no qkv bias and puts `ranges`/`ts` directly on every Attention module
and on the model (the output MultiMax, applied to the logits). Keeping the same names means an
official state dict loads key for key; `adapt_checkpoint` only unwraps training checkpoints and
infers the config. timm's softmax DeiT (class token, qkv bias, no MultiMax) loads through the same
path with pool="token".
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch
from torch import Tensor, nn

from models.attention_function import config_dict, make_attention_function, normalise_config
from models.config_base import ModelConfig
from models.loading import CheckpointError, check_keys, load_exact, strip_prefixes
from models.multimax import (
    PAPER_TABLE_7,
    VARIANTS,
    Variant,
    attention_probs,
    modulate,
    paper_params,
    paper_row_to_params,
)

Pool = Literal["avg", "token"]


# timm/DeiT evaluation preprocessing: resize the shorter side to 224/0.875, center crop 224.
IMAGENET_PREPROCESS: dict[str, Any] = {
    "channels": "RGB",
    "image_size": 224,
    "resize": 256,
    "interpolation": "bicubic",
    "crop": "center",
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
}


@dataclass
class DeiTConfig(ModelConfig):
    KIND: ClassVar[str] = "DeiT"
    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 384
    depth: int = 12
    num_heads: int = 6
    mlp_ratio: float = 4.0
    qkv_bias: bool = False  # the official MultiMax Attention has none; timm DeiT has one
    ln_eps: float = 1e-6  # DeiT builds its models with partial(nn.LayerNorm, eps=1e-6)
    # The attention scale; None: head_dim**-0.5. timm's vit_small_patch16_224 built for its pretrained
    # weights uses 768**-0.5 (the official file's `qk_scale`).
    qk_scale: float | None = None
    pool: Pool = "avg"  # "avg": official MultiMax (no class token); "token": timm DeiT class token
    multimax_attention: bool = True
    multimax_output: bool = True
    variant: Variant = "second"  # models.multimax.VARIANTS
    # Another reweighting for attention (models.reweighting: sparsemax, entmax15, ...; None: as multimax_attention)
    attention_function: str | None = None
    attention_options: dict[str, float] | None = None  # its hyperparameters (top-k's k; length-scaled eps, m)
    # The output distribution when not softmax (models.output_function: sparsemax, entmax15, evsoftmax); the
    # logits stay the model's output. Excludes MultiMax's output (multimax_output is turned off).
    output_function: str | None = None

    def __post_init__(self) -> None:
        normalise_config(self)
        for name in ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DeiTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.img_size % self.patch_size:
            raise ValueError(f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        if self.qk_scale is not None and not (isinstance(self.qk_scale, int | float) and 0 < self.qk_scale < math.inf):
            raise ValueError(f"qk_scale must be a positive number, got {self.qk_scale!r}")
        if self.pool not in ("avg", "token"):
            raise ValueError(f"pool must be 'avg' or 'token', got {self.pool!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown MultiMax variant {self.variant!r}; expected one of {VARIANTS}")

    @property
    def num_patches(self) -> int:
        return (self.img_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)  # timm's rounding

    @classmethod
    def presets(cls) -> Mapping[str, Mapping[str, Any]]:
        return DEIT_PRESETS

    def to_dict(self) -> dict[str, Any]:
        d = config_dict(dataclasses.asdict(self))
        if d["qk_scale"] is None:  # left out where it is the default, so existing configs read and write as before
            del d["qk_scale"]
        return d



# MULTIMAX.md table; the rest (official layout: avg pool, no qkv bias, MultiMax on) are the defaults. The vit_*
# entries are the official file's other models (timm 0.3's definitions): vit_small is NOT deit_small (768 wide,
# depth 8, MLP ratio 3, nn.LayerNorm's eps 1e-5); vit_base_* is deit_base's shape and settings; vit_huge keeps
# eps 1e-5. `SHAPE` says which fields the weights show: a checkpoint gets a preset's heads and eps only when
# all of them agree.
DEIT_PRESETS: dict[str, dict[str, Any]] = {
    "deit_tiny": dict(embed_dim=192, num_heads=3, depth=12, mlp_ratio=4.0, patch_size=16, img_size=224, ln_eps=1e-6),
    "deit_small": dict(embed_dim=384, num_heads=6, depth=12, mlp_ratio=4.0, patch_size=16, img_size=224, ln_eps=1e-6),
    "deit_base": dict(embed_dim=768, num_heads=12, depth=12, mlp_ratio=4.0, patch_size=16, img_size=224, ln_eps=1e-6),
    "vit_small_patch16_224": dict(embed_dim=768, num_heads=8, depth=8, mlp_ratio=3.0, patch_size=16, img_size=224,
                                  ln_eps=1e-5),
    "vit_large_patch16_224": dict(embed_dim=1024, num_heads=16, depth=24, mlp_ratio=4.0, patch_size=16, img_size=224,
                                  ln_eps=1e-6),
    "vit_huge_patch16_224": dict(embed_dim=1280, num_heads=16, depth=32, mlp_ratio=4.0, patch_size=16, img_size=224,
                                 ln_eps=1e-5),
}
SHAPE = ("embed_dim", "depth", "mlp_ratio")
# Presets whose attention scale depends on how the model was built, not on its name: timm's
# vit_small_patch16_224(pretrained=True) sets qk_scale=768**-0.5, pretrained=False (what DeiT's main.py
# trains) keeps head_dim**-0.5.
AMBIGUOUS_SCALE = {"vit_small_patch16_224": 768**-0.5}


def _add_multimax_params(module: nn.Module, affine: bool) -> None:
    """Register `ranges`, `ts` (and V2's `t`, `b`) on `module` itself: the official key names."""
    module.ranges = nn.Parameter(torch.zeros(4))
    module.ts = nn.Parameter(torch.zeros(4))
    nn.init.trunc_normal_(module.ranges, std=0.02)
    nn.init.trunc_normal_(module.ts, std=0.02)
    if affine:
        module.t = nn.Parameter(torch.tensor(1.0))
        module.b = nn.Parameter(torch.tensor(0.0))


class PatchEmbed(nn.Module):
    def __init__(self, config: DeiTConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(config.in_chans, config.embed_dim, kernel_size=p, stride=p)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, N, C), patches in row-major order


class Attention(nn.Module):
    """Multi-head self-attention; the MultiMax parameters sit on this module, as in the official code.

    They are plain parameters rather than a `Modulation` child so that keys read `attn.ranges`, not
    `attn.<child>.ranges`; `models.multimax.attention_probs` reads them from this module.
    """

    ranges: Tensor  # registered by _add_multimax_params where MultiMax is on
    ts: Tensor

    def __init__(self, config: DeiTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = config.qk_scale if config.qk_scale is not None else self.head_dim**-0.5
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=config.qkv_bias)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)
        self.multimax = config.multimax_attention
        self.variant = config.variant
        self.order = 2 if config.variant == "second" else 1
        if self.multimax:
            _add_multimax_params(self, affine=config.variant == "v2")
        self.reweight = make_attention_function(config.attention_function, config.num_heads, config.attention_options)

    def scores_and_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Scaled scores (B, H, N, N) and values (B, H, N, D) of the tokens x (B, N, C)."""
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, N, D)
        return (q @ k.transpose(-2, -1)) * self.scale, v

    def probs(self, scores: Tensor) -> Tensor:
        """The reweighting step: the configured function, else MultiMax (modulate, softmax) or softmax."""
        if self.reweight is not None:
            return self.reweight(scores)
        return attention_probs(scores, self if self.multimax else None)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        scores, v = self.scores_and_values(x)
        return self.proj((self.probs(scores) @ v).transpose(1, 2).reshape(B, N, C))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, multimax={self.multimax}, variant={self.variant}"  # reweight: a child


class Mlp(nn.Module):
    def __init__(self, config: DeiTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.embed_dim, config.mlp_hidden)
        self.act = nn.GELU()  # exact erf form, as timm
        self.fc2 = nn.Linear(config.mlp_hidden, config.embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: DeiTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=config.ln_eps)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=config.ln_eps)
        self.mlp = Mlp(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DeiT(nn.Module):
    ranges: Tensor  # the output MultiMax, registered by _add_multimax_params where it is on
    ts: Tensor

    def __init__(self, config: DeiTConfig) -> None:
        super().__init__()
        self.config = config
        C = config.embed_dim
        self.patch_embed = PatchEmbed(config)
        num_tokens = config.num_patches
        if config.pool == "token":
            self.cls_token = nn.Parameter(torch.zeros(1, 1, C))
            num_tokens += 1
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, C))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm = nn.LayerNorm(C, eps=config.ln_eps)
        self.head = nn.Linear(C, config.num_classes)
        self._init_weights()
        # Added after the generic init so that apply() cannot touch them (and as the official code does).
        if config.multimax_output:
            _add_multimax_params(self, affine=False)  # V2 keeps t/b in attention only
        self.output_order = 2 if config.variant == "second" else 1

    def _init_weights(self) -> None:
        # timm ViT/DeiT: trunc_normal(.02) for tokens and Linear weights, zero biases, LayerNorm 1/0.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.config.pool == "token":
            nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward_features(self, images: Tensor) -> Tensor:
        """Pooled, normalised features (B, C): what the head reads."""
        height, width = images.shape[-2:]
        size = self.config.img_size
        if height != size or width != size:
            raise ValueError(f"input image size {height}x{width} does not match the model's {size}x{size}")
        x = self.patch_embed(images)
        if self.config.pool == "token":
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return x[:, 0] if self.config.pool == "token" else x.mean(1)

    def block_list(self) -> list[Block]:
        """The blocks, typed (nn.ModuleList's items are typed as any Module)."""
        return [cast(Block, b) for b in self.blocks]

    def forward(self, images: Tensor) -> Tensor:
        logits = self.head(self.forward_features(images))
        if self.config.multimax_output:
            # Official: the head's logits are modulated; the loss' softmax follows outside the model.
            logits = modulate(logits, self, self.output_order)
        return logits


@torch.no_grad()
def set_paper_params(model: DeiT) -> DeiT:
    """Load the paper's learned MultiMax values (Table 7, DeiT-small) into `model`.

    Attention in layer i gets row i (cyclically past 12 layers). The paper lists no values for the
    output MultiMax, so it gets the last row, the deepest layer's, the closest to the logits. V2's
    `t`/`b` are left as they are (the paper has none; identity at init).
    """
    for i, block in enumerate(model.block_list()):
        if block.attn.multimax:
            ranges, ts = paper_params(i, PAPER_TABLE_7)
            block.attn.ranges.copy_(torch.tensor(ranges))
            block.attn.ts.copy_(torch.tensor(ts))
    if model.config.multimax_output:
        ranges, ts = paper_row_to_params(PAPER_TABLE_7[-1])
        model.ranges.copy_(torch.tensor(ranges))
        model.ts.copy_(torch.tensor(ts))
    return model


# ---------------------------------------------------------------------------------------------
# Load hook: official MultiMax / timm DeiT checkpoints -> (DeiTConfig, clean state dict)


def _get(args: Any, name: str) -> Any:
    """Read a field of DeiT's saved `args`: argparse.Namespace, SimpleNamespace or (weights_only) dict."""
    if args is None:
        return None
    if isinstance(args, Mapping):
        return args.get(name)
    return getattr(args, name, None)


def _preset_from_model_name(model_name: Any) -> str | None:
    """The preset of a timm model name: 'deit_small_patch16_224' -> 'deit_small', 'vit_base_patch32_384' ->
    'deit_base' (the same settings), 'vit_large_patch16_384' -> 'vit_large_patch16_224'."""
    if not isinstance(model_name, str):
        return None
    if m := re.match(r"deit_(tiny|small|base)(?:_|$)", model_name):
        return f"deit_{m.group(1)}"
    if m := re.fullmatch(r"vit_(small|base|large|huge)_patch\d+_\d+", model_name):
        return "deit_base" if m.group(1) == "base" else f"vit_{m.group(1)}_patch16_224"
    return None


def _choose_preset(flag: str | None, model_name: Any, facts: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(preset, where it came from) for a checkpoint whose weights show `facts` (SHAPE's fields)."""
    if flag is not None:
        if flag not in DEIT_PRESETS:
            raise CheckpointError(f"unknown DeiT preset {flag!r}; known presets: {', '.join(DEIT_PRESETS)}")
        width = DEIT_PRESETS[flag]["embed_dim"]
        if width != facts["embed_dim"]:
            raise CheckpointError(f"preset {flag} is {width} wide but the checkpoint is {facts['embed_dim']} wide; "
                                  "pass num_heads (--num-heads) and ln_eps (--ln-eps) instead")
        return flag, "flag"  # the user's word for the rest (depth may differ: a shallower run of that model)
    # A saved model name that the weights contradict (a renamed or edited run) is not trusted.
    named = _preset_from_model_name(model_name)
    if named is not None and _fits(named, facts):
        return named, "args"
    shaped = next((name for name in DEIT_PRESETS if _fits(name, facts)), None)
    return (shaped, "preset") if shaped else (None, None)


def _fits(preset: str, facts: Mapping[str, Any]) -> bool:
    return all(DEIT_PRESETS[preset][k] == facts[k] for k in SHAPE)


def _nearest(facts: Mapping[str, Any]) -> str:
    """' (deit_small is depth 12, MLP ratio 4)': the presets of the same width, for the error message."""
    same = [n for n, p in DEIT_PRESETS.items() if p["embed_dim"] == facts["embed_dim"]]
    told = [f"{n} is depth {DEIT_PRESETS[n]['depth']}, MLP ratio {DEIT_PRESETS[n]['mlp_ratio']:g}" for n in same]
    return f" ({'; '.join(told)})" if told else ""


def _attention_scale(flag: float | None, args: Any, preset: str | None, embed_dim: int,
                     heads: int) -> tuple[float | None, str]:
    """(qk_scale or None for head_dim**-0.5, where it came from)."""
    value, source = (flag, "flag") if flag is not None else (_get(args, "qk_scale"), "args")
    if value is not None:
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
            raise CheckpointError(f"qk_scale {value!r} (from {source}) must be a positive number")
        return float(value), source
    if preset in AMBIGUOUS_SCALE and args is None:
        # DeiT's main.py always builds with pretrained=False, so a training checkpoint (args saved) is known.
        head_dim = embed_dim // heads
        raise CheckpointError(
            f"cannot tell the attention scale of a {preset}: timm uses qk_scale {AMBIGUOUS_SCALE[preset]:.6g} "
            f"(768**-0.5) for its pretrained weights and head_dim**-0.5 = {head_dim**-0.5:.6g} when built with "
            "pretrained=False (as DeiT's training does); pass qk_scale (--qk-scale)")
    return None, "default"


def _unwrap(obj: Any, use_ema: bool) -> tuple[Mapping[str, Any], str, Any, Any]:
    """-> (state dict, which part it came from, saved args, epoch)."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"not a DeiT checkpoint: expected a state dict or a training checkpoint dict, got {type(obj).__name__}"
        )
    if isinstance(obj.get("model"), Mapping):  # DeiT main.py: {'model', 'optimizer', ..., 'args'}
        if use_ema:
            if not isinstance(obj.get("model_ema"), Mapping):
                raise CheckpointError("use_ema was asked for but the checkpoint has no 'model_ema' state dict")
            return obj["model_ema"], "model_ema", obj.get("args"), obj.get("epoch")
        return obj["model"], "model", obj.get("args"), obj.get("epoch")
    if use_ema:
        raise CheckpointError("use_ema was asked for but this is a raw state dict, not a training checkpoint")
    return obj, "raw", None, None


def _shape(sd: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = sd.get(key)
    if not isinstance(value, Tensor):
        raise CheckpointError(f"not a DeiT state dict: no tensor {key!r}")
    return tuple(value.shape)


def _block_indices(sd: Mapping[str, Any], suffix: str = "") -> set[int]:
    pattern = re.compile(r"blocks\.(\d+)\." + re.escape(suffix) + ("$" if suffix else ""))
    return {int(m.group(1)) for k in sd if (m := pattern.match(k))}


def _expected_shapes(config: DeiTConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = DeiT(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def adapt_checkpoint(
    obj: Any,
    *,
    preset: str | None = None,
    num_heads: int | None = None,
    ln_eps: float | None = None,
    qk_scale: float | None = None,
    variant: str | None = None,
    use_ema: bool = False,
) -> tuple[DeiTConfig, dict[str, Tensor], dict[str, Any]]:
    """Infer a DeiTConfig from an official MultiMax or timm DeiT checkpoint and clean its state dict.

    Shapes give width, depth, patch, channels, image size, classes, MLP ratio, qkv bias, pooling and
    where MultiMax sits; V2 is recognised by its `t` scalars ("first" vs "second" order cannot be seen
    in the weights: pass `variant`). Head count, LayerNorm eps and attention scale are not in the weights;
    they come from the explicit arguments (`num_heads`, `ln_eps`, `qk_scale`, `preset`), else the
    checkpoint's saved `args` (`num_heads`, `ln_eps`, `qk_scale`, or the preset its `model` names), else
    the preset whose width, depth and MLP ratio all equal the weights'. What none of them tells is an error
    asking for it; distilled and hybrid models are refused by name.
    """
    raw, source, args, epoch = _unwrap(obj, use_ema)
    sd = strip_prefixes(raw)
    if "patch_embed.proj.weight" not in sd:
        raise CheckpointError(
            "not a DeiT state dict: no 'patch_embed.proj.weight' (keys start with "
            f"{', '.join(list(sd)[:3]) or 'nothing'})"
        )
    # Refused by name rather than failing later on a key or shape that does not say why.
    if "dist_token" in sd or any(k.startswith("head_dist.") for k in sd):
        raise CheckpointError("distilled DeiT (dist_token / head_dist, e.g. deit_base_distilled_patch16_224) is not "
                              "supported: it has a second head and token this loader does not build")
    if any(k.startswith("patch_embed.backbone.") for k in sd):
        raise CheckpointError("hybrid ViT (a ResNet backbone in patch_embed.backbone.*, e.g. vit_base_resnet50d_224) "
                              "is not supported: only patch-embedding ViT/DeiT models load")

    pw = _shape(sd, "patch_embed.proj.weight")
    if len(pw) != 4 or pw[2] != pw[3]:
        raise CheckpointError(f"patch_embed.proj.weight has shape {pw}; expected (C, in_chans, p, p)")
    embed_dim, in_chans, patch_size = pw[0], pw[1], pw[2]

    pool: Pool = "token" if "cls_token" in sd else "avg"
    pos = _shape(sd, "pos_embed")
    num_patches = pos[1] - (1 if pool == "token" else 0) if len(pos) == 3 else 0
    grid = math.isqrt(max(num_patches, 0))
    if len(pos) != 3 or grid * grid != num_patches or grid == 0:
        raise CheckpointError(
            f"pos_embed has shape {pos}; expected (1, {'1+' if pool == 'token' else ''}g*g, "
            f"{embed_dim}) for a square patch grid"
        )

    num_classes = _shape(sd, "head.weight")[0]
    depth = max(_block_indices(sd), default=-1) + 1
    if depth == 0:
        raise CheckpointError("not a DeiT state dict: no 'blocks.{i}.*' keys")
    hidden = _shape(sd, "blocks.0.mlp.fc1.weight")[0]
    mlp_ratio = hidden / embed_dim
    if int(embed_dim * mlp_ratio) != hidden:
        raise CheckpointError(f"MLP width {hidden} is not int({embed_dim} * ratio) for any ratio this model can use")

    # MultiMax placement must be uniform: a partial set means a mangled or foreign checkpoint.
    blocks = set(range(depth))
    for suffix, what in (("attn.ranges", "attention MultiMax"), ("attn.t", "V2 scalars t/b")):
        have = _block_indices(sd, suffix)
        if have and have != blocks:
            raise CheckpointError(
                f"{what} ({suffix}) only in blocks {sorted(have)}; missing in blocks "
                f"{sorted(blocks - have)}; expected all or none"
            )
    multimax_attention = bool(_block_indices(sd, "attn.ranges"))
    multimax_output = "ranges" in sd
    is_v2 = bool(_block_indices(sd, "attn.t"))
    if variant is None:
        variant = "v2" if is_v2 else "second"
    elif variant not in VARIANTS:
        raise CheckpointError(f"unknown MultiMax variant {variant!r}; expected one of {VARIANTS}")
    elif (variant == "v2") != is_v2:
        raise CheckpointError(
            f"variant {variant!r} does not fit the checkpoint: it "
            f"{'has' if is_v2 else 'has no'} V2 scalars blocks.{{i}}.attn.t/b"
        )

    # Heads, eps and attention scale are not in the weights: explicit flags > the checkpoint's args > a preset
    # that the args name or whose shape the weights have (all of SHAPE, not the width alone).
    facts = {"embed_dim": embed_dim, "depth": depth, "mlp_ratio": mlp_ratio}
    preset_name, preset_from = _choose_preset(preset, _get(args, "model"), facts)
    preset_cfg = DEIT_PRESETS[preset_name] if preset_name else {}
    unknown = (f"a {embed_dim}-wide DeiT of depth {depth} and MLP ratio {mlp_ratio:g} matches no preset"
               f"{_nearest(facts)}, and the checkpoint saves no args that say")

    def first(name: str, flag: Any) -> tuple[Any, str] | None:
        """The first source that knows `name`: its flag, a --preset, the saved args, a preset they or the shape name."""
        from_preset = preset_cfg.get(name)
        candidates = [(flag, "flag"), (from_preset if preset_from == "flag" else None, "flag"),
                      (_get(args, name), "args"), (from_preset, preset_from or "preset")]
        return next(((v, src) for v, src in candidates if v is not None), None)

    found = first("num_heads", num_heads)
    if found is None:
        raise CheckpointError(f"cannot tell the number of attention heads: {unknown}; pass num_heads (--num-heads)"
                              " and ln_eps (--ln-eps), or a preset (--preset)")
    heads, heads_from = int(found[0]), found[1]
    if heads < 1 or embed_dim % heads:
        raise CheckpointError(f"num_heads {heads} (from {heads_from}) does not divide embed_dim {embed_dim}")
    eps_source = first("ln_eps", ln_eps)
    if eps_source is None:
        raise CheckpointError(f"cannot tell the LayerNorm eps: {unknown}; pass ln_eps (--ln-eps): DeiT's models use "
                              "1e-6, a VisionTransformer built without a norm_layer nn.LayerNorm's default 1e-5")
    eps = float(eps_source[0])
    if not 0 < eps < 1:
        raise CheckpointError(f"ln_eps {eps} (from {eps_source[1]}) must be between 0 and 1")
    scale, scale_from = _attention_scale(qk_scale, args, preset_name, embed_dim, heads)

    config = DeiTConfig(
        img_size=grid * patch_size,
        patch_size=patch_size,
        in_chans=in_chans,
        num_classes=num_classes,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=heads,
        mlp_ratio=mlp_ratio,
        qkv_bias="blocks.0.attn.qkv.bias" in sd,
        ln_eps=eps,
        qk_scale=scale,
        pool=pool,
        multimax_attention=multimax_attention,
        multimax_output=multimax_output,
        variant=cast(Variant, variant),  # checked against VARIANTS above
    )
    check_keys(_expected_shapes(config), sd)  # before allocating the real model
    info = {
        "layout": "timm-deit" if pool == "token" else "official-multimax",
        "source_keys": source,
        "heads_from": heads_from,
        "ln_eps_from": eps_source[1],
        "qk_scale_from": scale_from,
        "preset": preset_name,
        "epoch": epoch,
    }
    return config, dict(sd), info


def build_from_checkpoint(obj: Any, **hints: Any) -> tuple[DeiT, DeiTConfig, dict[str, Any]]:
    """adapt_checkpoint (same keyword hints) + construct + exact load; the model is returned in eval mode."""
    config, sd, info = adapt_checkpoint(obj, **hints)
    model = DeiT(config)
    load_exact(model, sd, source="checkpoint")
    return model.eval(), config, info
