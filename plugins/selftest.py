"""`python -m plugins.selftest`: check the fused kernel, the PyTorch op and a TensorRT engine against the reference.

On a GPU machine it runs the compiled kernel, the custom op (eager and torch.compile), the ahead-of-time
compile for the local GPU, a small engine when TensorRT is installed, and times the fused kernel on
DeiT-small attention scores against the unfused PyTorch chain + softmax and against plain softmax.
Without a GPU it runs the kernel under Triton's interpreter, the op on the CPU and the sm_80 / sm_90
compile, and lists what it skipped. Prints one table; exit 1 if a check fails, else 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from models.onnx_contract import ONNX_DOMAIN

FP32_TOL = 1e-6
FP16_TOL = 1e-3
DEIT_SMALL = (64, 6, 197, 197)  # batch, heads, tokens, tokens: the speed target's shape
TARGET_VS_UNFUSED = 3.0
TARGET_VS_SOFTMAX = 1.2


@dataclass
class Row:
    check: str
    case: str
    value: str
    limit: str
    ok: bool | None  # None: informative only

    @property
    def status(self) -> str:
        return "-" if self.ok is None else ("ok" if self.ok else "FAIL")


def _tol(dtype: torch.dtype) -> float:
    return FP32_TOL if dtype == torch.float32 else FP16_TOL


def _params(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    from models.multimax import paper_params

    ranges, ts = paper_params(layer)
    return torch.tensor(ranges), torch.tensor(ts)


def _causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """[1, 1, t, s] additive mask, finfo.min above the diagonal (as the GPT decoder builds it)."""
    allowed = torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)
    return torch.zeros(t, s, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def kernel_rows(device: torch.device, lengths: tuple[int, ...], rows: int) -> list[Row]:
    """Fused kernel vs the fp32 reference: masked, unmasked and sigma, fp32 and fp16, each length."""
    from plugins.kernel import fused_multimax, fused_sigma
    from plugins.reference import reference_multimax, reference_sigma

    out = []
    gen = torch.Generator().manual_seed(0)
    ranges, ts = _params(0)
    for dtype in (torch.float32, torch.float16):
        for n in lengths:
            x = (torch.randn(2, rows, n, generator=gen) * 3).to(device=device, dtype=dtype)
            mask = _causal_mask(rows, n, device)[0]
            diffs = [
                (fused_multimax(x, ranges, ts, 2) - reference_multimax(x, ranges, ts, 2)).abs().max(),
                (fused_multimax(x, ranges, ts, 2, mask) - reference_multimax(x, ranges, ts, 2, mask)).abs().max(),
            ]
            diff = max(float(d) for d in diffs)
            out.append(
                Row(
                    "kernel",
                    f"L={n} {_name(dtype)} masked+unmasked",
                    f"{diff:.2e}",
                    f"{_tol(dtype):.0e}",
                    diff <= _tol(dtype),
                )
            )
            s = fused_sigma(x, ranges, ts, 2)
            ref = reference_sigma(x, ranges, ts, 2)
            rel = float(((s.float() - ref.float()).abs() / ref.float().abs().clamp(min=1)).max())
            out.append(
                Row("sigma", f"L={n} {_name(dtype)} (relative)", f"{rel:.2e}", f"{_tol(dtype):.0e}", rel <= _tol(dtype))
            )
    return out


def op_rows(device: torch.device, compile_backend: str) -> list[Row]:
    """The custom op eagerly and under torch.compile(fullgraph=True) against the reference."""
    from plugins.reference import reference_multimax
    from plugins.torch_op import multimax

    ranges, ts = (p.to(device) for p in _params(5))
    x = torch.randn(2, 3, 16, 16, device=device) * 3
    mask = _causal_mask(16, 16, device)
    ref = reference_multimax(x, ranges, ts, 2, mask)
    eager = float((multimax(x, ranges, ts, 2, mask) - ref).abs().max())
    compiled_fn = torch.compile(lambda a, m: multimax(a, ranges, ts, 2, m), fullgraph=True, backend=compile_backend)
    compiled = float((compiled_fn(x, mask) - ref).abs().max())
    where = "Triton kernel" if device.type == "cuda" else "CPU reference"
    return [
        Row("torch op", f"eager ({where})", f"{eager:.2e}", f"{FP32_TOL:.0e}", eager <= FP32_TOL),
        Row(
            "torch op",
            f"torch.compile backend={compile_backend}",
            f"{compiled:.2e}",
            f"{FP32_TOL:.0e}",
            compiled <= FP32_TOL,
        ),
    ]


def reweight_rows(device: torch.device) -> list[Row]:
    """The other reweighting functions' kernel (plugins.reweight_kernel) against models.reweighting: one row per
    function over its cases (plugins.reweight_kernel_cases: lengths, masks, ties, per-head parameters, fp16)."""
    from plugins.reweight_kernel_cases import run_cases

    worst: dict[str, tuple[float, float, bool]] = {}
    for case, r in run_cases(device=device.type).items():
        fn = case.rsplit("-", 3)[0]
        diff, tol, finite = worst.get(fn, (0.0, 0.0, True))
        worst[fn] = (max(diff, r["diff"] / r["tol"]), tol, finite and r["finite"])
    return [Row("reweight kernel", f"{fn} (all cases)", f"{d:.2f} of its limit", "fp32 1e-6, fp16 1e-3",
                d <= 1 and finite) for fn, (d, _, finite) in worst.items()]  # fmt: skip


def reweight_op_rows(device: torch.device, compile_backend: str) -> list[Row]:
    """torch.ops.multimax_serve.reweight eagerly and under torch.compile(fullgraph=True), per-head Gaussian."""
    from models.reweighting import gaussian
    from plugins.torch_op import reweight

    x = torch.randn(2, 3, 16, 16, device=device) * 3
    mask = _causal_mask(16, 16, device)
    attrs = {"offset": [0.1, -0.3, 0.5], "scale": [0.5, 1.0, 2.0]}
    ref = gaussian(x, mask, -1, offset=torch.tensor(attrs["offset"], device=device),
                   scale=torch.tensor(attrs["scale"], device=device))  # fmt: skip
    eager = float((reweight("gaussian", x, mask, **attrs) - ref).abs().max())
    compiled_fn = torch.compile(lambda a, m: reweight("gaussian", a, m, **attrs), fullgraph=True,
                                backend=compile_backend)  # fmt: skip
    compiled = float((compiled_fn(x, mask) - ref).abs().max())
    where = "Triton kernel" if device.type == "cuda" else "CPU reference"
    return [
        Row("reweight op", f"gaussian eager ({where})", f"{eager:.2e}", f"{FP32_TOL:.0e}", eager <= FP32_TOL),
        Row("reweight op", f"gaussian torch.compile {compile_backend}", f"{compiled:.2e}", f"{FP32_TOL:.0e}",
            compiled <= FP32_TOL),
    ]  # fmt: skip


def aot_rows(archs: list[int], in_process: bool) -> list[Row]:
    """Ahead-of-time PTX + cubin (what the TensorRT plugin embeds) for each compute capability."""
    if in_process:
        from plugins.aot import KernelSpec, compile_kernel, reweight_ci_specs

        rows = []
        for arch in archs:
            start = time.perf_counter()
            ranges, ts = (tuple(p.tolist()) for p in _params(0))
            k = compile_kernel(KernelSpec("MultiMax", "fp16", "fp32", ranges, ts, n_cols=None), arch)
            took = time.perf_counter() - start
            rows.append(
                Row("aot compile", f"sm_{arch} MultiMax fp16", f"{len(k.cubin)} B cubin", f"{took:.1f} s", True)
            )
            start = time.perf_counter()
            specs = reweight_ci_specs(quick=True)
            size = sum(len(compile_kernel(spec, arch).cubin) for spec in specs)
            rows.append(Row("aot compile", f"sm_{arch} {len(specs)} reweighting ops (TensorRT plugins)",
                            f"{size} B cubin", f"{time.perf_counter() - start:.1f} s", True))  # fmt: skip
        return rows
    # This process runs the interpreter (TRITON_INTERPRET=1): compile in a clean one.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "plugins.aot", "--quick", "--arch", *map(str, archs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    kernels = [line for line in proc.stdout.splitlines() if line.strip()]
    detail = f"{len(kernels)} kernels" if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1:]
    return [Row("aot compile", "sm_" + "/sm_".join(map(str, archs)), str(detail), "ptxas ok", proc.returncode == 0)]


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def _run_engine(trt: Any, engine_path: Path, inputs: dict[str, torch.Tensor],
                outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:  # fmt: skip
    """Run a serialized engine once on CUDA tensors; every output has the shape of the input "x"."""
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(engine_path.read_bytes())
    context = engine.create_execution_context()
    context.set_input_shape("x", tuple(inputs["x"].shape))
    buffers = dict(inputs) | {name: torch.empty_like(inputs["x"]) for name in outputs}
    for name, tensor in buffers.items():
        context.set_tensor_address(name, tensor.data_ptr())
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("TensorRT execution failed")
    stream.synchronize()
    return buffers


REWEIGHT_SELFTEST_ATTRS: dict[str, dict[str, Any]] = {
    "topk_softmax": {"k": 5}, "length_scaled": {"eps": 0.1, "m": 0.0},
    "gaussian": {"offset": [0.2, -0.1], "scale": [0.7, 1.5]}, "laplacian": {"offset": [0.0, 0.3], "scale": [1.2, 0.8]},
}  # fmt: skip


def reweight_selftest_model(heads: int = 2, t: int = 64) -> tuple[Any, list[str]]:
    """The 14 reweighting nodes (per-head Gaussian/Laplacian) reading x (B, heads, t, t) and a causal mask, one
    output each (named `<function>` / `<function>NoMask`), with their function bodies: (ModelProto, names)."""
    from onnx import TensorProto, helper

    from models.onnx_contract import REWEIGHTING_OPS, reweighting_op_types
    from plugins.onnx_functions import function_protos
    from plugins.ort_ops.graphs import reweighting_node

    nodes, names = [], []
    for fn, op in REWEIGHTING_OPS.items():
        for suffix, ins in (("", ["x", "mask"]), ("NoMask", ["x"])):
            names.append(f"{fn}{suffix}")
            nodes.append(reweighting_node(op + suffix, ins, names[-1], REWEIGHT_SELFTEST_ATTRS.get(fn, {})))
    dims: list[str | int | None] = ["batch", heads, t, t]
    graph = helper.make_graph(
        nodes, "reweight_selftest",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, t, t])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims) for n in names],
    )  # fmt: skip
    opset = [helper.make_opsetid("", 18), helper.make_opsetid(ONNX_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opset, functions=function_protos(18, set(reweighting_op_types())),
                             ir_version=10)
    return model, names


def reweight_selftest_diffs(out: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Per function, the largest difference of its masked and NoMask outputs from models.reweighting."""
    from models import reweighting as rw

    diffs = {}
    for fn in rw.OTHER_FUNCTIONS:
        reference = rw.FUNCTIONS[fn].fn
        assert reference is not None
        kw = {k: torch.tensor(v, device=x.device) if isinstance(v, list) else v
              for k, v in REWEIGHT_SELFTEST_ATTRS.get(fn, {}).items()}  # fmt: skip
        diffs[fn] = max(float((out[fn] - reference(x, mask, -1, **kw)).abs().max()),
                        float((out[f"{fn}NoMask"] - reference(x, None, -1, **kw)).abs().max()))  # fmt: skip
    return diffs


