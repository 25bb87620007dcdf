"""The wheel: `pip wheel .` compiles the fused onnxruntime ops (setup.py) into a platform wheel, and an install of
that wheel uses its library with no compiler, no headers and no writable cache; a checkout builds it on first use.

The install is a real fresh virtual environment (the wheel installed with --no-deps), whose dependencies come
from this interpreter's site-packages through a .pth line (only the paths: this venv's editable-install hook is
not run, so the project's own packages come from the wheel alone).
"""

from __future__ import annotations

import json
import os
import platform
import site
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

from benchmarks.server import start, stop
from tests.paths import ROOT

LIB = "plugins/ort_ops/lib/libmultimax_ort_ops.api"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # No build isolation: the build needs no registry (setuptools is in the dev extra; the headers are cached
    # from the first-use build or fetched as that build would).
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = out.glob("*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
               str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    platlib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(platlib) / "shared_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return where


def bare_env(tmp_path: Path) -> dict[str, str]:
    """No compiler on PATH, no headers, and no cache that can be written (HOME and the cache under a file)."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    env = {k: v for k, v in os.environ.items()
           if k not in ("CXX", "ORT_INCLUDE_DIR", "MULTIMAX_ORT_OPS_LIB", "XDG_CACHE_HOME", "PYTHONPATH")}
    return env | {"PATH": str(tmp_path / "no-bin"), "HOME": str(blocked / "home"),
                  "MULTIMAX_CACHE_DIR": str(blocked / "cache"), "MULTIMAX_ORT_OPS": "1"}


def ort_ops_cli(python: Path, cwd: Path, env: dict[str, str]) -> tuple[int, dict[str, object]]:
    done = subprocess.run([str(python), "-m", "plugins.ort_ops", "--json"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    return done.returncode, json.loads(done.stdout)


def test_the_wheel_is_a_platform_wheel_carrying_the_library(wheel: Path) -> None:
    assert wheel.name.endswith(f"-py3-none-linux_{platform.machine()}.whl"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    libs = [n for n in names if n.startswith(LIB) and n.endswith(".so")]
    assert len(libs) == 1, libs
    assert "Root-Is-Purelib: false" in meta
    assert "plugins/ort_ops/src/multimax_ops.cc" in names  # the sources stay, for a rebuild by hand


def test_an_install_of_the_wheel_uses_its_library_without_compiler_or_cache(venv: Path, tmp_path: Path) -> None:
    env = bare_env(tmp_path)
    rc, info = ort_ops_cli(venv / "bin" / "python", tmp_path, env)
    assert rc == 0, info
    assert info["available"] is True and info["source"] == "prebuilt"
    assert str(info["path"]).startswith(str(venv)) and LIB in str(info["path"])
    # The control: the checkout, in the same environment, has no library and cannot build one.
    rc, info = ort_ops_cli(Path(sys.executable), ROOT, env)
    assert rc == 2 and info["source"] == "unavailable" and str(info["reason"]).startswith("cannot build it")


def test_the_server_from_the_wheel_says_prebuilt_in_its_log_and_models(venv: Path, tmp_path: Path) -> None:
    env = bare_env(tmp_path)
    python = venv / "bin" / "python"
    proc, url = start("--models", "digits_multimax,digits_softmax", "--warmup-calls", "0",
                      command=[str(python), "-m", "service", "--log-level", "info"], cwd=tmp_path, env=env)
    try:
        with urllib.request.urlopen(f"{url}/v1/models/digits_multimax", timeout=30) as r:
            card = json.load(r)
    finally:
        stop(proc)
    assert card["fused_multimax"]["in_use"] is True and card["fused_multimax"]["source"] == "prebuilt"
    assert proc.stdout is not None
    log = proc.stdout.read()
    assert "fused MultiMax ops: prebuilt library " + str(venv) in log, log[-3000:]


def test_a_wheel_build_without_headers_fails_saying_why(tmp_path: Path) -> None:
    env = os.environ | {"ORT_INCLUDE_DIR": str(tmp_path)}  # a directory without onnxruntime's headers
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and not list(tmp_path.glob("*.whl"))
    assert f"fused onnxruntime ops: ORT_INCLUDE_DIR={tmp_path} has no onnxruntime_c_api.h" in done.stdout + done.stderr
    assert "MULTIMAX_BUILD_ORT_OPS=0" in done.stdout + done.stderr
