"""Hugging Face folders that are incomplete, inconsistent or unsupported: `python -m models info` describes a good
one, and each bad one is exit 2 with one line naming the file and the reason; MultiMax tensors are never dropped."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from models.cli import main  # noqa: E402
from models.hf_folder import load_folder  # noqa: E402
from tests.paths import ROOT  # noqa: E402


def run_info(folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["info", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def copy_of(hf_folders: dict[str, Path], arch: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(hf_folders[arch], tmp_path / arch))


def edit_config(folder: Path, **changes: Any) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | changes))


def edit_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_info_describes_folder(hf_folders: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(hf_folders["llama"])]) == 0
    out = capsys.readouterr().out
    for needle in ("LlamaForCausalLM (model_type llama)", "kv_heads 2", "llama3 (theta 10000, factor 4",
                   "SegLU on lm_head (ranges [0.1752, 0.05374, -0.1327, -0.08826]", "attention layer 1",
                   "300 tokens", "chat template yes", "256 tokens"):
        assert needle in out, (needle, out)
    assert main(["info", str(hf_folders["qwen2"]), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["architecture"] == "Qwen2ForCausalLM" and d["multimax"]["config_modules"] == ["lm_head"]
    assert d["options"]["tied_embeddings"] and d["tokenizer"]["eos_ids"] == [1]


def test_readme_info_block_is_what_info_prints(hf_folders: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """README's `python -m models info tiny-qwen3` block (not run by tests/project/test_readme.py: it needs a folder
    that only transformers makes) is this fixture's output, line for line."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("$ python -m models info tiny-qwen3\n", 1)[1].split("\n$ ", 1)[0].splitlines()
    folder = Path(shutil.copytree(hf_folders["qwen3"], tmp_path / "tiny-qwen3"))
    assert main(["info", str(folder)]) == 0
    assert capsys.readouterr().out.splitlines() == block
    (folder / "tokenizer.json").unlink()
    err = run_info(folder, capsys)
    assert err.replace(str(tmp_path) + "/", "") in readme


