"""Ahead-of-time compilation of the reweighting family's Triton kernels to PTX / cubin, with no GPU needed.

`compile_kernel(spec, arch)` is what the TensorRT plugins hand to TensorRT (the PTX goes into the
engine) and what CI runs for sm_80 and sm_90 (`python -m plugins.aot`), so a kernel that would not
build on a GPU fails here first. One `KernelSpec` for every op type of the family (plugins.family names
the kernel that runs it): the node attributes (MultiMax's 8 learned parameters and order; k, eps, m,
per-head offset/scale), the op and (when static) the row length are compile-time constants:
TensorRT does not serialise the attributes of AOT plugins and passes only int32 scalars to the kernel,
so constants in the PTX are how the parameters survive engine serialisation.

Runs in a process without TRITON_INTERPRET=1 (see `plugins.kernel`).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from models.onnx_contract import MULTIMAX_SIGMA_OP, multimax_op_types
from plugins.family import MULTIMAX_KERNEL, REWEIGHT_KERNEL
from plugins.kernel import MAX_BLOCK_L, TILE_ELEMENTS, LaunchConfig, choose_config

TRITON_DTYPES = ("fp32", "fp16", "bf16")
# Oldest PTX ISA that has each target: PTX from the newest ptxas (.version 9.x) does not load on the
# CUDA 12 drivers TensorRT 10 runs on, and these kernels need nothing newer.
MIN_PTX_VERSION = {80: 70, 86: 71, 87: 74, 89: 78, 90: 80, 100: 86, 103: 88, 110: 90, 120: 87, 121: 88}
CI_ARCHS = (80, 90)
_PARAM_NAMES = ("r0", "r1", "r2", "r3", "t0", "t1", "t2", "t3")


MAX_HEADS = 64  # per-head Gaussian/Laplacian values baked into one kernel (a where-chain over the heads)


@dataclass(frozen=True)
class KernelSpec:
    """Everything baked into one compiled kernel: an op type of the reweighting family (plugins.family; its member
    names the kernel) and that op's node attributes as constants. Fields of other members' attributes are unused."""

    op: str
    dtype: str = "fp32"  # x and the output
    mask_dtype: str | None = None  # masked ops only; None: same as dtype
    ranges: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)  # MultiMax
    ts: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    order: int = 2
    k: int = 8  # TopKSoftMax
    eps: float = 0.1  # LengthScaledSoftMax
    m: float = 0.0
    offset: tuple[float, ...] = (0.0,)  # GaussianAttention, LaplacianAttention
    scale: tuple[float, ...] = (1.0,)
    n_cols: int | None = None  # static row length (a constant), None when the axis is dynamic
    tile_elements: int = TILE_ELEMENTS

    def __post_init__(self) -> None:
        from plugins.family import member_of, op_types

        try:
            member_of(self.op)
        except ValueError:
            raise ValueError(f"unknown MultiMax op {self.op!r}; expected one of {op_types()}") from None
        for name in ("dtype", "mask_dtype"):
            value = getattr(self, name)
            if value is not None and value not in TRITON_DTYPES:
                raise ValueError(f"{name} must be one of {TRITON_DTYPES}, got {value!r}")
        if len(self.ranges) != 4 or len(self.ts) != 4:
            raise ValueError("ranges and ts need 4 values each")
        if self.order not in (1, 2):
            raise ValueError(f"order must be 1 or 2, got {self.order}")
        if int(self.k) < 1 or not 0.0 < self.eps < 1.0 or self.m < 0:
            raise ValueError(f"need k >= 1, eps in (0, 1), m >= 0; got k={self.k}, eps={self.eps}, m={self.m}")
        offset, scale = tuple(float(v) for v in self.offset), tuple(float(v) for v in self.scale)
        if not offset or len(offset) != len(scale) or len(offset) > MAX_HEADS:
            raise ValueError(f"offset and scale need the same length, 1 to {MAX_HEADS}; got {len(offset)}, "
                             f"{len(scale)}")  # fmt: skip
        if not all(s > 0 for s in scale):
            raise ValueError("every scale must be > 0")
        if self.kernel == REWEIGHT_KERNEL and self.n_cols is not None and self.n_cols > MAX_BLOCK_L:
            raise ValueError(f"rows of {self.n_cols} > {MAX_BLOCK_L} entries do not fit one program")
        # Canonical values: specs that compare equal share one compiled kernel.
        for name, value in (("ranges", tuple(float(v) for v in self.ranges)), ("ts", tuple(float(v) for v in self.ts)),
                            ("offset", offset), ("scale", scale), ("k", int(self.k)), ("eps", float(self.eps)),
                            ("m", float(self.m))):  # fmt: skip
            object.__setattr__(self, name, value)

    @property
    def function(self) -> str:
        """The family member (config name) whose op this is."""
        from plugins.family import member_of

        return member_of(self.op).name

    @property
    def kernel(self) -> str:
        """The Triton kernel that runs it (plugins.family.MULTIMAX_KERNEL or REWEIGHT_KERNEL)."""
        from plugins.family import member_of

        return member_of(self.op).kernel

    @property
    def has_mask(self) -> bool:
        from plugins.family import member_of

        return member_of(self.op).takes_mask(self.op)

    @property
    def per_head(self) -> bool:
        return self.kernel == REWEIGHT_KERNEL and len(self.offset) > 1

    @property
    def scalar_args(self) -> tuple[str, ...]:
        """The int32 kernel arguments a launcher passes, in order, between the inputs and the output."""
        names = ["n_rows"] + (["n_cols"] if self.n_cols is None else [])
        if self.has_mask:
            names += ["n1", "n2", "ms0", "ms1", "ms2"]
        if self.per_head:
            names += ["rows_per_head", "heads"]
        return tuple(names)

    @property
    def config(self) -> LaunchConfig:
        if self.kernel == MULTIMAX_KERNEL:  # tiles loop over long rows
            return choose_config(self.n_cols, self.tile_elements)
        # A whole row in one tile: a dynamic axis gets the widest tile (longer rows come out NaN, not cut).
        return choose_config(self.n_cols, self.tile_elements, None if self.n_cols is not None else MAX_BLOCK_L)


@dataclass(frozen=True)
class CompiledKernel:
    spec: KernelSpec
    arch: int
    name: str
    ptx: str  # scratch parameters removed: exactly inputs, spec.scalar_args, output
    cubin: bytes  # assembled from that PTX
    num_warps: int
    shared: int
    ptx_version: int
    config: LaunchConfig

    @property
    def block_threads(self) -> int:
        return self.num_warps * 32

    def param_types(self) -> list[str]:
        return entry_params(self.ptx, self.name)


def _multimax_signature(spec: KernelSpec) -> tuple[dict[str, str], dict[str, object]]:
    cfg = spec.config
    ptr = f"*{spec.dtype}"
    sig: dict[str, str] = {"x_ptr": ptr, "mask_ptr": f"*{spec.mask_dtype or spec.dtype}", "p_ptr": "constexpr"}
    const: dict[str, object] = {"p_ptr": None}
    sig |= {n: "i32" for n in ("n_rows", "n_cols", "n1", "n2", "ms0", "ms1", "ms2")}
    sig |= {n: "constexpr" for n in _PARAM_NAMES}
    const |= dict(zip(_PARAM_NAMES, (*spec.ranges, *spec.ts), strict=True))
    sig["out_ptr"] = ptr
    if spec.n_cols is not None:
        const["n_cols"] = spec.n_cols
    if not spec.has_mask:
        const |= {"mask_ptr": None, "n1": 1, "n2": 1, "ms0": 0, "ms1": 0, "ms2": 0}
    const |= {
        "ORDER": spec.order,
        "HAS_MASK": spec.has_mask,
        "SOFTMAX": spec.op != MULTIMAX_SIGMA_OP,
        "PARAMS_IN_MEMORY": False,
        "BLOCK_R": cfg.block_r,
        "BLOCK_L": cfg.block_l,
    }
    for name in const:
        sig[name] = "constexpr"
    return sig, const


def _reweight_signature(spec: KernelSpec) -> tuple[dict[str, str], dict[str, object]]:
    from plugins.reweight_kernel import FNS

    cfg = spec.config
    ptr = f"*{spec.dtype}"
    sig: dict[str, str] = {"x_ptr": ptr, "mask_ptr": f"*{spec.mask_dtype or spec.dtype}", "off_ptr": "constexpr",
                           "scale_ptr": "constexpr", "out_ptr": ptr}  # fmt: skip
    sig |= {n: "i32" for n in ("n_rows", "n_cols", "n1", "n2", "ms0", "ms1", "ms2", "rows_per_head", "heads")}
    const: dict[str, object] = {"off_ptr": None, "scale_ptr": None, "k": spec.k, "eps": spec.eps, "m_attr": spec.m}
    if spec.n_cols is not None:
        const["n_cols"] = spec.n_cols
    if not spec.has_mask:
        const |= {"mask_ptr": None, "n1": 1, "n2": 1, "ms0": 0, "ms1": 0, "ms2": 0}
    if not spec.per_head:
        const |= {"rows_per_head": 1, "heads": 1}
    const |= {
        "FN": FNS.index(spec.function), "HAS_MASK": spec.has_mask, "BLOCK_R": cfg.block_r, "BLOCK_L": cfg.block_l,
        "PARAMS_IN_MEMORY": False, "OFFSETS": spec.offset, "SCALES": spec.scale,
    }  # fmt: skip
    for name in const:
        sig[name] = "constexpr"
    return sig, const


def entry_params(ptx: str, name: str) -> list[str]:
    """The .param declarations of kernel `name`, e.g. ['.u64 .ptr .global .align 1', '.u32']."""
    match = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, flags=re.DOTALL)
    if match is None:
        raise ValueError(f"no .entry {name} in the PTX")
    params = [p.strip() for p in match.group(1).split(",") if p.strip()]
    return [re.sub(r"^\.param\s+", "", p).rsplit(" ", 1)[0] for p in params]


def _strip_scratch_params(ptx: str, name: str, expected: int) -> str:
    """Drop the trailing global/profile scratch pointers that Triton >= 3.3 appends to every kernel.

    TensorRT's AOT launch passes exactly the inputs, the extra int32 scalars and the outputs; with two
    undeclared trailing pointers the driver would read kernel arguments past the end of that list. The
    compiled kernel asks for no scratch memory (checked by the caller), so it never reads them.
    """
    match = re.search(rf"(\.entry\s+{re.escape(name)}\s*\()(.*?)(\))", ptx, flags=re.DOTALL)
    if match is None:
        raise ValueError(f"no .entry {name} in the PTX")
    decls = [d for d in match.group(2).split(",") if d.strip()]
    if len(decls) == expected:
        return ptx
    extra = decls[expected:]
    for decl in extra:
        param = decl.split()[-1]
        if ".ptr" not in decl or len(re.findall(rf"\b{re.escape(param)}\b", ptx)) != 1:
            raise RuntimeError(f"unexpected kernel parameter {decl.strip()!r}: not an unused scratch pointer")
    body = ",".join(decls[:expected]).rstrip() + "\n"
    return ptx[: match.start(2)] + body + ptx[match.end(2) :]


def _assemble(ptx: str, arch: int) -> bytes:
    """ptxas (Triton's own copy) on the final PTX: proof that what TensorRT gets builds for `arch`."""
    import triton.backends.nvidia.compiler as nv

    ptxas = nv.get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        src.write_text(ptx)
        proc = subprocess.run(
            [ptxas, f"--gpu-name={nv.sm_arch_from_capability(arch)}", str(src), "-o", str(out)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas failed for sm_{arch}: {proc.stderr.strip()}")
        return out.read_bytes()


@functools.lru_cache(maxsize=512)
def compile_kernel(spec: KernelSpec, arch: int, ptx_version: int | None = None) -> CompiledKernel:
    """Compile `spec` for compute capability `arch` (80 = sm_80, 90 = sm_90a, ...); no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from plugins.kernel import interpreting, multimax_kernel
    from plugins.reweight_kernel import reweight_kernel

    if interpreting():
        raise RuntimeError("ahead-of-time compilation needs a process without TRITON_INTERPRET=1")
    kernel = reweight_kernel if spec.kernel == REWEIGHT_KERNEL else multimax_kernel
    sig, const = (_reweight_signature if spec.kernel == REWEIGHT_KERNEL else _multimax_signature)(spec)
    names = kernel.arg_names
    # TensorRT hands plugins 256-byte aligned buffers and torch allocations are too: allow 16-byte vectors.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("x_ptr", "mask_ptr", "out_ptr") if n not in const}
    version = ptx_version or MIN_PTX_VERSION.get(arch)
    options: dict[str, object] = {"num_warps": spec.config.num_warps, "enable_fp_fusion": False}
    if version is not None:
        options["ptx_version"] = version
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    meta = compiled.metadata
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(meta, scratch, 0):
            raise RuntimeError(f"the {spec.op} kernel must not need Triton {scratch.replace('_', ' ')}")
    n_params = 1 + spec.has_mask + len(spec.scalar_args) + 1
    ptx = _strip_scratch_params(compiled.asm["ptx"], meta.name, n_params)
    return CompiledKernel(
        spec=spec,
        arch=arch,
        name=meta.name,
        ptx=ptx,
        cubin=_assemble(ptx, arch),
        num_warps=meta.num_warps,
        shared=meta.shared,
        ptx_version=int(version or 0),
        config=spec.config,
    )


def ci_specs(quick: bool = False) -> list[KernelSpec]:
    """Each op in fp32 and fp16 with the paper's learned parameters, static (DeiT: 197) and dynamic rows,
    plus fp16 scores with an fp32 mask; `quick`: one kernel per op."""
    from models.multimax import paper_params

    ranges, ts = (tuple(v) for v in paper_params(0))
    if quick:
        return [
            KernelSpec("MultiMax", "fp16", "fp32", ranges, ts, n_cols=None),
            KernelSpec("MultiMaxNoMask", "fp32", None, ranges, ts, n_cols=197),
            KernelSpec("MultiMaxSigma", "fp16", None, ranges, ts, order=1, n_cols=None),
        ]
    specs = [
        KernelSpec(op, dtype, ranges=ranges, ts=ts, n_cols=n_cols)
        for op in multimax_op_types()
        for dtype in ("fp32", "fp16")
        for n_cols in (197, None)
    ]
    return [*specs, KernelSpec("MultiMax", "fp16", "fp32", ranges, ts, order=1, n_cols=None)]


def reweight_ci_specs(quick: bool = False) -> list[KernelSpec]:
    """Every reweighting op, masked and not, with attributes like an export's (per-head for DeiT-small's 6 heads):
    fp16 at DeiT's static 197 and fp32 on a dynamic axis; `quick`: the masked op of each function, dynamic."""
    from models.onnx_contract import REWEIGHTING_ATTRIBUTES

    heads = 6
    values: dict[str, dict[str, object]] = {
        "TopKSoftMax": {"k": 8}, "LengthScaledSoftMax": {"eps": 0.1, "m": 0.0},
        "GaussianAttention": {"offset": (0.0,) * heads, "scale": (1.0,) * heads},
        "LaplacianAttention": {"offset": (0.0,) * heads, "scale": (1.0,) * heads},
    }  # fmt: skip
    specs = []
    for base in REWEIGHTING_ATTRIBUTES:
        kw: dict[str, Any] = dict(values.get(base, {}))
        for op in (base,) if quick else (base, base + "NoMask"):
            specs.append(KernelSpec(op, "fp32", n_cols=None, **kw))
            if not quick:
                specs.append(KernelSpec(op, "fp16", n_cols=197, **kw))
    return specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plugins.aot", description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=list(CI_ARCHS), help="compute capabilities, e.g. 80 90")
    p.add_argument("--json", action="store_true", help="one JSON object per kernel instead of a table")
    p.add_argument("--quick", action="store_true", help="one kernel per op instead of the full CI set")
    args = p.parse_args(argv)
    try:
        for arch in args.arch:
            specs: list[KernelSpec] = [*ci_specs(args.quick), *reweight_ci_specs(args.quick)]
            for spec in specs:
                k = compile_kernel(spec, arch)
                row = {
                    "arch": f"sm_{arch}",
                    "op": spec.op,
                    "dtype": spec.dtype,
                    "mask_dtype": spec.mask_dtype,
                    "n_cols": spec.n_cols,
                    "kernel": k.name,
                    "ptx_version": k.ptx_version,
                    "params": len(k.param_types()),
                    "cubin_bytes": len(k.cubin),
                    "threads": k.block_threads,
                    "shared": k.shared,
                    "config": asdict(k.config),
                }
                if args.json:
                    print(json.dumps(row))
                else:
                    print(
                        f"{row['arch']:<6} {spec.op:<15} {spec.dtype}/{spec.mask_dtype or '-':<4} "
                        f"L={spec.n_cols or 'dyn':<4} params={row['params']} cubin={row['cubin_bytes']} B "
                        f"threads={row['threads']} ptx {k.ptx_version / 10:.1f}"
                    )
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
