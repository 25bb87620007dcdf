"""Fused MultiMax for onnxruntime's CPU execution provider: a custom-op library for the `multimax` domain.

The exported models carry each MultiMax as one `multimax::*` node with an ONNX function body; without
this library onnxruntime inlines the body (one memory pass per elementwise op). With it, the three ops
run as fused kernels (src/multimax_ops.cc): one pass per row in cache, vectorised, rows over
onnxruntime's intra-op threads. The exported files never change. Every member of the reweighting family
(plugins.family; op names from the contract, compiled in as family_ops.h) is registered by the same loop:
MultiMax's rows in src/rows.inc, the others' (SparseMax, EntMax15, ... masked and NoMask) in src/reweight.inc.

`register(options)` is what every CPU session the project creates calls. A wheel carries the library,
compiled when the wheel was built (setup.py; `lib/` beside this file): it is used as it is, with no
compiler, no headers and no cache. A source checkout (an editable install) has none, so the library is
built on first use instead (headers: ORT_INCLUDE_DIR, an installed libonnxruntime-dev, or fetched from
Debian) into the cache, and reused. One log line says which library is used (`Library.source`), or,
when none can be found, built or loaded, why not: sessions then run the function bodies. Environment:
MULTIMAX_ORT_OPS=0 turns it off; MULTIMAX_ORT_OPS_LIB names a library to use instead; MULTIMAX_CACHE_DIR
moves the cache; MULTIMAX_ORT_ISA=portable|avx2|avx512 forces a kernel path (for tests and comparisons).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from models.onnx_contract import ONNX_DOMAIN, multimax_op_types, reweighting_op_types
from plugins.ort_ops.build import cache_dir

MULTIMAX_OPS = multimax_op_types()
OPS = (*MULTIMAX_OPS, *reweighting_op_types())  # the library's ops: every op type of the contract's FAMILY_OPS
# The shared-cache decoder attention of the onnxruntime-genai folder export (plugins/onnx_attention.py)
ATTENTION_OPS = ("MultiMaxAttention",)
DOMAIN = ONNX_DOMAIN
PREBUILT_DIR = Path(__file__).parent / "lib"  # where setup.py puts the library in a wheel
# Library.source: where the library in use came from
PREBUILT, FIRST_USE, FROM_ENV, UNAVAILABLE = "prebuilt", "built on first use", "MULTIMAX_ORT_OPS_LIB", "unavailable"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Library:
    """The outcome of finding/building the library: a path, or the reason there is none."""

    path: Path | None
    reason: str = ""
    kernel_paths: tuple[str, ...] = ()  # instruction-set paths this CPU runs, the default first
    compiled_paths: tuple[str, ...] = ()  # every path built into the library
    source: str = UNAVAILABLE  # PREBUILT (the wheel's), FIRST_USE (compiled into the cache) or FROM_ENV

    @property
    def available(self) -> bool:
        return self.path is not None


def prebuilt_library() -> Path | None:
    """The library a wheel carries, or None (a source checkout)."""
    found = sorted(PREBUILT_DIR.glob("libmultimax_ort_ops.api*.so"))
    return found[-1] if found else None


def _locate() -> Library:
    if os.environ.get("MULTIMAX_ORT_OPS", "1").strip().lower() in ("0", "false", "no", "off"):
        return Library(None, "turned off by MULTIMAX_ORT_OPS")
    from plugins.ort_ops.build import BuildFailed, build
    from plugins.ort_ops.headers import HeadersUnavailable

    named, packaged = os.environ.get("MULTIMAX_ORT_OPS_LIB"), prebuilt_library()
    if named:
        path, source = Path(named), FROM_ENV
    elif packaged:
        path, source = packaged, PREBUILT
    else:
        try:
            path, source = build(cache_dir()), FIRST_USE
        except (BuildFailed, HeadersUnavailable, OSError) as exc:
            return Library(None, f"cannot build it: {exc}")
    try:
        lib = ctypes.CDLL(str(path))
        lib.MultiMaxKernelPaths.restype = lib.MultiMaxCompiledPaths.restype = ctypes.c_char_p
        paths = tuple(lib.MultiMaxKernelPaths().decode().split(","))
        compiled = tuple(lib.MultiMaxCompiledPaths().decode().split(","))
        ort.SessionOptions().register_custom_ops_library(str(path))  # onnxruntime must accept it, too
    except (OSError, AttributeError) as exc:
        return Library(None, f"cannot load {path}: {exc}")
    except Exception as exc:  # onnxruntime's own Fail type
        return Library(None, f"onnxruntime {ort.__version__} rejects {path}: {str(exc).splitlines()[0]}")
    return Library(path, kernel_paths=paths, compiled_paths=compiled, source=source)


@functools.cache
def library() -> Library:
    """The library (built if needed), found once per process; logs one line: which library, or why none."""
    lib = _locate()
    if lib.available:
        log.info("fused MultiMax ops: %s library %s", lib.source, lib.path)
    else:
        log.warning("fused MultiMax ops unavailable (%s); onnxruntime runs the function bodies instead", lib.reason)
    return lib


def kernel_path() -> str | None:
    """The instruction-set path sessions created now will use (MULTIMAX_ORT_ISA or the CPU's best)."""
    lib = library()
    return (os.environ.get("MULTIMAX_ORT_ISA") or lib.kernel_paths[0]) if lib.available else None


def run_counts() -> tuple[int, int]:
    """(kernel runs, runs whose output took x's buffer) of the fused ops in this process so far; (0, 0)
    without the library. Sessions plan the output into x's buffer where x has no other reader."""
    lib = library()
    if lib.path is None:
        return 0, 0
    runs, in_place = ctypes.c_uint64(), ctypes.c_uint64()
    ctypes.CDLL(str(lib.path)).MultiMaxRunCounts(ctypes.byref(runs), ctypes.byref(in_place))
    return runs.value, in_place.value


def register(options: ort.SessionOptions) -> bool:
    """Register the fused ops on a CPU session's options; False (function bodies run) if unavailable."""
    lib = library()
    if lib.path is None:
        return False
    options.register_custom_ops_library(str(lib.path))
    return True


def uses_multimax(model_path: Path) -> bool:
    """Whether a model file has `multimax::*` nodes (what the library replaces); reads no external data."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    return any(node.domain == DOMAIN for node in proto.graph.node)