def tensorrt_reweight_rows(tmp: Path) -> list[Row]:
    """`reweight_selftest_model` through the engine builder (every node must become its plugin, not its
    function body) and TensorRT, against the references."""
    import onnx
    import tensorrt as trt

    from plugins.build_engine import Profile, build_engine

    heads, t = 2, 64
    model, names = reweight_selftest_model(heads, t)
    path = tmp / "reweight_selftest.onnx"
    onnx.save(model, str(path))
    start = time.perf_counter()
    engine_path = build_engine(path, tmp / "reweight_selftest.engine", False, [Profile((1, 2, 4))])
    took = time.perf_counter() - start
    x = torch.randn(3, heads, t, t, device="cuda") * 3
    mask = _causal_mask(t, t, torch.device("cuda"))
    out = _run_engine(trt, engine_path, {"x": x, "mask": mask}, tuple(names))
    return [Row("tensorrt", f"{fn} (+NoMask) fp32 build {took:.0f} s", f"{d:.2e}", "1e-05", d <= 1e-5)
            for fn, d in reweight_selftest_diffs(out, x, mask).items()]  # fmt: skip


def tensorrt_rows(tmp: Path) -> list[Row]:
    """A 3-node ONNX model (MultiMax, MultiMaxNoMask, MultiMaxSigma) through the engine builder and TensorRT."""
    import onnx
    import tensorrt as trt
    from onnx import TensorProto, helper

    from plugins.build_engine import BuildError, Profile, build_engine
    from plugins.reference import reference_multimax, reference_sigma

    ranges, ts = _params(2)
    heads, t = 2, 197
    attrs: dict[str, Any] = {
        "ranges": ranges.tolist(),
        "ts": ts.tolist(),
        "order": 2,
        "plugin_version": "1",
        "plugin_namespace": "multimax",
    }
    nodes = [
        helper.make_node(op, ins, [out], domain=ONNX_DOMAIN, plugin_name=op, **attrs)
        for op, ins, out in (
            ("MultiMax", ["x", "mask"], "probs"),
            ("MultiMaxNoMask", ["x"], "probs_nomask"),
            ("MultiMaxSigma", ["x"], "sigma"),
        )
    ]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", heads, t, t])
    m_info = helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, t, t])
    outs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", heads, t, t])
        for n in ("probs", "probs_nomask", "sigma")
    ]
    graph = helper.make_graph(nodes, "multimax_selftest", [x_info, m_info], outs)
    opset = [helper.make_opsetid("", 18), helper.make_opsetid(ONNX_DOMAIN, 1)]
    try:  # the exporter's function bodies: the engine must still use the plugins
        from models.onnx_contract import multimax_op_types
        from plugins.onnx_functions import function_protos

        functions = function_protos(18, set(multimax_op_types()))
    except ImportError:
        functions = []
    # IR 10, as the exporter writes: the installed onnx defaults to a newer IR than TensorRT's parser reads.
    model = helper.make_model(graph, opset_imports=opset, functions=functions, ir_version=10)
    path = tmp / "selftest.onnx"
    onnx.save(model, str(path))

    rows = []
    for fp16 in (False, True):
        start = time.perf_counter()
        try:
            engine_path = build_engine(path, tmp / f"selftest_{int(fp16)}.engine", fp16, [Profile((1, 2, 4))])
        except BuildError as exc:
            if not fp16:
                raise
            rows.append(Row("tensorrt", "fp16 build", "not built", str(exc), None))  # strongly typed TensorRT
            continue
        took = time.perf_counter() - start
        x = torch.randn(3, heads, t, t, device="cuda") * 3
        mask = _causal_mask(t, t, torch.device("cuda"))
        buffers = _run_engine(trt, engine_path, {"x": x, "mask": mask}, ("probs", "probs_nomask", "sigma"))
        refs = {
            "probs": reference_multimax(x, ranges, ts, 2, mask),
            "probs_nomask": reference_multimax(x, ranges, ts, 2),
            "sigma": reference_sigma(x, ranges, ts, 2),
        }
        tol = FP16_TOL if fp16 else FP32_TOL
        for name, ref in refs.items():
            diff = (buffers[name] - ref).abs()
            if name == "sigma":
                diff = diff / ref.abs().clamp(min=1)
            d = float(diff.max())
            label = f"{name} {'fp16' if fp16 else 'fp32'} build {took:.0f} s"
            rows.append(Row("tensorrt", label, f"{d:.2e}", f"{tol:.0e}", d <= tol))
    return rows


