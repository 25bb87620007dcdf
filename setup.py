"""The wheel's build step: compile the fused onnxruntime ops (plugins/ort_ops) into the package.

Everything else about the package is in pyproject.toml. `pip wheel .` (or `python -m build`) compiles the
library into plugins/ort_ops/lib/ and tags the wheel for this platform, so installing the wheel needs no
compiler, no onnxruntime headers and no writable cache. The headers are found or fetched now, at build
time (plugins/ort_ops/headers.py: ORT_INCLUDE_DIR, an installed libonnxruntime-dev, or Debian's package).
Editable installs (`pip install -e .`) skip this and stay quick: a checkout builds the library on first
use. MULTIMAX_BUILD_ORT_OPS=0 builds a pure wheel without the library (it is then built on first use).

An editable install also puts the checkout on sys.path (`EditableWithCheckout`): setuptools' own editable hook
for this flat layout is an import finder consulted after sys.path, so a `models/` (or `export/`, `service/`,
`plugins/`) folder of user files in the working directory, a namespace package, shadowed the project's
package and `python -m service` failed there. Python prefers a regular package found anywhere on sys.path to
namespace portions, which is also why an installed wheel (its packages in site-packages) has no such problem.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel
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


class _AlsoTheCheckout:
    """setuptools' editable strategy, then one more .pth file in the wheel: the checkout root, one line."""

    def __init__(self, strategy: Any, name: str) -> None:
        self.strategy, self.name = strategy, name

    def __enter__(self) -> _AlsoTheCheckout:
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.strategy.__exit__(*exc)

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
        self.strategy(wheel, files, mapping)
        wheel.writestr(f"__editable__.{self.name}.checkout.pth", f"{ROOT}\n".encode())


class EditableWithCheckout(editable_wheel):
    """`pip install -e .`: setuptools' editable wheel plus the checkout root on sys.path, after site-packages.

    Not a src layout, so setuptools maps the four packages with a finder that Python asks only after sys.path,
    where a working directory's namespace folder `models/` already answered. With the root on sys.path the path
    search itself finds the regular packages, which win over namespace portions (as an installed wheel's do).
    The root's other names (benchmarks, tests) become importable too. `_select_strategy` is setuptools' hook
    (private, present since setuptools 64); were it renamed, the install would work as before, unfixed, and
    tests/project/test_cwd_shadowing.py would say so.
    """

    def _select_strategy(self, name: str, tag: str, build_lib: Any) -> Any:
        return _AlsoTheCheckout(super()._select_strategy(name, tag, build_lib), name)


setup(
    distclass=WithLibrary,
    cmdclass={"build_py": BuildPyWithOrtOps, "bdist_wheel": PlatformWheel, "editable_wheel": EditableWithCheckout},
)
