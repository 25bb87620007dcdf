"""TensorRT plugins for the `multimax` ONNX nodes, via TensorRT's Python plugin API.

`register()` (lazy: this module imports without TensorRT) registers one plugin per op type of the
reweighting family (plugins.family: "multimax::MultiMax", "multimax::MultiMaxNoMask", "multimax::MultiMaxSigma",
"multimax::SparseMax", "multimax::SparseMaxNoMask", ...) with `tensorrt.plugin`, all through one path: the op
type, the `plugin_namespace` ("multimax") and `plugin_version` ("1", the only version the Python API creates)
that the exporter writes on each node. Each has an ahead-of-time implementation only: at engine build time it
compiles the member's Triton kernel (plugins.aot.KernelSpec) for the build GPU and hands TensorRT the PTX, so
engines run without Python (trtexec, C++). The node attributes (MultiMax's parameters; k, eps, m and per-head
offset/scale) are constants of that PTX.

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

from models.onnx_contract import ONNX_DOMAIN, PLUGIN_VERSION, multimax_op_types, reweighting_op_types

PLUGIN_NAMESPACE = ONNX_DOMAIN
PLUGIN_OPS = multimax_op_types()
REWEIGHTING_PLUGIN_OPS = reweighting_op_types()
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


def spec_args(op: str, attrs: dict[str, Any], x_dims: list[Any]) -> dict[str, Any]:
    """plugins.aot.KernelSpec's attribute fields from a node's attributes (numpy arrays, as the parser hands them):
    ranges/ts as tuples and order; k, eps, m as scalars; offset/scale as tuples, checked against the heads (axis 1)."""
    out: dict[str, Any] = {}
    if "ranges" in attrs:
        ranges, ts, order = attrs["ranges"], attrs["ts"], attrs["order"]
        if ranges.size != 4 or ts.size != 4:
            raise ValueError(f"MultiMax needs 4 ranges and 4 ts, got {ranges.size} and {ts.size}")
        if order.size != 1 or int(order.reshape(-1)[0]) not in (1, 2):
            raise ValueError(f"MultiMax order must be 1 or 2, got {order}")
        out["ranges"], out["ts"] = (tuple(float(v) for v in attrs[n].reshape(-1)) for n in ("ranges", "ts"))
        out["order"] = int(order.reshape(-1)[0])
    if "k" in attrs:
        out["k"] = int(attrs["k"].reshape(-1)[0])
    for name in ("eps", "m"):
        if name in attrs:
            out[name] = float(attrs[name].reshape(-1)[0])
    if "offset" in attrs:
        offset, scale = (tuple(float(v) for v in attrs[n].reshape(-1)) for n in ("offset", "scale"))
        if len(offset) > 1:
            heads = x_dims[1] if len(x_dims) == 4 else None
            if isinstance(heads, int) and heads != len(offset):
                raise ValueError(f"{op}: {len(offset)} per-head values for {heads} heads (axis 1)")
            if len(x_dims) != 4:
                raise ValueError(f"{op}: per-head values need a rank-4 input (batch, heads, q, k)")
        out["offset"], out["scale"] = offset, scale
    return out


def _launch(op: str, inputs: tuple[Any, ...], attrs: dict[str, Any]) -> tuple[Any, ...]:
    """(kernel name, PTX, launch params, int32 scalar args) for one plugin instance: compile the op's KernelSpec
    for the build GPU and describe its launch: one program per BLOCK_R rows, the int32 scalars in the spec's order
    (symbolic where the axes are dynamic)."""
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
        n_cols=n_cols if isinstance(n_cols, int) else None,
        **spec_args(op, attrs, x_dims),
    )
    kernel = compile_kernel(spec, device_arch())
    n_rows = x.shape_expr.numel() // x.shape_expr[x.ndim - 1]
    values: dict[str, Any] = {"n_rows": n_rows, "n_cols": n_cols}
    if len(inputs) > 1:
        mask = inputs[1]
        values |= mask_row_args(x_dims, [_value(mask.shape_expr[i]) for i in range(mask.ndim)])
    if x.ndim == 4 and spec.per_head:  # per-head parameters: rows of one head are the q axis, heads axis 1
        values |= {"rows_per_head": x_dims[2], "heads": x_dims[1]}
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(values[name]) for name in spec.scalar_args])
    launch = trtp.KernelLaunchParams()
    launch.grid_x = trtp.cdiv(n_rows, kernel.config.block_r)
    launch.block_x = kernel.block_threads
    launch.shared_mem = kernel.shared
    return kernel.name, kernel.ptx, launch, extra


@functools.cache
def register() -> None:
    """Register a plugin per op type of the reweighting family with TensorRT (once per process). Needs `tensorrt`,
    not a GPU."""
    import tensorrt.plugin as trtp

    from plugins.family import MEMBERS

    if not hasattr(trtp, "aot_impl"):
        import tensorrt as trt

        raise RuntimeError(f"TensorRT {trt.__version__} has no ahead-of-time Python plugins: TensorRT >= 10.9 needed")
    if PLUGIN_VERSION != "1":
        raise RuntimeError(f"tensorrt.plugin creates version 1 plugins only; the exporter writes {PLUGIN_VERSION}")
    same_types = [trtp.AutoTuneCombination("FP32|FP16, FP32|FP16")]
    # The mask's type is independent of the scores' (an fp32 mask may feed fp16 scores).
    masked_types = [trtp.AutoTuneCombination(f"{a}, {m}, {a}") for a in ("FP32", "FP16") for m in ("FP32", "FP16")]
    for member in MEMBERS.values():
        for op in member.op_types:
            masked = member.takes_mask(op)
            _register(op, member.attributes, masked, masked_types if masked else same_types)


def _register(op: str, attrs: tuple[str, ...], masked: bool, types: list[Any]) -> None:
    """One op's plugin: its description, type combinations and ahead-of-time implementation.

    The API reads each function's signature to know the plugin's inputs and attributes (and passes the attributes
    to `aot_impl` positionally, in declaration order), so every attribute set of the contract's FAMILY_ATTRIBUTES
    has its own explicit signatures below: none, (ranges, ts, order), (k), (offset, scale), (eps, m), each with
    inputs (x, mask) or (x). Their shared bodies check the attributes when TensorRT builds the network and
    compile the kernel at AOT time.
    """
    import numpy as np
    import numpy.typing as npt
    import tensorrt.plugin as trtp

    F = npt.NDArray[np.float32]
    Ints = npt.NDArray[np.int32]
    Out = tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]
    name = f"{PLUGIN_NAMESPACE}::{op}"

    def describe(x: Any, values: dict[str, Any]) -> Any:
        spec_args(op, values, [_value(x.shape_expr[i]) for i in range(x.ndim)])  # raises on bad values
        return x.like()

    def launch(inputs: tuple[Any, ...], values: dict[str, Any]) -> Any:
        return _launch(op, inputs, values)

    def d_m(x: trtp.TensorDesc, mask: trtp.TensorDesc) -> trtp.TensorDesc:
        return describe(x, {})

    def a_m(x: trtp.TensorDesc, mask: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc], tactic: int) -> Out:
        return launch((x, mask), {})

    def d_mr(x: trtp.TensorDesc, mask: trtp.TensorDesc, ranges: F, ts: F, order: Ints) -> trtp.TensorDesc:
        return describe(x, {"ranges": ranges, "ts": ts, "order": order})

    def a_mr(
        x: trtp.TensorDesc, mask: trtp.TensorDesc, ranges: F, ts: F, order: Ints, outputs: tuple[trtp.TensorDesc],
        tactic: int,
    ) -> Out:
        return launch((x, mask), {"ranges": ranges, "ts": ts, "order": order})

    def d_mk(x: trtp.TensorDesc, mask: trtp.TensorDesc, k: Ints) -> trtp.TensorDesc:
        return describe(x, {"k": k})

    def a_mk(x: trtp.TensorDesc, mask: trtp.TensorDesc, k: Ints, outputs: tuple[trtp.TensorDesc], tactic: int) -> Out:
        return launch((x, mask), {"k": k})

    def d_mo(x: trtp.TensorDesc, mask: trtp.TensorDesc, offset: F, scale: F) -> trtp.TensorDesc:
        return describe(x, {"offset": offset, "scale": scale})

    def a_mo(
        x: trtp.TensorDesc, mask: trtp.TensorDesc, offset: F, scale: F, outputs: tuple[trtp.TensorDesc], tactic: int
    ) -> Out:
        return launch((x, mask), {"offset": offset, "scale": scale})

    def d_me(x: trtp.TensorDesc, mask: trtp.TensorDesc, eps: F, m: F) -> trtp.TensorDesc:
        return describe(x, {"eps": eps, "m": m})

    def a_me(
        x: trtp.TensorDesc, mask: trtp.TensorDesc, eps: F, m: F, outputs: tuple[trtp.TensorDesc], tactic: int
    ) -> Out:
        return launch((x, mask), {"eps": eps, "m": m})

    def d_n(x: trtp.TensorDesc) -> trtp.TensorDesc:
        return describe(x, {})

    def a_n(x: trtp.TensorDesc, outputs: tuple[trtp.TensorDesc], tactic: int) -> Out:
        return launch((x,), {})

    def d_nr(x: trtp.TensorDesc, ranges: F, ts: F, order: Ints) -> trtp.TensorDesc:
        return describe(x, {"ranges": ranges, "ts": ts, "order": order})

    def a_nr(x: trtp.TensorDesc, ranges: F, ts: F, order: Ints, outputs: tuple[trtp.TensorDesc], tactic: int) -> Out:
        return launch((x,), {"ranges": ranges, "ts": ts, "order": order})

    def d_nk(x: trtp.TensorDesc, k: Ints) -> trtp.TensorDesc:
        return describe(x, {"k": k})

    def a_nk(x: trtp.TensorDesc, k: Ints, outputs: tuple[trtp.TensorDesc], tactic: int) -> Out:
        return launch((x,), {"k": k})

    def d_no(x: trtp.TensorDesc, offset: F, scale: F) -> trtp.TensorDesc:
        return describe(x, {"offset": offset, "scale": scale})

    def a_no(x: trtp.TensorDesc, offset: F, scale: F, outputs: tuple[trtp.TensorDesc], tactic: int) -> Out:
        return launch((x,), {"offset": offset, "scale": scale})

    def d_ne(x: trtp.TensorDesc, eps: F, m: F) -> trtp.TensorDesc:
        return describe(x, {"eps": eps, "m": m})

    def a_ne(x: trtp.TensorDesc, eps: F, m: F, outputs: tuple[trtp.TensorDesc], tactic: int) -> Out:
        return launch((x,), {"eps": eps, "m": m})

    def tune_m(x: trtp.TensorDesc, mask: trtp.TensorDesc, outputs: Any) -> list[Any]:
        return types

    def tune_n(x: trtp.TensorDesc, outputs: Any) -> list[Any]:
        return types

    kind = {(): "", ("ranges", "ts", "order"): "r", ("k",): "k", ("offset", "scale"): "o", ("eps", "m"): "e"}[attrs]
    functions: dict[str, tuple[Any, Any]] = {
        "m": (d_m, a_m), "mr": (d_mr, a_mr), "mk": (d_mk, a_mk), "mo": (d_mo, a_mo), "me": (d_me, a_me),
        "n": (d_n, a_n), "nr": (d_nr, a_nr), "nk": (d_nk, a_nk), "no": (d_no, a_no), "ne": (d_ne, a_ne),
    }  # fmt: skip
    desc, aot = functions[("m" if masked else "n") + kind]
    trtp.register(name)(desc)
    trtp.autotune(name)(tune_m if masked else tune_n)
    trtp.aot_impl(name)(aot)
