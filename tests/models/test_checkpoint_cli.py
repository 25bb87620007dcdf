"""Checkpoint format, safe loading and the `python -m models` command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import checkpoint as ckpt_io
from models.cli import main
from models.deit import DeiT, DeiTConfig
from models.loading import CheckpointError
from models.multimax import paper_params
from tests.paths import ROOT


def run_cli(*args: str, module: str = "models") -> subprocess.CompletedProcess[str]:
    """The real entry point in a subprocess: exit code, stdout and stderr as a user sees them."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def assert_clean_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]


def small_deit_config(**overrides) -> DeiTConfig:
    fields = dict(img_size=32, patch_size=8, in_chans=3, num_classes=5, embed_dim=48, depth=2, num_heads=3)
    return DeiTConfig(**(fields | overrides))


def official_training_checkpoint(path: Path) -> Path:
    """A DeiT training checkpoint in the official MultiMax layout (DDP prefixes, args)."""
    torch.manual_seed(0)
    model = DeiT(small_deit_config())
    sd = {f"module.{k}": v for k, v in model.state_dict().items()}
    torch.save({"model": sd, "optimizer": {}, "epoch": 7, "args": {"model": "custom", "num_heads": 3}}, path)
    return path


# --- format and safe loading ----------------------------------------------------------------------


def test_save_is_atomic_and_round_trips(tmp_path: Path) -> None:
    model = DeiT(small_deit_config())
    ckpt = ckpt_io.Checkpoint("deit", model.config.to_dict(), model.state_dict(), labels=list("abcde"))
    out = ckpt_io.save_checkpoint(ckpt, tmp_path / "m.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]  # no temp file left behind
    raw = torch.load(out, weights_only=True)
    assert raw["format"] == "multimax/1" and raw["arch"] == "deit" and raw["labels"] == list("abcde")
    loaded, back, info = ckpt_io.load(out)
    assert back.labels == list("abcde")
    assert info["format"] == "multimax/1"
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded(x), model.eval()(x))


def test_save_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = DeiT(small_deit_config())
    ckpt = ckpt_io.Checkpoint("deit", model.config.to_dict(), model.state_dict())
    target = tmp_path / "m.pt"
    target.write_bytes(b"previous version")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(CheckpointError, match="disk full"):  # one clear line for the CLI, not a traceback
        ckpt_io.save_checkpoint(ckpt, target)
    assert target.read_bytes() == b"previous version"
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt"]
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt_io.save_checkpoint(ckpt, tmp_path / "nope" / "m.pt")


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-pickle",))


