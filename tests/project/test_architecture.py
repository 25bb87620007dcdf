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
from models import registry, spec
from tests.paths import ROOT


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


# ---- the model description: nothing outside models/ reads an architecture's own config ---------------------------

# The reweighting keys every architecture's config shares with the ONNX contract (read through
# models.onnx_contract's helpers), so reading them names no architecture.
CONTRACT_KEYS = {"attention_function", "attention_options", "output_function", "multimax_attention",
                 "multimax_output", "variant"}
CONCRETE = ("models.deit", "models.gpt", "models.llama", "models.fairseq_lm")
# Modules allowed to know one architecture, and why: none (the onnxruntime-genai folder export traces each model's
# own forward through its attention hook, models.attention_hook, and reads sizes from the description).
KNOWS_AN_ARCHITECTURE: set[str] = set()


def _concrete_classes() -> tuple[set[str], set[str]]:
    """(config field names no contract shares, class names) of the registered architectures."""
    import dataclasses

    fields: set[str] = set()
    classes = {"KVCache"}
    for name in registry.names():
        arch = registry.get(name)
        fields |= {f.name for f in dataclasses.fields(arch.config_cls)}
        fields |= {n for n, v in vars(arch.config_cls).items() if isinstance(v, property)}
        classes |= {arch.config_cls.__name__, arch.model_cls.__name__}
    return fields - CONTRACT_KEYS, classes


def _config_like(node: ast.expr) -> bool:
    """`config`, `cfg`, or anything's `.config` (a model's, a checkpoint's, an entry's, a file's metadata's)."""
    return (isinstance(node, ast.Name) and node.id in ("config", "cfg")) or (
        isinstance(node, ast.Attribute) and node.attr == "config")


