"""The wheel's build step: compile the fused onnxruntime ops (plugins/ort_ops) into the package.

Everything else about the package is in pyproject.toml. `pip wheel .` (or `python -m build`) compiles the
library into plugins/ort_ops/lib/ and tags the wheel for this platform, so installing the wheel needs no
compiler, no onnxruntime headers and no writable cache. The headers are found or fetched now, at build
time (plugins/ort_ops/headers.py: ORT_INCLUDE_DIR, an installed libonnxruntime-dev, or Debian's package).
Editable installs (`pip install -e .`) skip this and stay quick: a checkout builds the library on first
use. MULTIMAX_BUILD_ORT_OPS=0 builds a pure wheel without the library (it is then built on first use).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path
from types import ModuleType

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.errors import ExecError

ROOT = Path(__file__).resolve().parent
SWITCH = "MULTIMAX_BUILD_ORT_OPS"


def _wanted() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _ort_build() -> ModuleType:
    """plugins/ort_ops/build.py, loaded without running the packages' __init__ (which imports onnxruntime,
    absent from an isolated build environment); build.py and headers.py need only the standard library."""
    for name, path in (("plugins", ROOT / "plugins"), ("plugins.ort_ops", ROOT / "plugins" / "ort_ops")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    return importlib.import_module("plugins.ort_ops.build")


class BuildPyWithOrtOps(build_py):
    """build_py, then the library compiled into the build tree (not into the checkout)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode or not _wanted():
            return
        build = _ort_build()
        headers = sys.modules["plugins.ort_ops.headers"]
        out = Path(self.build_lib) / "plugins" / "ort_ops" / "lib"
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("*.so"):
            stale.unlink()
        try:
            include = headers.find_headers(build.cache_dir())
            target = out / f"libmultimax_ort_ops.api{headers.api_version(include)}.so"
            print(f"compiling the fused onnxruntime ops into {target} (headers: {include})")
            build.compile_library(build.compiler(), include, target)
        except (build.BuildFailed, headers.HeadersUnavailable, OSError) as exc:
            raise ExecError(
                f"fused onnxruntime ops: {exc} (set {SWITCH}=0 for a wheel without them: the library is then "
                "built on first use)"
            ) from exc


class WithLibrary(Distribution):
    """Machine code inside: installed as platform code (platlib), in a wheel tagged for this platform."""

    def has_ext_modules(self) -> bool:
        return _wanted()


class PlatformWheel(bdist_wheel):
    """A wheel for this platform but any Python 3: the library links no Python ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, platform = super().get_tag()
        return (python, abi, platform) if self.root_is_pure else ("py3", "none", platform)


setup(distclass=WithLibrary, cmdclass={"build_py": BuildPyWithOrtOps, "bdist_wheel": PlatformWheel})