def test_bad_files_give_one_line_and_exit_2(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a checkpoint\n")
    good = official_training_checkpoint(tmp_path / "good.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    evil = tmp_path / "evil.pt"
    torch.save({"model": RunsCode()}, evil)
    unknown_arch = tmp_path / "arch.pt"
    torch.save({"format": "multimax/1", "arch": "resnet", "config": {}, "state_dict": {}}, unknown_arch)
    future = tmp_path / "future.pt"
    torch.save({"format": "multimax/9", "arch": "deit", "config": {}, "state_dict": {}}, future)
    not_a_model = tmp_path / "tensors.pt"
    torch.save({"weight": torch.zeros(3)}, not_a_model)

    assert_clean_error(run_cli("info", str(tmp_path / "missing.pt")), "no such file")
    assert_clean_error(run_cli("info", str(tmp_path)), "directory")
    assert_clean_error(run_cli("info", str(text)), "not a PyTorch checkpoint")
    assert_clean_error(run_cli("info", str(ROOT / "README.md")), "not a PyTorch checkpoint")
    assert_clean_error(run_cli("info", str(truncated)), "truncated or corrupt")
    proc = run_cli("info", str(evil))
    assert_clean_error(proc, "refused", "system")
    assert not (ROOT / "pwned-by-pickle").exists()
    assert_clean_error(run_cli("info", str(unknown_arch)), "unknown architecture 'resnet'")
    assert_clean_error(run_cli("info", str(future)), "unsupported format")
    assert_clean_error(run_cli("info", str(not_a_model)), "unknown checkpoint layout")


def test_mis_shaped_own_checkpoint_names_key_and_shapes(tmp_path: Path) -> None:
    model = DeiT(small_deit_config())
    sd = model.state_dict()
    sd["head.weight"] = torch.zeros(7, 48)
    ckpt_io.save_checkpoint(ckpt_io.Checkpoint("deit", model.config.to_dict(), sd), tmp_path / "bad.pt")
    assert_clean_error(run_cli("info", str(tmp_path / "bad.pt")), "head.weight", "(7, 48)", "(5, 48)")


# --- info / init / plot-sigma ----------------------------------------------------------------------


def test_info_on_official_training_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = official_training_checkpoint(tmp_path / "official.pt")
    # The args name no known model: heads come from them, the LayerNorm eps must be given (issue 26).
    assert main(["info", str(path)]) == 2
    assert "cannot tell the LayerNorm eps" in capsys.readouterr().err
    assert main(["info", str(path), "--json", "--ln-eps", "1e-6"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "official-multimax"
    assert d["architecture"] == "deit"
    assert d["sizes"]["embed_dim"] == 48 and d["sizes"]["depth"] == 2 and d["sizes"]["num_heads"] == 3
    assert d["sizes"]["image_size"] == 32 and d["sizes"]["patch_size"] == 8 and d["sizes"]["num_classes"] == 5
    assert d["sizes"]["qkv_bias"] is False and d["sizes"]["pool"] == "avg"
    assert d["multimax"] == {"attention_layers": 2, "total_layers": 2, "output": True, "variant": "second"}
    assert d["parameters"] == sum(p.numel() for p in DeiT(small_deit_config()).parameters())
    assert main(["info", str(path), "--ln-eps", "1e-6"]) == 0
    text = capsys.readouterr().out
    assert "attention in 2/2 layers + output layer (second order)" in text


def test_init_paper_params_and_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.pt"
    assert main(["init", "deit_tiny", "--params", "paper", "-o", str(out)]) == 0
    raw = torch.load(out, weights_only=True)
    ranges, ts = paper_params(4)
    torch.testing.assert_close(raw["state_dict"]["blocks.4.attn.ranges"], torch.tensor(ranges))
    torch.testing.assert_close(raw["state_dict"]["blocks.4.attn.ts"], torch.tensor(ts))
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["preset"] == "deit_tiny" and d["multimax"]["attention_layers"] == 12
    assert 5.5e6 < d["parameters"] < 6.0e6  # DeiT-tiny is 5.7M

    out_gpt = tmp_path / "nano.pt"
    assert main(["init", "gpt-nano", "--multimax", "attention", "--params", "random", "-o", str(out_gpt)]) == 0
    capsys.readouterr()
    assert main(["info", str(out_gpt), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["architecture"] == "gpt" and d["preset"] == "gpt-nano"
    assert d["multimax"]["output"] is False and d["multimax"]["attention_layers"] == d["multimax"]["total_layers"]
    assert d["tokenizer"]["type"] == "byte"


def test_init_rejects_unknown_preset_and_places(tmp_path: Path) -> None:
    assert_clean_error(run_cli("init", "resnet50", "-o", str(tmp_path / "x.pt")), "unknown preset")
    proc = run_cli("init", "deit_tiny", "--multimax", "ffn", "-o", str(tmp_path / "x.pt"))
    assert proc.returncode == 2 and "unknown MultiMax place" in proc.stderr
    assert not (tmp_path / "x.pt").exists()


def test_plot_sigma(tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny.pt"
    assert main(["init", "deit_tiny", "-o", str(ckpt)]) == 0
    png = tmp_path / "sigma.png"
    proc = run_cli("plot-sigma", str(ckpt), "-o", str(png), module="models.training")
    assert proc.returncode == 0, proc.stderr
    assert "13 panels" in proc.stdout  # 12 attention layers and the output layer
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    softmax = tmp_path / "softmax.pt"
    assert main(["init", "deit_tiny", "--multimax", "none", "-o", str(softmax)]) == 0
    proc = run_cli("plot-sigma", str(softmax), "-o", str(tmp_path / "s.png"), module="models.training")
    assert_clean_error(proc, "no MultiMax")
    assert not (tmp_path / "s.png").exists()


def test_readme_info_sample_is_the_real_output(capsys: pytest.CaptureFixture[str]) -> None:
    """tests/project/test_readme.py accepts a sample that leaves lines out; this one must be the command's output
    exactly."""
    command = "$ python -m models info models/demo/digits_multimax.pt"
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(command) + 1
    sample = lines[start:lines.index("```", start)]
    assert main(["info", str(ROOT / "models/demo/digits_multimax.pt")]) == 0
    assert capsys.readouterr().out.splitlines() == sample


def test_load_flags_on_an_own_checkpoint_are_refused_not_ignored(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model = DeiT(small_deit_config())
    path = ckpt_io.save_checkpoint(ckpt_io.Checkpoint("deit", model.config.to_dict(), model.state_dict()),
                                   tmp_path / "own.pt")
    assert main(["info", str(path), "--num-heads", "4", "--ema"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {path}: --num-heads, --ema apply to foreign checkpoints (official / timm DeiT); this file "
                   "is in the project's format and stores its config")
    assert main(["info", str(path)]) == 0
    assert "labels        none stored (served with class indices as names" in capsys.readouterr().out
