"""Fewer, larger nodes in the shared-buffer decoder graph, where onnxruntime's own optimizer leaves them small.

The traced graph spells RMSNorm as seven elementwise nodes, rotate-half RoPE as a dozen (with the reshapes and
transposes around it) and each projection as its own MatMul: about 540 nodes a decode step on a 12-layer Llama,
most of them on a few hundred numbers, where one kernel launch costs more than the arithmetic. onnxruntime fuses
none of these three shapes. Rewritten, as onnxruntime-genai's own model builder writes them:

- a residual Add and the RMSNorm of its sum (Pow 2, ReduceMean over the last axis, Add eps, Sqrt, Reciprocal, Mul
  by the sum, Mul by the weight; in an fp16 graph the same in fp32 between two Casts) ->
  `com.microsoft::SkipSimplifiedLayerNormalization` (the sum is its fourth output where anything else reads it);
- rotate-half RoPE on (batch, heads, sequence, head) -> `com.microsoft::RotaryEmbedding` over caches of cos and
  sin that the graph's own position subgraph computes for positions 0 .. context-1, so whatever the model does to
  its frequencies (scaling, an attention factor) is in them exactly; a projection reshaped to heads and flattened
  back after the rotation is rotated as it is, without the reshapes and transposes;
- MatMuls of constant weights that read the same input (query/key/value, gate/up) -> one MatMul of the weights
  side by side and a Split: one call instead of two or three (and one MatMulNBits after int4 quantization);
- a Reshape of a Reshape (the values split into heads and merged again) -> one Reshape.

Each rewrite takes only the exact shape it knows and leaves anything else as it was; the folder export's
validation against PyTorch then checks the rewritten graph. Measured on that 12-layer, 32k-vocabulary model
(int4, one decode step, interleaved rounds): 0.81-0.84 of the unfused step's time at one row, 0.93 at 16 rows;
docs/BENCHMARKS.md has the serving figures.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS_DOMAIN = "com.microsoft"
FUSIONS_KEY = "graph_fusions"
COS_CACHE, SIN_CACHE = "rope_cos_cache", "rope_sin_cache"
_RMS_CHAIN = ("ReduceMean", "Add", "Sqrt", "Reciprocal", "Mul")  # after Pow; then (a Cast and) the weight's Mul
_TO_HEADS = [0, 2, 1, 3]  # (B, S, N, H) <-> (B, N, S, H)


@dataclass
class Fusions:
    """How many of each rewrite a graph received (the export's report lists them)."""

    rms_norm: int = 0
    rotary: int = 0
    packed_matmuls: int = 0
    reshapes: int = 0
    why_not_rotary: str = ""
    removed_nodes: int = 0

    def as_dict(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {"SkipSimplifiedLayerNormalization": self.rms_norm, "RotaryEmbedding": self.rotary,
                                     "packed MatMul": self.packed_matmuls,
                                     "Reshape of a Reshape": self.reshapes, "nodes removed": self.removed_nodes}
        if self.why_not_rotary:
            out["rotary left unfused"] = self.why_not_rotary
        return out


class _Graph:
    """Lookups over one graph's nodes: producers, consumers, constant values, node attributes."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.init = {t.name: t for t in graph.initializer}
        self.consts = {n.output[0]: n for n in graph.node if n.op_type == "Constant" and n.output}
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in graph.output}

    def value(self, name: str) -> np.ndarray | None:
        if name in self.init:
            return numpy_helper.to_array(self.init[name])
        node = self.consts.get(name)
        if node is not None and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def scalar(self, name: str) -> float | None:
        v = self.value(name)
        return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None

    def ints(self, name: str) -> list[int] | None:
        v = self.value(name)
        return [int(x) for x in v.reshape(-1)] if v is not None and v.dtype.kind == "i" else None

    def only_user(self, name: str, op_type: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        if len(users) == 1 and users[0].op_type == op_type and name not in self.outputs:
            return users[0]
        return None

    def single_use(self, name: str) -> bool:
        return len(self.consumers.get(name, [])) == 1 and name not in self.outputs

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type else None


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _other(node: onnx.NodeProto, name: str) -> str | None:
    """The input of a two-input node that is not `name` (None if `name` is not one of them)."""
    ins = list(node.input)
    if len(ins) != 2 or name not in ins:
        return None
    return ins[1] if ins[0] == name else ins[0]


# ---- RMSNorm ---------------------------------------------------------------------------------------------------


def _rms_norms(g: _Graph) -> Iterable[tuple[list[onnx.NodeProto], onnx.NodeProto]]:
    """RMSNorms of a residual sum, each with the Add that makes the sum: (the nodes, in graph order, the fused
    node that takes the Add's place). In an fp16/bf16 graph the norm is computed in fp32 between two Casts (the
    model's own fp32 normalisation), which the fused node does inside. A norm of anything else (the embeddings, a
    per-head q/k norm) stays: the unfused norm has no operator of its own the ONNX checker knows (onnxruntime's
    SimplifiedLayerNormalization is in the ONNX domain without an ONNX schema)."""
    for pow_node in g.graph.node:
        if pow_node.op_type != "Pow" or g.scalar(pow_node.input[1]) != 2.0:
            continue
        x, chain = pow_node.input[0], [pow_node]
        for op in _RMS_CHAIN:
            nxt = g.only_user(chain[-1].output[0], op)
            if nxt is None:
                break
            chain.append(nxt)
        else:
            _, mean, add, _, recip, times_x = chain
            cast_out = g.only_user(times_x.output[0], "Cast")
            times_w = g.only_user((cast_out or times_x).output[0], "Mul")
            cast_in = g.made_by(x, "Cast")
            half = cast_out is not None and cast_in is not None and _attr(cast_in, "to") == onnx.TensorProto.FLOAT
            if times_w is None or (cast_out is not None and not half):
                continue
            source = cast_in.input[0] if half and cast_in is not None else x
            eps = g.scalar(_other(add, mean.output[0]) or "")
            weight = _other(times_w, (cast_out or times_x).output[0]) or ""
            axes = g.ints(mean.input[1]) if len(mean.input) > 1 else _attr(mean, "axes")
            scale = g.value(weight)
            residual = g.made_by(source, "Add")
            if (eps is None or scale is None or scale.ndim != 1 or _other(times_x, recip.output[0]) != x
                    or axes != [-1] or _attr(mean, "keepdims", 1) != 1 or residual is None
                    or len(residual.input) != 2 or any(g.value(i) is not None for i in residual.input)):
                continue
            # half: the fp32 copy feeds only the norm, and the norm comes back to the weight's dtype
            if cast_out is not None and (len(g.consumers.get(x, [])) != 2 or x in g.outputs or weight not in g.init
                                         or _attr(cast_out, "to") != g.init[weight].data_type):
                continue
            inside = {id(pow_node), id(times_x), id(cast_in)}
            rest = [u for u in g.consumers.get(source, []) if id(u) not in inside]
            keep_sum = source if rest or source in g.outputs else ""
            fused = helper.make_node("SkipSimplifiedLayerNormalization", [*residual.input, weight],
                                     [times_w.output[0], "", "", keep_sum], domain=MS_DOMAIN, epsilon=eps,
                                     name=f"{times_w.name or times_w.output[0]}/skip_rms_norm")
            casts = [cast_in, cast_out] if half else []
            yield [residual, *chain, *[c for c in casts if c is not None], times_w], fused


# ---- RoPE ------------------------------------------------------------------------------------------------------


@dataclass
class _Rope:
    nodes: list[onnx.NodeProto]
    x: str  # what is rotated: (B, N, S, H), or the projection (B, S, N*H) before its split into heads
    out: str
    cos: str  # the graph's (B, S, H) cos and sin
    sin: str
    half: int  # where rotate-half splits the head: the tables' width must be this


def _half_slice(g: _Graph, node: onnx.NodeProto) -> tuple[int, int] | None:
    """(start, end) of a Slice along the last axis with step 1, else None."""
    if node.op_type != "Slice" or len(node.input) < 4:
        return None
    starts, ends, axes = g.ints(node.input[1]), g.ints(node.input[2]), g.ints(node.input[3])
    steps = g.ints(node.input[4]) if len(node.input) > 4 else [1]
    if starts is None or ends is None or axes not in ([-1], [3]) or steps != [1] or len(starts) != 1:
        return None
    return starts[0], (ends or [0])[0]


def _unsqueezed_on_heads(g: _Graph, name: str) -> str | None:
    node = g.made_by(name, "Unsqueeze")
    return node.input[0] if node is not None and g.ints(node.input[1]) == [1] else None


def _ropes(g: _Graph) -> Iterable[_Rope]:
    for add in g.graph.node:
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        muls = [g.made_by(i, "Mul") for i in add.input]
        if muls[0] is None or muls[1] is None:
            continue
        for by_cos, by_sin in (muls, muls[::-1]):
            assert by_cos is not None and by_sin is not None
            cat = next((g.made_by(i, "Concat") for i in by_sin.input if g.made_by(i, "Concat")), None)
            if cat is None or len(cat.input) != 2 or _attr(cat, "axis") not in (-1, 3):
                continue
            neg = g.made_by(cat.input[0], "Neg")
            low = g.producer.get(cat.input[1])
            high = g.producer.get(neg.input[0]) if neg is not None else None
            if neg is None or low is None or high is None or low.input[0] != high.input[0]:
                continue
            x = low.input[0]
            lo, hi = _half_slice(g, low), _half_slice(g, high)
            if lo is None or hi is None or lo[0] != 0 or lo[1] < 1 or hi[0] != lo[1] or hi[1] < 2 * lo[1]:
                continue
            cos = _unsqueezed_on_heads(g, _other(by_cos, x) or "")
            sin = _unsqueezed_on_heads(g, _other(by_sin, cat.output[0]) or "")
            if cos is None or sin is None:
                continue
            users = g.consumers.get(x, [])
            inner = [by_cos, low, high, neg, cat, by_sin, add]
            if sorted(id(u) for u in users) != sorted(id(u) for u in (by_cos, low, high)) or not all(
                    g.single_use(n.output[0]) for n in inner[:-1]):
                continue
            yield _flattened(g, _Rope(inner, x, add.output[0], cos, sin, lo[1]))
            break


def _flattened(g: _Graph, rope: _Rope) -> _Rope:
    """The rotation taken on the projection itself where it is Reshape (B, S, N, H) -> Transpose to heads before,
    and Transpose back -> Reshape to (B, S, -1) after, with nothing else reading the in-between tensors."""
    to_heads = g.made_by(rope.x, "Transpose")
    split = g.made_by(to_heads.input[0], "Reshape") if to_heads is not None else None
    back = g.only_user(rope.out, "Transpose")
    merge = g.only_user(back.output[0], "Reshape") if back is not None else None
    if (to_heads is None or split is None or back is None or merge is None
            or _attr(to_heads, "perm") != _TO_HEADS or _attr(back, "perm") != _TO_HEADS
            or g.only_user(split.output[0], "Transpose") is None
            or _last_of_shape(g, merge.input[1]) != -1 or _last_of_shape(g, split.input[1]) != 2 * rope.half):
        return rope  # (the head must be all rotated: onnxruntime takes the head size from the tables there)
    return _Rope([split, to_heads, *rope.nodes, back, merge], split.input[0], merge.output[0], rope.cos, rope.sin,
                 rope.half)


def _last_of_shape(g: _Graph, name: str) -> int | None:
    """The last entry of a Reshape's target shape: a constant, or the last (constant) piece of a Concat."""
    whole = g.ints(name)
    if whole:
        return whole[-1]
    cat = g.made_by(name, "Concat")
    last = g.ints(cat.input[-1]) if cat is not None else None
    return last[-1] if last else None


def _position_tables(model: onnx.ModelProto, g: _Graph, cos: str, sin: str, positions: str,
                     context: int) -> tuple[np.ndarray, np.ndarray] | str:
    """cos and sin for positions 0 .. context-1, (context, H/2) each, computed by the graph's own nodes (run by
    onnxruntime), or why not: they must depend on the position ids alone, and repeat their first half."""
    import onnxruntime as ort

    needed: list[onnx.NodeProto] = []
    seen: set[str] = set()
    stack = [cos, sin]
    graph_inputs = {i.name for i in g.graph.input}
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in graph_inputs and name != positions:
            return f"cos/sin read the graph input {name!r}, not the position ids alone"
        node = g.producer.get(name)
        if node is not None:
            needed.append(node)
            stack.extend(node.input)
    order = [n for n in g.graph.node if any(n is k for k in needed)]
    used = {i for n in order for i in n.input}
    sub = helper.make_graph(
        order, "rope_tables", [helper.make_tensor_value_info(positions, onnx.TensorProto.INT64, None)],
        [onnx.ValueInfoProto(name=cos), onnx.ValueInfoProto(name=sin)],
        [g.init[i] for i in sorted(used) if i in g.init])
    proto = helper.make_model(sub, opset_imports=[o for o in model.opset_import if o.domain in ("", MS_DOMAIN)])
    proto.ir_version = model.ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        cos_v, sin_v = session.run(None, {positions: np.arange(context, dtype=np.int64)[None]})
    except Exception as exc:  # any failure leaves the rotation unfused
        return f"cos/sin could not be evaluated alone ({str(exc).splitlines()[0][:200]})"
    if cos_v.ndim != 3 or cos_v.shape[:2] != (1, context) or cos_v.shape != sin_v.shape or cos_v.shape[2] % 2:
        return f"cos/sin have the shape {cos_v.shape}, not (1, {context}, head)"
    half = cos_v.shape[2] // 2
    if not (np.array_equal(cos_v[0, :, :half], cos_v[0, :, half:])
            and np.array_equal(sin_v[0, :, :half], sin_v[0, :, half:])):
        return "cos/sin are not two equal halves (not rotate-half RoPE)"
    return np.ascontiguousarray(cos_v[0, :, :half]), np.ascontiguousarray(sin_v[0, :, :half])


# ---- packed projections ----------------------------------------------------------------------------------------


def _packable(g: _Graph) -> Iterable[list[onnx.NodeProto]]:
    """Groups of two or more MatMuls reading one input with constant 2-D weights of one dtype and row count."""
    for name, users in g.consumers.items():
        group = [u for u in users if u.op_type == "MatMul" and u.input[0] == name and u.input[1] in g.init
                 and len(g.init[u.input[1]].dims) == 2]
        kinds = {(g.init[u.input[1]].data_type, g.init[u.input[1]].dims[0]) for u in group}
        if len(group) >= 2 and len(kinds) == 1:
            yield group


# ---- the pass --------------------------------------------------------------------------------------------------


def fuse_decoder(model: onnx.ModelProto, context: int, positions: str = "position_ids") -> Fusions:
    """Rewrite `model`'s main graph in place (module docstring); returns what was done."""
    done = Fusions()
    replace: dict[int, list[onnx.NodeProto]] = {}  # first node of a group -> what stands in its place
    drop: set[int] = set()
    g = _Graph(model.graph)

    for chain, fused in _rms_norms(g):
        replace[id(chain[0])] = [fused]
        drop.update(id(n) for n in chain)
        done.rms_norm += 1

    ropes = list(_ropes(g))
    pairs = {(r.cos, r.sin) for r in ropes}
    if ropes and len(pairs) == 1 and positions in {i.name for i in g.graph.input}:
        cos, sin = pairs.pop()
        tables = _position_tables(model, g, cos, sin, positions, context)
        if isinstance(tables, str):
            done.why_not_rotary = tables
        elif any(r.half != tables[0].shape[1] for r in ropes):
            done.why_not_rotary = "a rotation splits its head elsewhere than cos/sin's half"
        else:
            model.graph.initializer.extend([numpy_helper.from_array(tables[0], COS_CACHE),
                                            numpy_helper.from_array(tables[1], SIN_CACHE)])
            for i, rope in enumerate(ropes):
                node = helper.make_node("RotaryEmbedding", [rope.x, positions, COS_CACHE, SIN_CACHE], [rope.out],
                                        domain=MS_DOMAIN, interleaved=0, name=f"rotary_embedding_{i}")
                replace[id(rope.nodes[-1])] = [node]
                drop.update(id(n) for n in rope.nodes)
            done.rotary = len(ropes)
    elif ropes:
        done.why_not_rotary = "the rotations read more than one cos/sin pair, or the graph has no position ids"

    for outer in g.graph.node:  # Reshape of a Reshape (the value heads, split and merged again): one Reshape
        inner = g.made_by(outer.input[0], "Reshape") if outer.op_type == "Reshape" else None
        if (inner is None or _attr(outer, "allowzero", 0) != 1 or not g.single_use(inner.output[0])
                or id(inner) in drop or id(outer) in drop):
            continue  # allowzero 1: a 0 in the shape is a 0, not the input's dimension, so the input can change
        replace[id(outer)] = [helper.make_node("Reshape", [inner.input[0], outer.input[1]], list(outer.output),
                                               allowzero=1, name=outer.name)]
        drop.update((id(inner), id(outer)))
        done.reshapes += 1

    for k, group in enumerate(_packable(g)):
        weights = [numpy_helper.to_array(g.init[u.input[1]]) for u in group]
        widths = [w.shape[1] for w in weights]
        base = f"packed_matmul_{k}"
        model.graph.initializer.extend([numpy_helper.from_array(np.concatenate(weights, axis=1), f"{base}.weight"),
                                        numpy_helper.from_array(np.asarray(widths, np.int64), f"{base}.widths")])
        matmul = helper.make_node("MatMul", [group[0].input[0], f"{base}.weight"], [f"{base}.out"], name=base)
        split = helper.make_node("Split", [f"{base}.out", f"{base}.widths"], [u.output[0] for u in group], axis=-1,
                                 name=f"{base}/split")
        replace[id(group[0])] = [matmul, split]  # the first in graph order (consumers are listed so)
        drop.update(id(u) for u in group)
        done.packed_matmuls += len(group)

    if not replace:
        return done
    nodes: list[onnx.NodeProto] = []
    for n in model.graph.node:
        if id(n) in replace:
            nodes.extend(replace[id(n)])
        elif id(n) not in drop:
            nodes.append(n)
    before = len(model.graph.node)
    nodes = _without_dead(nodes, {o.name for o in model.graph.output})
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_unused_initializers(model.graph)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    done.removed_nodes = before - len(model.graph.node)
    return done


def fusion_metadata(done: Fusions) -> dict[str, str]:
    """The model's metadata entry that records the rewrites (read by people and tests, not by the server)."""
    return {FUSIONS_KEY: json.dumps(done.as_dict(), sort_keys=True)}


def _without_dead(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """The nodes some graph output still depends on (the rewrites orphan the cos/sin they replaced)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    live: set[int] = set()
    stack = [producer[o] for o in outputs if o in producer]
    while stack:
        i = stack.pop()
        if i in live:
            continue
        live.add(i)
        stack.extend(producer[x] for x in nodes[i].input if x in producer)
    return [n for i, n in enumerate(nodes) if i in live]


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    """Removed in place, by index: re-extending the field with the kept ones would copy every kept weight (a
    message's `extend` copies), a whole second copy of a large model's weights."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for i in reversed(range(len(graph.initializer))):
        if graph.initializer[i].name not in used:
            del graph.initializer[i]
