"""DeiT loader and model against hand-built official / timm checkpoints and a plain-torch reference."""

from __future__ import annotations

import argparse
import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from models.deit import (
    DEIT_PRESETS,
    DeiT,
    DeiTConfig,
    adapt_checkpoint,
    build_from_checkpoint,
    set_paper_params,
)
from models.loading import CheckpointError
from models.multimax import PAPER_TABLE_7, paper_params, paper_row_to_params

SMALL = dict(embed_dim=48, depth=2, num_heads=3, img_size=32, patch_size=8, num_classes=10)


# ---------------------------------------------------------------------------------------------
# Hand-built checkpoints: keys and shapes as MULTIMAX.md lists them, not taken from models.deit.


def make_state_dict(
    *,
    embed: int = 48,
    depth: int = 2,
    img: int = 32,
    patch: int = 8,
    in_chans: int = 3,
    classes: int = 10,
    hidden: int | None = None,
    cls_token: bool = False,
    qkv_bias: bool = False,
    mm_attn: bool = True,
    mm_out: bool = True,
    v2: bool = False,
    seed: int = 0,
    lazy: bool = False,
) -> dict[str, torch.Tensor]:
    """Random weights scaled so that attention scores and logits reach MultiMax's breakpoints (|x| ~ 1-3);
    MultiMax parameters are the paper's Table 7 rows (output: the last row). `lazy`: the shapes only (one
    zero broadcast to each), for loader tests of full-size models that never run them."""
    g = torch.Generator().manual_seed(seed)
    hidden = hidden or 4 * embed
    tokens = (img // patch) ** 2 + (1 if cls_token else 0)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.zeros(()).expand(*shape) if lazy else torch.randn(*shape, generator=g) * std

    sd: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": rnd(embed, in_chans, patch, patch, std=0.1),
        "patch_embed.proj.bias": rnd(embed, std=0.1),
        "pos_embed": rnd(1, tokens, embed, std=0.5),
    }
    if cls_token:
        sd["cls_token"] = rnd(1, 1, embed, std=0.5)
    for i in range(depth):
        p = f"blocks.{i}."
        sd[p + "norm1.weight"] = 1 + rnd(embed, std=0.1)
        sd[p + "norm1.bias"] = rnd(embed, std=0.1)
        sd[p + "attn.qkv.weight"] = rnd(3 * embed, embed, std=0.2)
        if qkv_bias:
            sd[p + "attn.qkv.bias"] = rnd(3 * embed, std=0.1)
        sd[p + "attn.proj.weight"] = rnd(embed, embed, std=0.15)
        sd[p + "attn.proj.bias"] = rnd(embed, std=0.1)
        if mm_attn:
            ranges, ts = paper_params(i, PAPER_TABLE_7)
            sd[p + "attn.ranges"] = torch.tensor(ranges)
            sd[p + "attn.ts"] = torch.tensor(ts)
        if v2:
            sd[p + "attn.t"] = torch.tensor(1.3 + 0.2 * i)
            sd[p + "attn.b"] = torch.tensor(-0.4 + 0.3 * i)
        sd[p + "norm2.weight"] = 1 + rnd(embed, std=0.1)
        sd[p + "norm2.bias"] = rnd(embed, std=0.1)
        sd[p + "mlp.fc1.weight"] = rnd(hidden, embed, std=0.15)
        sd[p + "mlp.fc1.bias"] = rnd(hidden, std=0.1)
        sd[p + "mlp.fc2.weight"] = rnd(embed, hidden, std=0.1)
        sd[p + "mlp.fc2.bias"] = rnd(embed, std=0.1)
    sd["norm.weight"] = 1 + rnd(embed, std=0.1)
    sd["norm.bias"] = rnd(embed, std=0.1)
    sd["head.weight"] = rnd(classes, embed, std=0.12)
    sd["head.bias"] = rnd(classes, std=0.12)
    if mm_out:
        ranges, ts = paper_row_to_params(PAPER_TABLE_7[-1])
        sd["ranges"] = torch.tensor(ranges)
        sd["ts"] = torch.tensor(ts)
    return sd