def _bench(fn: Callable[[], object]) -> float:
    import triton.testing

    try:  # CUDA graphs: the timing is the kernels', not Python's launch overhead
        return float(triton.testing.do_bench_cudagraph(fn, rep=100))
    except Exception:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200))


def bench_rows(shape: tuple[int, ...]) -> list[Row]:
    """Fused kernel vs PyTorch eager (elementwise chain + softmax) vs plain torch.softmax."""
    from plugins.kernel import fused_multimax
    from plugins.reference import unfused_multimax

    rows = []
    params = torch.cat(_params(0)).cuda()
    ranges, ts = params[:4], params[4:]  # halves of one vector: the kernel reads it in place
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(shape, device="cuda", dtype=dtype) * 3
        fused = _bench(partial(fused_multimax, x, ranges, ts, 2))
        unfused = _bench(partial(unfused_multimax, x, ranges, ts, 2))
        plain = _bench(partial(torch.softmax, x, dim=-1))
        case = f"{'x'.join(map(str, shape))} {_name(dtype)}"
        gbs = 2 * x.numel() * x.element_size() / (fused * 1e-3) / 1e9
        rows.append(Row("time fused", case, f"{fused * 1e3:.1f} us", f"{gbs:.0f} GB/s", None))
        rows.append(
            Row(
                "time unfused",
                case,
                f"{unfused * 1e3:.1f} us",
                f"speedup {unfused / fused:.2f}x >= 3",
                unfused / fused >= TARGET_VS_UNFUSED,
            )
        )
        rows.append(
            Row(
                "time softmax",
                case,
                f"{plain * 1e3:.1f} us",
                f"fused/softmax {fused / plain:.2f} <= 1.2",
                fused / plain <= TARGET_VS_SOFTMAX,
            )
        )
    return rows


