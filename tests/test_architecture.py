"""The architecture's promises: the ONNX contract loads without torch, the architecture registry answers for every
architecture, and the product packages hold no import circles or upward imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from models import onnx_contract as contract
from models import registry

ROOT = Path(__file__).resolve().parents[1]


def test_contract_imports_no_torch() -> None:
    code = "import sys, models.onnx_contract; print(sorted(m for m in ('torch', 'onnx') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_contract_names_and_metadata_round_trip() -> None:
    inputs, outputs = contract.text_io_names(2)
    assert inputs == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                      "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    assert outputs == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    meta = contract.OnnxMetadata(arch="gpt", config={"n_layer": 2}, tokenizer={"kind": "bytes"}, precision="fp16")
    props = meta.encode()
    assert props == {"multimax.arch": '"gpt"', "multimax.config": '{"n_layer": 2}', "multimax.precision": '"fp16"',
                     "multimax.tokenizer": '{"kind": "bytes"}'}
    assert contract.read_metadata(props) == meta
    assert contract.read_metadata([("multimax.arch", "deit"), ("other", "x")]).arch == "deit"  # not JSON: kept
    with pytest.raises(ValueError, match="config"):
        contract.read_metadata({"multimax.config": json.dumps([1, 2])})
    with pytest.raises(KeyError, match="unknown multimax metadata field"):
        contract.meta_key("labelz")


def test_registry_answers_for_every_architecture() -> None:
    assert registry.names() == ("deit", "gpt", "llama", "fairseq_lm")
    assert {a: registry.task_of(a) for a in registry.names()} == {"deit": "vision", "gpt": "text", "llama": "text",
                                                                "fairseq_lm": "text"}
    arch = registry.for_preset("gpt-nano")
    assert arch is not None and arch.name == "gpt"
    model = arch.model(arch.preset_config("gpt-nano"))
    assert isinstance(model, arch.model_cls)
    assert registry.for_preset("resnet50") is None
    with pytest.raises(KeyError, match="known: deit, gpt, llama, fairseq_lm"):
        registry.get("resnet")
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.get("deit"))


PRODUCT = ("models", "export", "plugins", "service")
# lower layers first: a module may import its own package and the ones before it, never a later one
LAYERS = {"models": 0, "plugins": 1, "export": 2, "service": 2}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def _modules() -> dict[str, Path]:
    out = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.startswith("bench") or "loadtest" in path.parts:
                continue  # tools, on their way out of the product packages (issue 11: benchmarks/)
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = path
    return out


def test_no_upward_imports() -> None:
    bad = []
    for name, path in _modules().items():
        here = LAYERS[name.split(".")[0]]
        for imported in _imports(path):
            top = imported.split(".")[0]
            if top in LAYERS and top != name.split(".")[0] and LAYERS[top] >= here:
                bad.append(f"{name} imports {imported}")
    assert not bad


def test_no_import_circles() -> None:
    modules = _modules()
    # (a package naming itself, `from service.ray import x` in its __init__, is no circle)
    graph = {name: {i for i in _imports(path) if i in modules and i != name} for name, path in modules.items()}
    circles = set()

    def walk(node: str, stack: list[str]) -> None:
        for nxt in graph[node]:
            if nxt in stack:
                circles.add(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif len(stack) < 12:
                walk(nxt, [*stack, nxt])

    for start in graph:
        walk(start, [start])
    assert not circles