def training_checkpoint(sd: dict[str, torch.Tensor], args: object, **extra: object) -> dict[str, object]:
    """DeiT main.py's save format, with DDP's `module.` prefix."""
    return {
        "model": {"module." + k: v for k, v in sd.items()},
        "optimizer": {},
        "lr_scheduler": {},
        "epoch": 3,
        "args": args,
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# Independent reference: the paper's formulas over the raw tensors, no nn.Modules.


def paper_sigma(x: torch.Tensor, ranges: torch.Tensor, ts: torch.Tensor, order: int) -> torch.Tensor:
    # ranges = [b1, d1, b2, d2]; ts = [1-t_b1, t_d1-1, 1-t_b2, t_d2-1] (paper eq. 4 / eq. 6)
    b1, d1, b2, d2 = ranges
    out = x + ts[0] * (b1 - x).clamp(min=0) + ts[1] * (x - d1).clamp(min=0)
    if order == 2:
        out = out + ts[2] * (b2 - x).clamp(min=0) ** 2 + ts[3] * (x - d2).clamp(min=0) ** 2
    return out


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def reference_forward(
    sd: dict[str, torch.Tensor], images: torch.Tensor, *, heads: int, eps: float = 1e-6, order: int = 2,
    scale: float | None = None,
) -> torch.Tensor:
    w = sd["patch_embed.proj.weight"]
    embed, _, patch, _ = w.shape
    B = images.shape[0]
    cols = F.unfold(images, kernel_size=patch, stride=patch)  # (B, in_chans*p*p, N), row-major patches
    x = cols.transpose(1, 2) @ w.reshape(embed, -1).T + sd["patch_embed.proj.bias"]
    if "cls_token" in sd:
        x = torch.cat([sd["cls_token"].expand(B, -1, -1), x], dim=1)
    x = x + sd["pos_embed"]
    D = embed // heads
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for i in range(depth):
        p = f"blocks.{i}."
        h = layer_norm(x, sd[p + "norm1.weight"], sd[p + "norm1.bias"], eps)
        qkv = h @ sd[p + "attn.qkv.weight"].T
        if p + "attn.qkv.bias" in sd:
            qkv = qkv + sd[p + "attn.qkv.bias"]
        q, k, v = qkv[..., :embed], qkv[..., embed : 2 * embed], qkv[..., 2 * embed :]
        heads_out = []
        for hd in range(heads):
            sl = slice(hd * D, (hd + 1) * D)
            s = torch.einsum("bnd,bmd->bnm", q[..., sl], k[..., sl]) * (scale or 1 / math.sqrt(D))
            if p + "attn.t" in sd:
                s = sd[p + "attn.t"] * s + sd[p + "attn.b"]
            if p + "attn.ranges" in sd:
                s = paper_sigma(s, sd[p + "attn.ranges"], sd[p + "attn.ts"], order)
            a = torch.exp(s - s.amax(-1, keepdim=True))
            a = a / a.sum(-1, keepdim=True)
            heads_out.append(a @ v[..., sl])
        x = x + torch.cat(heads_out, dim=-1) @ sd[p + "attn.proj.weight"].T + sd[p + "attn.proj.bias"]
        h = layer_norm(x, sd[p + "norm2.weight"], sd[p + "norm2.bias"], eps)
        h = h @ sd[p + "mlp.fc1.weight"].T + sd[p + "mlp.fc1.bias"]
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        x = x + h @ sd[p + "mlp.fc2.weight"].T + sd[p + "mlp.fc2.bias"]
    x = layer_norm(x, sd["norm.weight"], sd["norm.bias"], eps)
    feat = x[:, 0] if "cls_token" in sd else x.mean(1)
    logits = feat @ sd["head.weight"].T + sd["head.bias"]
    if "ranges" in sd:
        logits = paper_sigma(logits, sd["ranges"], sd["ts"], order)
    return logits


def max_diff(model: torch.nn.Module, sd: dict[str, torch.Tensor], x: torch.Tensor, **kw: float) -> float:
    """Largest |model - reference| in float32; also checks float64, where only the formulas can differ
    (to 1e-6, not ~1e-12: models.multimax.attention_probs runs its softmax in float32 for any input dtype)."""
    with torch.no_grad():
        got = model(x)
        got64 = copy.deepcopy(model).double()(x.double())
    want64 = reference_forward({k: v.double() for k, v in sd.items()}, x.double(), **kw)
    assert (got64 - want64).abs().max().item() <= 1e-6
    return (got - reference_forward(sd, x, **kw)).abs().max().item()


def images(n: int = 2, size: int = 32, chans: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, chans, size, size, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# The key test: official layout inside a DeiT training checkpoint == the reference.


def test_official_checkpoint_matches_reference() -> None:
    sd = make_state_dict()
    ckpt = training_checkpoint(sd, {"model": "multimax_deit_custom", "num_heads": 3, "ln_eps": 1e-6, "epochs": 300})
    model, config, info = build_from_checkpoint(ckpt)

    assert not model.training
    assert info == {
        "layout": "official-multimax",
        "source_keys": "model",
        "heads_from": "args",
        "ln_eps_from": "args",
        "qk_scale_from": "default",
        "preset": None,
        "epoch": 3,
    }
    assert config == DeiTConfig(**SMALL, variant="second")
    x = images()
    with torch.no_grad():
        got = model(x)
    want = reference_forward(sd, x, heads=3)
    assert got.shape == (2, 10)
    assert (got - want).abs().max().item() <= 1e-5
    assert max_diff(model, sd, x, heads=3) <= 1e-5  # and float64 to 1e-6
    # The test means something only if MultiMax changes the result: softmax alone is far away.
    plain = {k: v for k, v in sd.items() if not k.endswith(("ranges", "ts"))}
    assert (reference_forward(plain, x, heads=3) - want).abs().max().item() > 1e-1
    # forward_features is the mean-pooled, normalised token set the head reads.
    with torch.no_grad():
        feats = model.forward_features(x)
    assert feats.shape == (2, 48)


def test_state_dict_keys_are_official() -> None:
    official = make_state_dict()
    model = DeiT(DeiTConfig(**SMALL))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {
        k: tuple(v.shape) for k, v in official.items()
    }
    timm = make_state_dict(cls_token=True, qkv_bias=True, mm_attn=False, mm_out=False)
    model = DeiT(DeiTConfig(**SMALL, pool="token", qkv_bias=True, multimax_attention=False, multimax_output=False))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in timm.items()}


def test_timm_layout_matches_reference() -> None:
    sd = make_state_dict(cls_token=True, qkv_bias=True, mm_attn=False, mm_out=False, seed=5)
    model, config, info = build_from_checkpoint(sd, num_heads=3, ln_eps=1e-6)
    assert info["layout"] == "timm-deit" and info["source_keys"] == "raw" and info["epoch"] is None
    assert config.pool == "token" and config.qkv_bias
    assert not config.multimax_attention and not config.multimax_output
    assert max_diff(model, sd, images(3), heads=3) <= 1e-5


# ---------------------------------------------------------------------------------------------
# Inference of the config from the weights


def test_infers_shapes_from_weights() -> None:
    sd = make_state_dict(embed=48, depth=3, img=24, patch=4, in_chans=1, classes=7, hidden=96, qkv_bias=True)
    config, clean, _ = adapt_checkpoint(sd, num_heads=4, ln_eps=1e-6)
    assert (config.embed_dim, config.depth, config.num_heads) == (48, 3, 4)
    assert (config.patch_size, config.img_size, config.in_chans) == (4, 24, 1)
    assert (config.num_classes, config.mlp_ratio, config.qkv_bias) == (7, 2.0, True)
    assert config.pool == "avg" and config.num_patches == 36 and config.head_dim == 12
    assert clean.keys() == sd.keys()
    model, _, _ = build_from_checkpoint(sd, num_heads=4, ln_eps=1e-6)
    assert max_diff(model, sd, images(1, size=24, chans=1), heads=4) <= 1e-5


@pytest.mark.parametrize(("mm_attn", "mm_out"), [(True, False), (False, True), (False, False)])
def test_infers_multimax_placement(mm_attn: bool, mm_out: bool) -> None:
    sd = make_state_dict(mm_attn=mm_attn, mm_out=mm_out)
    model, config, _ = build_from_checkpoint(sd, num_heads=3, ln_eps=1e-6)
    assert (config.multimax_attention, config.multimax_output) == (mm_attn, mm_out)
    assert max_diff(model, sd, images(), heads=3) <= 1e-5


def test_mixed_multimax_blocks_rejected() -> None:
    sd = make_state_dict(depth=3)
    for key in ("blocks.1.attn.ranges", "blocks.1.attn.ts"):
        del sd[key]
    with pytest.raises(CheckpointError, match=r"only in blocks \[0, 2\]; missing in blocks \[1\]"):
        adapt_checkpoint(sd, num_heads=3, ln_eps=1e-6)


def test_v2_detected_and_matches_reference() -> None:
    sd = make_state_dict(v2=True)
    model, config, _ = build_from_checkpoint(sd, num_heads=3, ln_eps=1e-6)
    assert config.variant == "v2"
    # V2: attention is t*x+b then first order; the output MultiMax is first order without t/b.
    assert max_diff(model, sd, images(), heads=3, order=1) <= 1e-5
    with pytest.raises(CheckpointError, match="V2"):
        adapt_checkpoint(sd, num_heads=3, ln_eps=1e-6, variant="second")
    with pytest.raises(CheckpointError, match="V2"):
        adapt_checkpoint(make_state_dict(), num_heads=3, ln_eps=1e-6, variant="v2")


def test_variants_differ_from_second_order() -> None:
    sd = make_state_dict()
    x = images()
    second, _, _ = build_from_checkpoint(sd, num_heads=3, ln_eps=1e-6)
    first, cfg_first, _ = build_from_checkpoint(sd, num_heads=3, ln_eps=1e-6, variant="first")
    assert cfg_first.variant == "first"
    v2_sd = dict(sd)
    for i in range(2):  # identity affine: V2 reduces to first order
        v2_sd[f"blocks.{i}.attn.t"] = torch.tensor(1.0)
        v2_sd[f"blocks.{i}.attn.b"] = torch.tensor(0.0)
    v2, _, _ = build_from_checkpoint(v2_sd, num_heads=3, ln_eps=1e-6)
    v2_scaled, _, _ = build_from_checkpoint(make_state_dict(v2=True), num_heads=3, ln_eps=1e-6)
    with torch.no_grad():
        y2, y1, yv2, yv2s = second(x), first(x), v2(x), v2_scaled(x)
    assert (y2 - y1).abs().max().item() > 1e-2
    assert (y2 - yv2).abs().max().item() > 1e-2
    assert (yv2 - y1).abs().max().item() <= 1e-6
    assert (yv2s - y1).abs().max().item() > 1e-2
    assert max_diff(first, sd, x, heads=3, order=1) <= 1e-5


# ---------------------------------------------------------------------------------------------
# Head count (and eps): flag > checkpoint args > preset of the same width


def test_heads_from_flag_beats_args() -> None:
    ckpt = training_checkpoint(make_state_dict(), {"num_heads": 3})
    config, _, info = adapt_checkpoint(ckpt, num_heads=4, ln_eps=1e-5)
    assert (config.num_heads, info["heads_from"], config.ln_eps) == (4, "flag", 1e-5)


@pytest.mark.parametrize(
    "args",
    [
        {"num_heads": 6},
        SimpleNamespace(num_heads=6, model="whatever"),
        argparse.Namespace(num_heads=6, lr=5e-4),
    ],
    ids=["dict", "simplenamespace", "argparse"],
)
def test_heads_from_args(args: object) -> None:
    config, _, info = adapt_checkpoint(training_checkpoint(make_state_dict(), args), ln_eps=1e-6)
    assert (config.num_heads, info["heads_from"], info["epoch"]) == (6, "args", 3)


def test_heads_from_args_model_name() -> None:
    sd = make_state_dict(embed=192, depth=12, img=32, patch=16, mm_out=False, lazy=True)
    config, _, info = adapt_checkpoint(training_checkpoint(sd, {"model": "deit_tiny_patch16_224"}))
    assert (config.num_heads, info["heads_from"], info["preset"]) == (3, "args", "deit_tiny")
    # A saved model name the weights contradict is not trusted; the weights' shape decides.
    config, _, info = adapt_checkpoint(training_checkpoint(sd, SimpleNamespace(model="deit_base_patch16_224")))
    assert (config.num_heads, info["heads_from"], info["preset"]) == (3, "preset", "deit_tiny")


def test_heads_from_preset_shape() -> None:
    sd = make_state_dict(embed=384, depth=12, img=32, patch=16, lazy=True)
    config, _, info = adapt_checkpoint(sd)
    assert (config.num_heads, config.ln_eps, info["heads_from"], info["preset"]) == (6, 1e-6, "preset", "deit_small")
    assert (info["ln_eps_from"], info["qk_scale_from"], config.qk_scale) == ("preset", "default", None)
    config, _, info = adapt_checkpoint(sd, preset="deit_small")
    assert (config.num_heads, info["heads_from"], info["preset"]) == (6, "flag", "deit_small")
    with pytest.raises(CheckpointError, match="192 wide"):
        adapt_checkpoint(sd, preset="deit_tiny")


def test_width_alone_is_not_a_preset() -> None:
    """384 wide but 6 deep: not deit_small, whose heads and eps would be a guess (issue 26)."""
    sd = make_state_dict(embed=384, depth=6, img=32, patch=16, lazy=True)
    with pytest.raises(CheckpointError, match=r"384-wide DeiT of depth 6.*deit_small is depth 12.*--num-heads"):
        adapt_checkpoint(sd)
    # Nor the MLP ratio: 768 wide, depth 12, ratio 3 is neither deit_base nor vit_small.
    with pytest.raises(CheckpointError, match=r"MLP ratio 3.*deit_base is depth 12, MLP ratio 4"):
        adapt_checkpoint(make_state_dict(embed=768, depth=12, hidden=2304, img=32, patch=16, lazy=True))
    with pytest.raises(CheckpointError, match=r"LayerNorm eps.*--ln-eps"):
        adapt_checkpoint(sd, num_heads=6)  # heads alone do not tell the eps
    config, _, info = adapt_checkpoint(sd, num_heads=8, ln_eps=1e-5)
    assert (config.num_heads, config.ln_eps, info["preset"]) == (8, 1e-5, None)
    config, _, info = adapt_checkpoint(sd, preset="deit_small")  # the user's word for a shallower deit_small
    assert (config.num_heads, config.ln_eps, config.depth) == (6, 1e-6, 6)
    # An explicit --preset beats the saved args; the args beat a preset only the shape names.
    ckpt = training_checkpoint(sd, {"num_heads": 4, "ln_eps": 1e-5})
    config, _, info = adapt_checkpoint(ckpt, preset="deit_small")
    assert (config.num_heads, config.ln_eps, info["heads_from"], info["ln_eps_from"]) == (6, 1e-6, "flag", "flag")
    config, _, info = adapt_checkpoint(training_checkpoint(make_state_dict(embed=384, depth=12, img=32, patch=16,
                                                                           lazy=True), {"num_heads": 4}))
    assert (config.num_heads, config.ln_eps, info["heads_from"], info["ln_eps_from"]) == (4, 1e-6, "args", "preset")


# timm 0.3's vit_small_patch16_224, as the official file defines it: 768 wide, depth 8, 8 heads, MLP ratio 3,
# no qkv bias, nn.LayerNorm (eps 1e-5); qk_scale 768**-0.5 only when built for timm's pretrained weights.
VIT_SMALL = dict(embed=768, depth=8, hidden=2304, img=224, patch=16, classes=1000, lazy=True)


def test_vit_small_is_not_deit_base() -> None:
    sd = make_state_dict(**VIT_SMALL)
    with pytest.raises(CheckpointError, match=r"attention scale of a vit_small_patch16_224.*0\.0360844.*--qk-scale"):
        adapt_checkpoint(sd)  # a raw state dict: timm's pretrained weights or a pretrained=False run
    config, _, info = adapt_checkpoint(sd, qk_scale=768**-0.5)
    assert (config.num_heads, config.ln_eps, config.mlp_ratio, config.qk_scale) == (8, 1e-5, 3.0, 768**-0.5)
    assert (info["preset"], info["heads_from"], info["ln_eps_from"], info["qk_scale_from"]) == (
        "vit_small_patch16_224", "preset", "preset", "flag")
    # DeiT's main.py builds every model with pretrained=False: head_dim**-0.5, known from the saved args.
    config, _, info = adapt_checkpoint(training_checkpoint(sd, {"model": "vit_small_patch16_224"}))
    assert (config.num_heads, config.ln_eps, config.qk_scale, info["heads_from"]) == (8, 1e-5, None, "args")
    # The same weights under deit_base's settings are what the loader used to build; a flag still can.
    config, _, _ = adapt_checkpoint(sd, num_heads=12, ln_eps=1e-6, qk_scale=96**-0.5)
    assert (config.num_heads, config.ln_eps) == (12, 1e-6)


@pytest.mark.parametrize(("name", "embed", "depth", "heads", "eps", "bias"), [
    ("vit_base_patch16_224", 768, 12, 12, 1e-6, True),  # deit_base's settings
    ("vit_large_patch16_224", 1024, 24, 16, 1e-6, True),
    ("vit_huge_patch16_224", 1280, 32, 16, 1e-5, False),
])
def test_official_vit_variants(name: str, embed: int, depth: int, heads: int, eps: float, bias: bool) -> None:
    sd = make_state_dict(embed=embed, depth=depth, img=224, patch=16, qkv_bias=bias, lazy=True)
    for obj in (sd, training_checkpoint(sd, {"model": name})):
        config, _, _ = adapt_checkpoint(obj)
        assert (config.num_heads, config.ln_eps, config.qk_scale, config.qkv_bias) == (heads, eps, None, bias)


def test_attention_scale_and_eps_reach_the_model() -> None:
    sd = make_state_dict()
    model, config, _ = build_from_checkpoint(sd, num_heads=3, ln_eps=1e-5, qk_scale=0.05)
    assert (config.qk_scale, config.ln_eps) == (0.05, 1e-5)
    x = images()
    assert max_diff(model, sd, x, heads=3, eps=1e-5, scale=0.05) <= 1e-5
    default, _, _ = build_from_checkpoint(sd, num_heads=3, ln_eps=1e-5)
    with torch.no_grad():
        assert (model(x) - default(x)).abs().max().item() > 1e-2  # the scale matters at these weights
    assert DeiTConfig.from_dict(config.to_dict()) == config and "qk_scale" not in default.config.to_dict()
    with pytest.raises(CheckpointError, match="qk_scale -1"):
        adapt_checkpoint(sd, num_heads=3, ln_eps=1e-6, qk_scale=-1)


def test_hybrid_refused_by_name() -> None:
    sd = make_state_dict()
    sd["patch_embed.backbone.conv1.weight"] = torch.zeros(8, 3, 7, 7)
    with pytest.raises(CheckpointError, match=r"hybrid ViT \(a ResNet backbone in patch_embed\.backbone.*not supp"):
        adapt_checkpoint(sd, num_heads=3, ln_eps=1e-6)


def test_deit_tiny_preset_round_trip() -> None:
    want = DeiTConfig.from_preset("deit_tiny")
    sd = DeiT(want).state_dict()
    config, _, info = adapt_checkpoint(sd)
    assert config == want
    assert (info["preset"], info["heads_from"], info["layout"]) == ("deit_tiny", "preset", "official-multimax")


def test_missing_heads_is_an_error() -> None:
    with pytest.raises(CheckpointError, match="num_heads"):
        adapt_checkpoint(training_checkpoint(make_state_dict(), {"model": "deit_custom"}))
    with pytest.raises(CheckpointError, match="does not divide"):
        adapt_checkpoint(make_state_dict(), num_heads=5, ln_eps=1e-6)


# ---------------------------------------------------------------------------------------------
# Errors name the key and the shapes


def test_missing_key() -> None:
    sd = make_state_dict()
    del sd["blocks.1.mlp.fc2.bias"]
    with pytest.raises(CheckpointError, match=r"missing key blocks\.1\.mlp\.fc2\.bias .*\(48,\)"):
        build_from_checkpoint(sd, num_heads=3, ln_eps=1e-6)


def test_unexpected_key() -> None:
    sd = make_state_dict()
    sd["blocks.0.attn.temperature"] = torch.ones(5)
    with pytest.raises(CheckpointError, match=r"unexpected key blocks\.0\.attn\.temperature with shape \(5,\)"):
        build_from_checkpoint(sd, num_heads=3, ln_eps=1e-6)


def test_wrong_shape() -> None:
    sd = make_state_dict()
    sd["blocks.1.attn.proj.weight"] = torch.zeros(48, 40)
    with pytest.raises(CheckpointError, match=r"blocks\.1\.attn\.proj\.weight has shape \(48, 40\).*\(48, 48\)"):
        build_from_checkpoint(sd, num_heads=3, ln_eps=1e-6)
    sd = make_state_dict()
    sd["ts"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match=r"key ts has shape \(2,\).*\(4,\)"):
        build_from_checkpoint(sd, num_heads=3, ln_eps=1e-6)


@pytest.mark.parametrize(
    "obj",
    [
        {"encoder.layer.0.weight": torch.zeros(2)},
        {"model": {"module.decoder.embed_tokens.weight": torch.zeros(2, 2)}, "epoch": 1},
        {},
        torch.zeros(3),
        [1, 2, 3],
    ],
    ids=["bert-like", "fairseq-like", "empty", "tensor", "list"],
)
def test_not_a_deit(obj: object) -> None:
    with pytest.raises(CheckpointError, match="not a DeiT"):
        adapt_checkpoint(obj, num_heads=3, ln_eps=1e-6)


def test_distilled_rejected() -> None:
    sd = make_state_dict(cls_token=True, mm_attn=False, mm_out=False)
    sd["dist_token"] = torch.zeros(1, 1, 48)
    with pytest.raises(CheckpointError, match=r"distilled DeiT .* not supported"):
        adapt_checkpoint(sd, num_heads=3, ln_eps=1e-6)


def test_orig_mod_prefix_stripped() -> None:
    sd = make_state_dict()
    ckpt = {"model": {"module._orig_mod." + k: v for k, v in sd.items()}, "epoch": 7}
    model, _, info = build_from_checkpoint(ckpt, num_heads=3, ln_eps=1e-6)
    assert info["epoch"] == 7
    _, clean, _ = adapt_checkpoint({"_orig_mod." + k: v for k, v in sd.items()}, num_heads=3, ln_eps=1e-6)
    assert clean.keys() == sd.keys()
    assert max_diff(model, sd, images(), heads=3) <= 1e-5


def test_model_ema() -> None:
    sd, ema = make_state_dict(seed=0), make_state_dict(seed=9)
    args = {"num_heads": 3, "ln_eps": 1e-6}
    ckpt = training_checkpoint(sd, args, model_ema={"module." + k: v for k, v in ema.items()})
    x = images()
    model, _, info = build_from_checkpoint(ckpt, use_ema=True)
    assert info["source_keys"] == "model_ema"
    assert max_diff(model, ema, x, heads=3) <= 1e-5
    _, _, info = build_from_checkpoint(ckpt)
    assert info["source_keys"] == "model"
    with pytest.raises(CheckpointError, match="model_ema"):
        adapt_checkpoint(training_checkpoint(sd, {"num_heads": 3, "ln_eps": 1e-6}), use_ema=True)


# ---------------------------------------------------------------------------------------------
# Config and model basics


def test_config_presets_and_dicts() -> None:
    small = DeiTConfig.from_preset("deit_small", num_classes=100)
    assert (small.embed_dim, small.num_heads, small.depth, small.num_classes) == (384, 6, 12, 100)
    assert small.num_patches == 196 and small.head_dim == 64
    assert DeiTConfig.from_dict(small.to_dict()) == small
    assert {name: DEIT_PRESETS[name]["num_heads"] for name in DEIT_PRESETS} == {
        "deit_tiny": 3,
        "deit_small": 6,
        "deit_base": 12,
        "vit_small_patch16_224": 8,
        "vit_large_patch16_224": 16,
        "vit_huge_patch16_224": 16,
    }
    with pytest.raises(ValueError, match="deit_tiny, deit_small, deit_base"):
        DeiTConfig.from_preset("deit_huge")
    with pytest.raises(ValueError, match="heads, qkv"):
        DeiTConfig.from_dict({**small.to_dict(), "heads": 6, "qkv": 1})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_heads=5), "divisible"),
        (dict(img_size=30), "multiple"),
        (dict(pool="cls"), "pool"),
        (dict(variant="third"), "variant"),
    ],
)
def test_config_validation(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeiTConfig(**{**SMALL, **overrides})


def test_init_and_image_size_check() -> None:
    model = DeiT(DeiTConfig(**SMALL, pool="token", qkv_bias=True))
    assert torch.all(model.blocks[0].attn.qkv.bias == 0) and torch.all(model.head.bias == 0)
    assert torch.all(model.blocks[1].norm2.weight == 1) and torch.all(model.norm.bias == 0)
    assert 0.015 < model.blocks[0].mlp.fc1.weight.std().item() < 0.025
    assert model.cls_token.shape == (1, 1, 48) and model.pos_embed.shape == (1, 17, 48)
    with pytest.raises(ValueError, match="32x32"):
        model(images(1, size=24))


def test_set_paper_params() -> None:
    model = set_paper_params(DeiT(DeiTConfig(**SMALL)))
    for i, block in enumerate(model.blocks):
        ranges, ts = paper_params(i)
        assert torch.allclose(block.attn.ranges, torch.tensor(ranges))
        assert torch.allclose(block.attn.ts, torch.tensor(ts))
    ranges, ts = paper_row_to_params(PAPER_TABLE_7[-1])
    assert torch.allclose(model.ranges, torch.tensor(ranges)) and torch.allclose(model.ts, torch.tensor(ts))
