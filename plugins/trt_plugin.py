"""TensorRT plugins for the three `multimax` ONNX nodes, via TensorRT's Python plugin API.

`register()` (lazy: this module imports without TensorRT) registers "multimax::MultiMax",
"multimax::MultiMaxNoMask" and "multimax::MultiMaxSigma" with `tensorrt.plugin`: the op type, the
`plugin_namespace` ("multimax") and `plugin_version` ("1", the only version the Python API creates)
that the exporter writes on each node. Each has an ahead-of-time implementation only: at engine build
time it compiles the Triton kernel for the build GPU and hands TensorRT the PTX, so engines run
without Python (trtexec, C++).

Rules of the API this follows (tensorrt/plugin/_lib.py, _plugin_class.py, _validate.py):
- The ONNX parser passes only the attributes the plugin declares (onnx-tensorrt `loadFields` walks the
  creator's field names), so the nodes' `plugin_name` / `plugin_version` / `plugin_namespace`
  attributes never reach the plugin; declaring them would change nothing.
- Plugin attributes are NOT serialised into the engine for AOT plugins, and the only scalar kernel
  arguments TensorRT passes are int32 symbolic expressions. The 8 learned parameters and the order
  are therefore compile-time constants of the PTX (see `plugins.aot`), which the engine does keep.
- The AOT plugin calls `aot_impl` with every attribute, positionally, in declaration order: the
  signatures below list all of them, in the order of `register`.
- `order` is an int32 array, not `int`: the parser hands a 1-element INT32 field and the API builds
  `int(field)`, which NumPy 2.4 refuses for 1-d arrays.
"""

import functools
from typing import Any

from models.onnx_contract import ONNX_DOMAIN, PLUGIN_VERSION

PLUGIN_NAMESPACE = ONNX_DOMAIN
PLUGIN_OPS = ("MultiMax", "MultiMaxNoMask", "MultiMaxSigma")
MAX_MASKED_RANK = 4  # the mask row mapping covers 3 leading axes: [B, H, T, S] scores


@functools.cache
def tensorrt_unavailable() -> str | None:
    """Why TensorRT cannot build or run engines here, in one line (for an error or a skip); None when it can.
    The one check the exporter, the engine builder, the self-test and the server's TensorRT backend share."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "TensorRT is not installed (on a machine with an NVIDIA GPU: pip install 'multimax-serve[tensorrt]')"
    except Exception as exc:  # a broken install raises all sorts
        return f"TensorRT failed to import: {exc}"
    import torch

    if not torch.cuda.is_available():
        return "TensorRT needs a CUDA GPU, and PyTorch sees none (engine buffers are torch CUDA tensors)"
    return None


def device_arch() -> int:
    """Compute capability of the current CUDA device as one number (sm_90 -> 90)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("compiling the MultiMax TensorRT plugin needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _triton_dtype(trt: Any, dtype: Any) -> str:
    names = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}
    if dtype not in names:
        raise TypeError(f"MultiMax plugins take FP32/FP16/BF16 tensors, got {dtype}")
    return names[dtype]


def _value(expr: Any) -> Any:
    """A Python int for build-time constant dimensions, the symbolic expression otherwise."""
    return expr.constant_value() if expr.is_constant else expr


