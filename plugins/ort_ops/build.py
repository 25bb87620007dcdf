"""Compiling the custom-op library: four translation units (the ops, and the row kernels once per
instruction set), linked into one shared object.

Two callers: the wheel build (setup.py compiles it into the package: `compile_library`), and the first-use
build of a source checkout (`build`: into the cache, named by a hash of everything that goes into it, so a
changed source or header rebuilds and an unchanged one is reused). Older cached builds are left in place
(~100 kB each): checkouts of other versions may share the cache and have them loaded.

Standard library only (and headers.py): setup.py imports this module in an isolated build environment,
without onnxruntime.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from plugins.ort_ops.headers import api_version, find_headers

SRC = Path(__file__).parent / "src"
# -ffp-contract=fast: a*b + c becomes one FMA where the ISA has it (GCC's ISO modes default to off); no
# -ffast-math, whose finite-math assumptions would break the kernels' NaN and -inf handling.
COMMON_FLAGS = [
    "-std=c++17", "-O3", "-ffp-contract=fast", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-Wall",
]  # fmt: skip
# Row kernels per instruction set; the x86 fast paths are compiled for any x86-64 compiler target and
# only run where the CPU reports the features (multimax_ops.cc checks at run time).
UNITS: dict[str, list[str]] = {"multimax_ops.cc": [], "rows_portable.cc": []}
X86_UNITS = {"rows_avx2.cc": ["-mavx2", "-mfma"], "rows_avx512.cc": ["-mavx512f", "-mfma"]}
COMPILE_TIMEOUT_S = 300
log = logging.getLogger(__name__)


class BuildFailed(RuntimeError):
    """The library could not be compiled; the message says why."""


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise BuildFailed("no C++ compiler (g++, c++ or clang++; or set CXX)")
    return cxx


def cache_dir() -> Path:
    """Where the first-use build (and the headers it fetches) goes: MULTIMAX_CACHE_DIR, else the user's cache."""
    if os.environ.get("MULTIMAX_CACHE_DIR"):
        return Path(os.environ["MULTIMAX_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multimax-serve" / "ort_ops"


def units() -> dict[str, list[str]]:
    return UNITS | (X86_UNITS if platform.machine() in ("x86_64", "AMD64") else {})


def _fingerprint(cxx: str, include: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(SRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update((include / "onnxruntime_c_api.h").read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest.update(repr((version, COMMON_FLAGS, units())).encode())
    return digest.hexdigest()[:16]


def build(cache: Path) -> Path:
    """The library's path, compiling it (once per source/header/compiler fingerprint) if needed."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "build.lock", "w") as lock:  # one fetch/build at a time across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        include = find_headers(cache)
        cxx = compiler()
        target = cache / f"libmultimax_ort_ops.api{api_version(include)}.{_fingerprint(cxx, include)}.so"
        if target.is_file():
            return target
        log.info("building the fused MultiMax ops for onnxruntime (once; cached as %s)", target)
        compile_library(cxx, include, target)
    return target


def compile_library(cxx: str, include: Path, target: Path) -> None:
    """Compile and link the library as `target`, which appears whole or not at all."""
    with tempfile.TemporaryDirectory(prefix="build.", dir=target.parent) as tmp:
        objects = _compile(cxx, include, Path(tmp))
        linked = Path(tmp) / target.name
        _check([cxx, "-shared", "-o", str(linked), *map(str, objects), "-Wl,--no-undefined"], "link")
        linked.rename(target)  # atomic: readers never see a half-written library


def _compile(cxx: str, include: Path, out: Path) -> list[Path]:
    jobs = []
    for unit, flags in units().items():
        obj = out / (unit + ".o")
        cmd = [cxx, *COMMON_FLAGS, *flags, f"-I{include}", "-c", str(SRC / unit), "-o", str(obj)]
        jobs.append((obj, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    failures = []
    for obj, proc in jobs:
        try:
            output, _ = proc.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output = f"timed out after {COMPILE_TIMEOUT_S}s"
        if proc.returncode:
            failures.append(f"{obj.stem}: {output.strip().splitlines()[-1] if output.strip() else 'failed'}")
    if failures:
        raise BuildFailed("compiling failed: " + "; ".join(failures))
    return [obj for obj, _ in jobs]


def _check(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if done.returncode:
        raise BuildFailed(f"{what} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
