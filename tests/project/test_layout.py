"""The product packages stand apart from the tools: no product module imports a benchmark, the load tester or
the demo training code, and the product imports with nothing but the core dependencies installed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT

PRODUCT = ("models", "export", "plugins", "service")
TOOLS = ("benchmarks", "models.training")  # the load tester is benchmarks.loadtest
# What only the extras install (pyproject.toml): train, loadtest, gpu.
EXTRAS_ONLY = ("sklearn", "matplotlib", "aiohttp", "hdrh", "uvloop", "locust", "triton")
# Run first in a child interpreter: importing any of them fails there, as after `pip install -e .`.
WITHOUT_EXTRAS = f"""
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS_ONLY!r}:
            raise ImportError(name + " is an extra")
sys.meta_path.insert(0, Block())
"""


def product_modules() -> list[tuple[str, Path]]:
    found = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            if not is_tool(name):
                found.append((name, path))
    return found


def is_tool(module: str) -> bool:
    return any(module == tool or module.startswith(tool + ".") for tool in TOOLS)


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module an import statement names (at any depth: lazy imports count), relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from models import training` imports models.training: name each imported member too.
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def test_the_walk_finds_the_product_and_resolves_imports() -> None:
    names = {name for name, _ in product_modules()}
    assert {"models.cli", "export.cli", "service.edge.app", "plugins.selftest", "models.demo"} <= names
    assert not any(is_tool(n) for n in names) and len(names) > 50
    # The checker itself: relative and aliased imports of a tool are caught.
    fake = ROOT / "models" / "_layout_probe.py"
    tree = "from .training import demo\nimport benchmarks.loadtest as lt\nfrom models import training\n"
    try:
        fake.write_text(tree)
        found = [m for _, m in imported_modules(fake, "models._layout_probe") if is_tool(m)]
    finally:
        fake.unlink()
    assert "models.training" in found and "benchmarks.loadtest" in found and "models.training.demo" in found


def test_no_product_module_imports_a_tool() -> None:
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for module, path in product_modules()
        for line, target in imported_modules(path, module)
        if is_tool(target)
    ]
    assert not offences, "product modules import tools:\n" + "\n".join(offences)


def test_the_product_imports_without_the_extras() -> None:
    """Every product module imports with the extras' packages made unimportable, as after `pip install -e .`
    (the Triton kernels themselves need the `gpu` extra: plugins.kernel, plugins.reweight_kernel and plugins.aot
    import triton at the top; their callers import them on use)."""
    modules = [m for m, _ in product_modules()
               if m not in ("plugins.kernel", "plugins.reweight_kernel", "plugins.aot") and not m.endswith("__main__")
               and not m.startswith("service.edge.ray")]  # the `ray` extra
    code = WITHOUT_EXTRAS + f"""
for name in {modules!r}:
    importlib.import_module(name)
print("ok", len({modules!r}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


def test_the_product_cli_loads_no_tool() -> None:
    """`python -m models info` on a shipped model, with the extras unimportable, loads no training or benchmark
    module (the demo's checkpoints are package data, not training code)."""
    code = WITHOUT_EXTRAS + """
from models.cli import main
from models.demo import DEMO_DIR, VISION_MULTIMAX
assert main(["info", str(DEMO_DIR / VISION_MULTIMAX)]) == 0
print("tools loaded:", sorted(m for m in sys.modules if m.startswith(("benchmarks", "models.training"))))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "architecture  deit" in proc.stdout and "tools loaded: []" in proc.stdout, proc.stdout