def _mul(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return b * a if isinstance(a, int) else a * b  # the expression's own operator: no __rmul__ exists


def _same(a: Any, b: Any) -> Any:
    """1 where two extents are equal (the mask axis is not broadcast), else 0; symbolic if need be."""
    if isinstance(a, int) and isinstance(b, int):
        return int(a == b)
    return (b == a) if isinstance(a, int) else (a == b)


def mask_row_args(x_dims: list[Any], mask_dims: list[Any]) -> dict[str, Any]:
    """n1, n2, ms0, ms1, ms2 of `plugins.kernel` for a contiguous mask broadcast to x (ONNX rules).

    Entries are ints or symbolic extents, so dynamic axes work: a mask axis contributes its stride
    times (mask extent == x extent), 0 where it is broadcast.
    """
    rank = len(x_dims)
    if rank > MAX_MASKED_RANK or len(mask_dims) > rank:
        raise ValueError(f"MultiMax masks need rank <= {MAX_MASKED_RANK} scores and a mask of no higher rank")
    xd = [1] * (4 - rank) + list(x_dims)
    md = [1] * (4 - len(mask_dims)) + list(mask_dims)
    if isinstance(md[3], int) and md[3] == 1 and not (isinstance(xd[3], int) and xd[3] == 1):
        raise ValueError("a MultiMax mask broadcast along the softmax axis is not supported")
    inner = [md[3], _mul(md[2], md[3]), _mul(_mul(md[1], md[2]), md[3])]  # contiguous strides of axes 2, 1, 0
    return {
        "n1": xd[1],
        "n2": xd[2],
        "ms0": _mul(inner[2], _same(md[0], xd[0])),
        "ms1": _mul(inner[1], _same(md[1], xd[1])),
        "ms2": _mul(inner[0], _same(md[2], xd[2])),
    }


def _aot_launch(op: str, inputs: tuple[Any, ...], ranges: Any, ts: Any, order: Any) -> tuple[Any, ...]:
    """(kernel name, PTX, launch params, int32 scalar args) for one plugin instance."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from plugins.aot import KernelSpec, compile_kernel

    x = inputs[0]
    x_dims = [_value(x.shape_expr[i]) for i in range(x.ndim)]
    n_cols = x_dims[-1]
    spec = KernelSpec(
        op=op,
        dtype=_triton_dtype(trt, x.dtype),
        mask_dtype=_triton_dtype(trt, inputs[1].dtype) if len(inputs) > 1 else None,
        ranges=tuple(float(v) for v in ranges),
        ts=tuple(float(v) for v in ts),
        order=int(order.reshape(-1)[0]),
        n_cols=n_cols if isinstance(n_cols, int) else None,
    )
    kernel = compile_kernel(spec, device_arch())
    n_rows = x.shape_expr.numel() // x.shape_expr[x.ndim - 1]
    values: dict[str, Any] = {"n_rows": n_rows, "n_cols": n_cols}
    if len(inputs) > 1:
        mask = inputs[1]
        values |= mask_row_args(x_dims, [_value(mask.shape_expr[i]) for i in range(mask.ndim)])
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(values[name]) for name in spec.scalar_args])
    launch = trtp.KernelLaunchParams()
    launch.grid_x = trtp.cdiv(n_rows, kernel.config.block_r)
    launch.block_x = kernel.block_threads
    launch.shared_mem = kernel.shared
    return kernel.name, kernel.ptx, launch, extra


def _check_params(ranges: Any, ts: Any, order: Any) -> None:
    if ranges.size != 4 or ts.size != 4:
        raise ValueError(f"MultiMax needs 4 ranges and 4 ts, got {ranges.size} and {ts.size}")
    if order.size != 1 or int(order.reshape(-1)[0]) not in (1, 2):
        raise ValueError(f"MultiMax order must be 1 or 2, got {order}")


@functools.cache
def register() -> None:
    """Register the three plugins with TensorRT (once per process). Needs `tensorrt`, not a GPU."""
    import numpy as np
    import numpy.typing as npt
    import tensorrt.plugin as trtp

    Floats = npt.NDArray[np.float32]
    Ints = npt.NDArray[np.int32]
    if not hasattr(trtp, "aot_impl"):
        import tensorrt as trt

        raise RuntimeError(f"TensorRT {trt.__version__} has no ahead-of-time Python plugins: TensorRT >= 10.9 needed")
    if PLUGIN_VERSION != "1":
        raise RuntimeError(f"tensorrt.plugin creates version 1 plugins only; the exporter writes {PLUGIN_VERSION}")
    AotResult = tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]
    same_types = [trtp.AutoTuneCombination("FP32|FP16, FP32|FP16")]
    # The mask's type is independent of the scores' (an fp32 mask may feed fp16 scores).
    masked_types = [trtp.AutoTuneCombination(f"{a}, {m}, {a}") for a in ("FP32", "FP16") for m in ("FP32", "FP16")]

    @trtp.register(f"{PLUGIN_NAMESPACE}::MultiMax")
    def multimax_desc(
        x: trtp.TensorDesc, mask: trtp.TensorDesc, ranges: Floats, ts: Floats, order: Ints
    ) -> trtp.TensorDesc:
        _check_params(ranges, ts, order)
        return x.like()

    @trtp.autotune(f"{PLUGIN_NAMESPACE}::MultiMax")
    def multimax_autotune(x, mask, outputs) -> list[trtp.AutoTuneCombination]:
        return masked_types

    @trtp.aot_impl(f"{PLUGIN_NAMESPACE}::MultiMax")
    def multimax_aot(
        x: trtp.TensorDesc,
        mask: trtp.TensorDesc,
        ranges: Floats,
        ts: Floats,
        order: Ints,
        outputs: tuple[trtp.TensorDesc],
        tactic: int,
    ) -> AotResult:
        return _aot_launch("MultiMax", (x, mask), ranges, ts, order)

    @trtp.register(f"{PLUGIN_NAMESPACE}::MultiMaxNoMask")
    def nomask_desc(x: trtp.TensorDesc, ranges: Floats, ts: Floats, order: Ints) -> trtp.TensorDesc:
        _check_params(ranges, ts, order)
        return x.like()

    @trtp.autotune(f"{PLUGIN_NAMESPACE}::MultiMaxNoMask")
    def nomask_autotune(x, outputs) -> list[trtp.AutoTuneCombination]:
        return same_types

    @trtp.aot_impl(f"{PLUGIN_NAMESPACE}::MultiMaxNoMask")
    def nomask_aot(
        x: trtp.TensorDesc, ranges: Floats, ts: Floats, order: Ints, outputs: tuple[trtp.TensorDesc], tactic: int
    ) -> AotResult:
        return _aot_launch("MultiMaxNoMask", (x,), ranges, ts, order)

    @trtp.register(f"{PLUGIN_NAMESPACE}::MultiMaxSigma")
    def sigma_desc(x: trtp.TensorDesc, ranges: Floats, ts: Floats, order: Ints) -> trtp.TensorDesc:
        _check_params(ranges, ts, order)
        return x.like()

    @trtp.autotune(f"{PLUGIN_NAMESPACE}::MultiMaxSigma")
    def sigma_autotune(x, outputs) -> list[trtp.AutoTuneCombination]:
        return same_types

    @trtp.aot_impl(f"{PLUGIN_NAMESPACE}::MultiMaxSigma")
    def sigma_aot(
        x: trtp.TensorDesc, ranges: Floats, ts: Floats, order: Ints, outputs: tuple[trtp.TensorDesc], tactic: int
    ) -> AotResult:
        return _aot_launch("MultiMaxSigma", (x,), ranges, ts, order)