def reweight_bench_rows(shape: tuple[int, ...]) -> list[Row]:
    """Each reweighting function's kernel against its eager PyTorch reference and against torch.softmax (fp32)."""
    from models import reweighting as rw
    from plugins.reweight_kernel import fused_reweight

    x = torch.randn(shape, device="cuda") * 3
    plain = _bench(partial(torch.softmax, x, dim=-1))
    rows = []
    for fn in rw.OTHER_FUNCTIONS:
        reference = rw.FUNCTIONS[fn].fn
        assert reference is not None
        fused = _bench(partial(fused_reweight, fn, x))
        eager = _bench(partial(reference, x, None, -1))
        rows.append(Row("time reweight", f"{fn} {'x'.join(map(str, shape))} fp32", f"{fused * 1e3:.1f} us",
                        f"eager/fused {eager / fused:.2f}x, fused/softmax {fused / plain:.2f}", None))  # fmt: skip
    return rows


def print_table(rows: list[Row], skipped: list[tuple[str, str]], device: str) -> None:
    headers = ("check", "case", "result", "limit / note", "status")
    cells = [headers] + [(r.check, r.case, r.value, r.limit, r.status) for r in rows]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(headers))]
    print(f"MultiMax plugin self-test on {device}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for c in cells[1:]:
        print("| " + " | ".join(str(v).ljust(w) for v, w in zip(c, widths, strict=True)) + " |")
    for what, why in skipped:
        print(f"skipped: {what}: {why}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plugins.selftest", description=__doc__.split("\n")[0])
    p.add_argument("--no-bench", action="store_true", help="skip the timings")
    p.add_argument("--no-aot", action="store_true", help="skip the ahead-of-time compile check")
    args = p.parse_args(argv)

    gpu = torch.cuda.is_available()
    skipped: list[tuple[str, str]] = []
    if not gpu and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (see plugins.kernel)
    from plugins.kernel import interpreting

    device = torch.device("cuda" if gpu else "cpu")
    name = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
    rows: list[Row] = []
    if gpu or interpreting():
        lengths = (1, 7, 197, 1024, 4099)
        rows += kernel_rows(device, lengths, rows=8 if gpu else 2)
        rows += reweight_rows(device)
    else:
        skipped.append(("fused kernel", "no GPU and triton was imported before TRITON_INTERPRET=1 could be set"))
    rows += op_rows(device, "inductor" if gpu else "aot_eager")
    rows += reweight_op_rows(device, "inductor" if gpu else "aot_eager")
    if args.no_aot:
        skipped.append(("ahead-of-time compile", "--no-aot"))
    else:
        from plugins.trt_plugin import device_arch

        rows += aot_rows([device_arch()] if gpu else [80, 90], in_process=not interpreting())
    from plugins.trt_plugin import tensorrt_unavailable

    if not gpu:
        skipped.append(("TensorRT engine", "no CUDA GPU"))
    elif why_no_trt := tensorrt_unavailable():
        skipped.append(("TensorRT engine", why_no_trt))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rows += tensorrt_rows(Path(tmp))
            rows += tensorrt_reweight_rows(Path(tmp))
    if not gpu:
        skipped.append(("timings", "no CUDA GPU"))
    elif args.no_bench:
        skipped.append(("timings", "--no-bench"))
    else:
        rows += bench_rows(DEIT_SMALL)
        rows += reweight_bench_rows(DEIT_SMALL)
    print_table(rows, skipped, name)
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
