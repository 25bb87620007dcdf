"""The reweighting functions as the attention step of DeiT and GPT: config, checkpoints, padding, KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.checkpoint import load, read_file
from models.cli import main
from models.deit import DeiT, DeiTConfig
from models.demo import DEMO_DIR, DEMO_FILES
from models.generate import left_pad
from models.gpt import GPT, GPTConfig, KVCache
from models.reweighting import OTHER_FUNCTIONS

OPTIONS = {"topk_softmax": {"k": 3}, "length_scaled": {"eps": 0.2, "m": 0.0}}


def gpt(name: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("gpt-nano", attention_function=name, attention_options=OPTIONS.get(name)))
    with torch.no_grad():
        for block in model.block_list():
            if block.attn.reweight is not None and block.attn.reweight.spec.params:
                block.attn.reweight.offset.copy_(torch.tensor([0.2, -0.3]))
                block.attn.reweight.log_scale.copy_(torch.tensor([-0.4, 0.3]))
    return model.eval()


@pytest.mark.parametrize("name", OTHER_FUNCTIONS)
def test_gpt_left_padding_and_kv_cache_change_nothing(name: str) -> None:
    """Padding is masked, so it changes no real token's logits (length-scaled: l counts unmasked keys only), and
    a cached decode step equals the full forward."""
    model = gpt(name)
    prompts = [[84, 104, 101], [65, 32, 108, 111, 110, 103, 101, 114], [88]]
    ids, mask = left_pad(prompts, pad_id=0)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)[0]
        for row, p in enumerate(prompts):
            alone = model(torch.tensor([p]))[0][0]
            torch.testing.assert_close(padded[row, -len(p) :], alone, atol=1e-5, rtol=0)
        seq = torch.tensor([prompts[1]])
        _, past = model(seq[:, :5], past_key_values=KVCache.empty(model.config, 1).layers)
        step, _ = model(seq[:, 5:6], past_key_values=past)
        torch.testing.assert_close(step[0, -1], model(seq[:, :6])[0][0, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", OTHER_FUNCTIONS)
def test_deit_trains_with_finite_gradients_and_keeps_its_state_dict_names(name: str) -> None:
    torch.manual_seed(0)
    config = DeiTConfig(img_size=16, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2, num_heads=2,
                        attention_function=name, attention_options=OPTIONS.get(name))
    model = DeiT(config)
    model(torch.randn(3, 1, 16, 16)).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    extra = {k for k in model.state_dict() if "reweight" in k}
    if name in ("gaussian", "laplacian"):
        assert extra == {f"blocks.{i}.attn.reweight.{p}" for i in range(2) for p in ("offset", "log_scale")}
    else:
        assert not extra
    assert not any(k.endswith("attn.ranges") for k in model.state_dict())  # no MultiMax in attention


def test_config_fields_are_canonical_and_checked() -> None:
    plain = DeiTConfig()
    assert "attention_function" not in plain.to_dict() and "attention_options" not in plain.to_dict()
    assert DeiTConfig(attention_function="softmax").to_dict() == DeiTConfig(multimax_attention=False).to_dict()
    assert DeiTConfig(multimax_attention=False, attention_function="multimax").to_dict() == plain.to_dict()
    topk = GPTConfig(attention_function="topk_softmax")
    assert topk.to_dict()["attention_options"] == {"k": 8} and not topk.multimax_attention
    assert GPTConfig.from_dict(topk.to_dict()) == topk
    with pytest.raises(ValueError, match="unknown attention function 'softmaxx'"):
        DeiTConfig(attention_function="softmaxx")
    with pytest.raises(ValueError, match="unknown option"):
        GPTConfig(attention_function="sparsemax", attention_options={"k": 2})
    with pytest.raises(ValueError, match="takes none"):
        GPTConfig(attention_options={"k": 2})


@pytest.mark.parametrize("name", DEMO_FILES)
def test_shipped_checkpoints_read_and_write_their_config_unchanged(name: str) -> None:
    model, _, _ = load(DEMO_DIR / name)
    assert model.config.to_dict() == read_file(DEMO_DIR / name)["config"]  # type: ignore[union-attr]


def test_models_init_with_a_function_and_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.pt"
    assert main(["init", "gpt-nano", "--multimax", "none", "--attention-function", "length_scaled",
                 "--attention-option", "eps=0.05", "-o", str(out)]) == 0
    assert "no MultiMax, attention length_scaled" in capsys.readouterr().out
    _, ckpt, _ = load(out)
    assert ckpt.config["attention_options"] == {"eps": 0.05, "m": 0.0}
    assert main(["info", str(out)]) == 0
    assert "attention     length_scaled (eps=0.05, m=0)" in capsys.readouterr().out
    for args, message in [
        (["--attention-option", "k=2"], "--attention-option needs --attention-function"),
        (["--attention-function", "sparsemax", "--attention-option", "k=2"], "unknown option(s) k for sparsemax"),
        (["--attention-function", "topk_softmax", "--attention-option", "k=0"], "k >= 1"),
    ]:
        assert main(["init", "gpt-nano", *args, "-o", str(tmp_path / "bad.pt")]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["init", "gpt-nano", "--attention-option", "k", "-o", str(tmp_path / "bad.pt")])
    assert exc.value.code == 2 and "expected KEY=NUMBER" in capsys.readouterr().err
    assert not (tmp_path / "bad.pt").exists()