def test_missing_tokenizer(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen3", tmp_path)
    (folder / "tokenizer.json").unlink()
    assert "tokenizer.json: no such file" in run_info(folder, capsys)


def last_shard(folder: Path) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / sorted(set(index["weight_map"].values()))[-1]


def test_bad_tokenizer_and_generation_config(hf_folders: dict, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen3", tmp_path)
    (folder / "generation_config.json").write_text("{not json")
    assert "generation_config.json: not valid JSON" in run_info(folder, capsys)
    (folder / "generation_config.json").unlink()
    (folder / "tokenizer.json").write_text('{"model": 3}')
    assert "tokenizer.json: not a tokenizers file" in run_info(folder, capsys)


def test_entry_point_exit_code(hf_folders: dict, tmp_path: Path) -> None:
    """The real command: exit code 2 and one line on stderr, no traceback."""
    import subprocess
    import sys

    folder = copy_of(hf_folders, "llama", tmp_path)
    edit_config(folder, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    root = ROOT
    proc = subprocess.run([sys.executable, "-m", "models", "info", str(folder)], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: {folder}/config.json: unsupported rope_scaling type 'longrope' "
                                   "(supported: default, linear, llama3, yarn)")


def test_truncated_shard(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen2", tmp_path)
    shard = last_shard(folder)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    err = run_info(folder, capsys)
    assert f"{shard}: truncated or corrupt safetensors file" in err


def test_index_names_missing_shard(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen2", tmp_path)
    shard = last_shard(folder)
    shard.unlink()
    err = run_info(folder, capsys)
    assert f"model.safetensors.index.json: names shard {shard.name} which does not exist" in err


def test_config_does_not_match_tensors(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "llama", tmp_path)
    edit_config(folder, intermediate_size=96)
    err = run_info(folder, capsys)
    assert "model.safetensors: tensor model.layers.0.mlp.down_proj.weight has shape (64, 128)" in err
    assert "config.json implies (64, 96)" in err


def test_unknown_model_type(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "llama", tmp_path)
    edit_config(folder, model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    err = run_info(folder, capsys)
    assert "config.json: unsupported model_type 'gemma2'" in err
    assert "llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM)" in err


def test_unsupported_rope_type(hf_folders: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "llama", tmp_path)
    edit_config(folder, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    err = run_info(folder, capsys)
    assert "config.json: unsupported rope_scaling type 'dynamic' (supported: default, linear, llama3, yarn)" in err


def test_old_style_rope_scaling_is_read(hf_folders: dict, tmp_path: Path, loaded: dict) -> None:
    """transformers 4 wrote rope_theta and rope_scaling {"type": ...}: the same model."""
    folder = copy_of(hf_folders, "llama", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    theta = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    (folder / "config.json").write_text(json.dumps(cfg | {"rope_theta": theta, "rope_scaling": params}))
    model, _ = load_folder(folder)
    ids = torch.randint(0, 299, (1, 30))
    assert torch.equal(model(ids)[0], loaded["llama"][0](ids)[0])


@pytest.mark.parametrize("case, needle", [
    ("missing_ts", "missing tensor lm_head.multimax_ts (config.json implies shape (4,))"),
    ("wide_ranges", "tensor lm_head.multimax_ranges has shape (8,), config.json implies (4,)"),
    ("unexpected", "unexpected tensor model.layers.0.self_attn.extra_bias with shape (3,)"),
    ("layer_beyond", "unexpected tensor model.layers.2.self_attn.multimax_ranges with shape (4,)"),
    ("modules_disagree", "tensor model.layers.0.self_attn.multimax_ranges present but config.json's multimax_modules"),
    ("modules_name_missing", "missing tensor lm_head.multimax_ranges (shape (4,)) that config.json's multimax_modules"),
    ("modules_unknown", "multimax_modules ['lm_head', 'experts'] names an unsupported place"),
    ("untied_lm_head", "lm_head.weight differs from model.embed_tokens.weight but config.json says"),
])
def test_multimax_tensors_are_never_dropped(case: str, needle: str, hf_folders: dict, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "llama", tmp_path)
    if case == "missing_ts":
        edit_tensors(folder, lambda t: t.pop("lm_head.multimax_ts"))
    elif case == "wide_ranges":
        edit_tensors(folder, lambda t: t.update({"lm_head.multimax_ranges": torch.zeros(8)}))
    elif case == "unexpected":
        edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.extra_bias": torch.zeros(3)}))
    elif case == "layer_beyond":
        edit_tensors(folder, lambda t: t.update({f"model.layers.2.self_attn.multimax_{n}": torch.zeros(4)
                                                 for n in ("ranges", "ts")}))
    elif case == "modules_disagree":
        edit_config(folder, multimax_modules=["lm_head"])
    elif case == "modules_name_missing":
        edit_tensors(folder, lambda t: [t.pop(f"lm_head.multimax_{n}") for n in ("ranges", "ts")])
    elif case == "modules_unknown":
        edit_config(folder, multimax_modules=["lm_head", "experts"])
    elif case == "untied_lm_head":
        edit_config(folder, tie_word_embeddings=True)
    assert needle in run_info(folder, capsys)


def test_unsupported_options_are_refused(hf_folders: dict, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_of(hf_folders, "qwen2", tmp_path)
    edit_config(folder, use_sliding_window=True)
    assert "unsupported sliding-window attention" in run_info(folder, capsys)
    edit_config(folder, use_sliding_window=False, hidden_act="gelu")
    assert "unsupported hidden_act 'gelu' (supported: silu)" in run_info(folder, capsys)
    edit_config(folder, hidden_act="silu", architectures=["Qwen2ForSequenceClassification"])
    assert "is not ['Qwen2ForCausalLM']" in run_info(folder, capsys)
    edit_config(folder, architectures=["Qwen2ForCausalLM"], quantization_config={"quant_method": "gptq"})
    assert "unsupported quantization_config (gptq;" in run_info(folder, capsys)
    edit_config(folder, quantization_config=None,
                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6, "short_factor": [1.0]})
    assert "unsupported linear RoPE parameter(s) short_factor (supported: factor, partial_rotary_factor)" in run_info(
        folder, capsys)