def architecture_reads(source: str, fields: set[str], classes: set[str]) -> list[str]:
    """Where a module reads a concrete architecture's config field, imports its classes or checks a model's class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and node.attr in fields and _config_like(node.value):
            found.append(f"{line}: reads config field {node.attr}")
        elif (isinstance(node, ast.Subscript) and _config_like(node.value) and isinstance(node.slice, ast.Constant)
              and node.slice.value in fields):
            found.append(f"{line}: reads config[{node.slice.value!r}]")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and _config_like(node.func.value) and node.args and isinstance(node.args[0], ast.Constant)
              and node.args[0].value in fields):
            found.append(f"{line}: reads config.get({node.args[0].value!r})")
        elif isinstance(node, ast.ImportFrom) and node.module in CONCRETE:
            found.append(f"{line}: imports {', '.join(a.name for a in node.names)} from {node.module}")
        elif isinstance(node, ast.Import) and any(a.name in CONCRETE for a in node.names):
            found.append(f"{line}: imports an architecture's module")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
              and len(node.args) == 2):
            names = {n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
                     for n in ast.walk(node.args[1])}
            if names & classes:
                found.append(f"{line}: isinstance against {', '.join(sorted(names & classes))}")
    return found


def test_the_scan_catches_a_planted_violation_and_passes_neutral_code() -> None:
    fields, classes = _concrete_classes()
    planted = (
        "from models.gpt import GPTConfig, KVCache\n"
        "import models.deit\n"
        "n = model.config.n_layer\n"
        "h = cfg.n_head\n"
        "size = entry.config['img_size']\n"
        "ctx = meta.config.get('block_size', 1)\n"
        "ok = isinstance(model, (registry.TextModel, DeiT))\n"
    )
    assert len(architecture_reads(planted, fields, classes)) == 7
    neutral = (
        "from models.spec import TextSpec\n"
        "n = spec.layers; s = self.image_size; d = x.dim(); h = args.num_heads\n"
        "f = entry.config.get('output_function'); v = config['variant']\n"
        "ok = isinstance(spec, TextSpec)\n"
    )
    assert architecture_reads(neutral, fields, classes) == []


def test_no_module_outside_models_reads_an_architectures_config() -> None:
    fields, classes = _concrete_classes()
    assert {"n_head", "n_layer", "block_size", "img_size", "in_chans", "num_classes", "n_local_heads",
            "head_dim"} <= fields
    bad = []
    for package in ("export", "service", "plugins"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in KNOWS_AN_ARCHITECTURE:
                continue
            bad += [f"{rel}:{hit}" for hit in architecture_reads(path.read_text(), fields, classes)]
    assert not bad


def _legacy_metadata(ckpt_arch: str, config: dict, **fields: object) -> contract.OnnxMetadata:
    """The metadata an export wrote before the spec key: the same fields, no `spec`."""
    return contract.read_metadata(contract.OnnxMetadata(arch=ckpt_arch, config=config, **fields).encode())  # type: ignore[arg-type]


def test_the_spec_round_trips_and_older_files_read_to_the_same_spec() -> None:
    from models.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer().to_dict()
    config = registry.get("gpt").preset_config("gpt-nano").to_dict()
    new = registry.spec_of("gpt", config, tokenizer=tokenizer)
    assert isinstance(new, spec.TextSpec)
    assert (new.kv_heads, new.head_size, new.vocab_size, new.context_length) == ((2, 2), 32, 259, 128)
    assert (new.bos_id, new.eos_id, new.pad_id, new.tokenizer_kind) == (256, 257, 258, "byte")
    assert new.reweighting.attention == "multimax" and new.reweighting.attention_layers == (0, 1)
    written = contract.read_metadata(contract.OnnxMetadata(arch="gpt", config=config, tokenizer=tokenizer,
                                                           spec=new.to_dict()).encode())
    assert registry.read_spec(written) == new
    assert registry.read_spec(_legacy_metadata("gpt", config, tokenizer=tokenizer)) == new  # compatibility reader

    vision_config = registry.get("deit").config({"img_size": 32, "patch_size": 8, "in_chans": 1, "num_classes": 10,
                                                 "embed_dim": 16, "depth": 2, "num_heads": 2}).to_dict()
    old = registry.read_spec(_legacy_metadata("deit", vision_config, labels=list("abcdefghij")))
    assert isinstance(old, spec.VisionSpec) and (old.channels, old.image_size, old.classes) == (1, 32, 10)
    assert old.labels == tuple("abcdefghij") and old.tokens == 16
    llama = registry.spec_of("llama", registry.get("llama").preset_config("qwen3-tiny").to_dict())
    assert isinstance(llama, spec.TextSpec) and llama.kv_heads == (2, 2) and llama.head_size == 32

    with pytest.raises(ValueError, match="version"):
        registry.read_spec(contract.OnnxMetadata(arch="gpt", spec={**new.to_dict(), "version": 99}))
    with pytest.raises(ValueError, match="kv_heads"):
        registry.read_spec(contract.OnnxMetadata(spec={**new.to_dict(), "kv_heads": [2, 0]}))
    with pytest.raises(ValueError, match="not registered"):
        registry.read_spec(contract.OnnxMetadata(arch="resnet", config={}))


def test_the_shipped_demo_files_predate_the_spec_and_serve_through_the_compatibility_reader() -> None:
    import onnx

    from models.demo import DEMO_DIR

    proto = onnx.load(str(DEMO_DIR / "text_multimax.onnx"), load_external_data=False)
    meta = contract.read_metadata(contract.proto_props(proto))
    if meta.spec is not None:
        pytest.skip("the demos were re-exported with the spec key")
    text = registry.read_spec(meta)
    assert isinstance(text, spec.TextSpec)
    past = {i.name: [d.dim_value or None for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    assert len([n for n in past if n.startswith(contract.PAST_PREFIX)]) == 2 * text.layers
    assert past[contract.past_names(1)[0][0]][1:4:2] == [text.kv_heads[0], text.head_size]


# ---- the task table: one row per task, each layer's part keyed by it -----------------------------------------------


def test_every_task_has_one_row_and_its_parts_are_found_from_it() -> None:
    from export.tasks import EXPORT_TASKS, ExportTask
    from models import tasks
    from service.engine.entry import ServedTask
    from service.engine.tasks import SERVED, served

    assert {registry.task_of(a) for a in registry.names()} <= set(tasks.TASKS) == set(EXPORT_TASKS) == set(SERVED)
    for task, row in tasks.TASKS.items():
        assert row.task == task and isinstance(EXPORT_TASKS[task], ExportTask)
        part = served(task)
        assert isinstance(part, ServedTask) and part is SERVED[task] and part.info is row
        assert part.name == row.name and part.endpoints == row.endpoints and part.metadata == row.metadata
    assert tasks.get("text").name == "text-generation" and tasks.get("vision").spec is spec.VisionSpec
    with pytest.raises(KeyError, match="known: vision, text"):
        tasks.get("audio")  # type: ignore[arg-type]


def test_the_backends_import_nothing_of_the_service_above_them() -> None:
    bad = [f"{name} imports {imported}" for name, path in _modules().items()
           if name.startswith("service.engine.backends")
           for imported in _imports(path)
           if imported.startswith("service.") and not imported.startswith("service.engine.backends")]
    assert not bad
