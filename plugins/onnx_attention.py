"""The portable ONNX function body of `multimax::MultiMaxAttention`, the decoder attention of a shared-buffer
(onnxruntime-genai `past_present_share_buffer`) export.

    MultiMaxAttention(query, key, value, past_key, past_value, attention_mask) -> output, present_key, present_value

query (batch, sequence, heads*head_dim) and key/value (batch, sequence, kv_heads*head_dim) are the new tokens'
projections (grouped-query attention: query head h reads key/value head h // (heads / kv_heads), as
models.llama's repeat); past_key/past_value (batch, kv_heads, M, head_dim) is the cache: either exactly the past
(M = past length, present = concat) or a buffer of the maximum length (M >= total length) that the new keys are
written into at [past, total), the positions after them kept. attention_mask (batch, total) int64 says which
cached tokens are real (left padding is 0); past = total - sequence. Attention is the GPT's (models.gpt):
scores (q . k) * scale, sigma, then the causal and padding mask (a padding query sees itself), then softmax;
output (batch, sequence, heads*head_dim). Attributes: num_heads, kv_num_heads, scale, the MultiMax
`ranges`/`ts`/`order` and the plugin attributes.

The body copies (Concat/Slice); the fused kernel in plugins/ort_ops writes the new keys in place when the
runtime hands it the same buffer for past and present, which is what makes a decode step's cost independent
of how much of the buffer is used.
"""

from __future__ import annotations

import onnx
from onnx import AttributeProto, TensorProto, helper

from models.onnx_contract import ONNX_DOMAIN, PLUGIN_ATTRIBUTES
from plugins.onnx_bodies import Body

OP = "MultiMaxAttention"
ATTRIBUTES = ("num_heads", "kv_num_heads", "scale", "ranges", "ts", "order", *PLUGIN_ATTRIBUTES)
INPUTS = ["query", "key", "value", "past_key", "past_value", "attention_mask"]
OUTPUTS = ["output", "present_key", "present_value"]
FLOAT32_MIN = -3.4028234663852886e38  # finfo(float32).min: the GPT's additive mask value


def _ref(name: str, value_attr: str, kind: AttributeProto.AttributeType) -> onnx.NodeProto:
    node = helper.make_node("Constant", [], [name])
    node.attribute.append(AttributeProto(name=value_attr, ref_attr_name=name.removesuffix("_c"), type=kind))
    return node


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)],
                                                                                 values))


def _heads(x: str, out: str, shape: str = "shape_bshd") -> list[onnx.NodeProto]:
    """(B, S, H*D) -> (B, H, S, D)."""
    n = helper.make_node
    return [n("Reshape", [x, shape], [out + "_bshd"]), n("Transpose", [out + "_bshd"], [out], perm=[0, 2, 1, 3])]


def _repeat(x: str, out: str) -> list[onnx.NodeProto]:
    """(B, KV, T, D) -> (B, H, T, D): each key/value head serves H / KV consecutive query heads."""
    n = helper.make_node
    return [n("Unsqueeze", [x, "axis2"], [out + "_5d"]), n("Expand", [out + "_5d", "shape_bkgtd"], [out + "_g"]),
            n("Reshape", [out + "_g", "shape_bhtd"], [out])]


def _cache(past: str, new: str, out: str, visible: str) -> list[onnx.NodeProto]:
    """present = past[:, :, :P] ++ new ++ past[:, :, T:]; `visible` = present[:, :, :T]."""
    n = helper.make_node
    return [
        n("Slice", [past, "zero1", "past1", "axis2"], [out + "_head"]),
        n("Slice", [past, "total1", "big1", "axis2"], [out + "_tail"]),
        n("Concat", [out + "_head", new, out + "_tail"], [out], axis=2),
        n("Slice", [out, "zero1", "total1", "axis2"], [visible]),
    ]


def _sigma(scores: str, out: str) -> list[onnx.NodeProto]:
    """MultiMax's modulation of `scores` into `out`, the chain of every MultiMax body (plugins.onnx_bodies)."""
    b = Body(masked=False)
    b.name_output(b.sigma(scores), out)
    return b.nodes


def attention_function_proto(opset: int) -> onnx.FunctionProto:
    n = helper.make_node
    nodes = [
        _ref("num_heads_c", "value_int", AttributeProto.INT),
        _ref("kv_num_heads_c", "value_int", AttributeProto.INT),
        _ref("scale_c", "value_float", AttributeProto.FLOAT),
        _const("zero1", [0]), _const("one1", [1]), _const("two1", [2]), _const("three1", [3]),
        _const("axis2", [2]), _const("big1", [2**62]), _const("axes12", [1, 2]), _const("axes0", [0]),
        _const("axes1", [1]), _const("minus1", [-1]),
        n("Unsqueeze", ["num_heads_c", "axes0"], ["heads1"]),
        n("Unsqueeze", ["kv_num_heads_c", "axes0"], ["kvheads1"]),
        n("Div", ["heads1", "kvheads1"], ["groups1"]),
        n("Shape", ["query"], ["qshape"]),
        n("Slice", ["qshape", "zero1", "one1"], ["batch1"]),
        n("Slice", ["qshape", "one1", "two1"], ["seq1"]),
        n("Slice", ["qshape", "two1", "three1"], ["width1"]),
        n("Div", ["width1", "heads1"], ["dim1"]),
        n("Concat", ["batch1", "seq1", "heads1", "dim1"], ["shape_bshd"], axis=0),
        n("Concat", ["batch1", "seq1", "kvheads1", "dim1"], ["shape_bskd"], axis=0),
        n("Shape", ["attention_mask"], ["mshape"]),
        n("Slice", ["mshape", "one1", "two1"], ["total1"]),
        n("Sub", ["total1", "seq1"], ["past1"]),
        n("Concat", ["batch1", "kvheads1", "groups1", "total1", "dim1"], ["shape_bkgtd"], axis=0),
        n("Concat", ["batch1", "heads1", "total1", "dim1"], ["shape_bhtd"], axis=0),
        *_heads("query", "q"), *_heads("key", "k", "shape_bskd"), *_heads("value", "v", "shape_bskd"),
        *_cache("past_key", "k", "present_key", "kv_keys"),
        *_cache("past_value", "v", "present_value", "kv_values"),
        *_repeat("kv_keys", "keys"), *_repeat("kv_values", "values"),
        n("Transpose", ["keys"], ["keys_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q", "keys_t"], ["qk"]),
        n("Mul", ["qk", "scale_c"], ["scores"]),
        # the GPT's mask (models.gpt.build_attention_mask): key j <= query position, and a real token or itself
        n("Squeeze", ["total1", "axes0"], ["total"]), n("Squeeze", ["past1", "axes0"], ["past"]),
        n("Squeeze", ["one1", "axes0"], ["one"]), n("Squeeze", ["zero1", "axes0"], ["zero"]),
        n("Range", ["zero", "total", "one"], ["kpos"]), n("Range", ["past", "total", "one"], ["qpos"]),
        n("Unsqueeze", ["qpos", "axes1"], ["qcol"]),
        n("LessOrEqual", ["kpos", "qcol"], ["causal"]), n("Equal", ["kpos", "qcol"], ["itself"]),
        n("Cast", ["attention_mask"], ["real"], to=TensorProto.BOOL),
        n("Unsqueeze", ["real", "axes12"], ["real4"]),
        n("Or", ["real4", "itself"], ["seen"]), n("And", ["seen", "causal"], ["allowed"]),
        n("Constant", [], ["open"], value=helper.make_tensor("open", TensorProto.FLOAT, [], [0.0])),
        n("Constant", [], ["shut"], value=helper.make_tensor("shut", TensorProto.FLOAT, [], [FLOAT32_MIN])),
        n("Where", ["allowed", "open", "shut"], ["mask"]),
        *_sigma("scores", "sigma"),
        n("Add", ["sigma", "mask"], ["modulated"]),  # after the modulation, as in every MultiMax body
        n("Softmax", ["modulated"], ["probs"], axis=-1),
        n("MatMul", ["probs", "values"], ["o_bhsd"]),
        n("Transpose", ["o_bhsd"], ["o_bshd"], perm=[0, 2, 1, 3]),
        n("Concat", ["batch1", "seq1", "minus1"], ["shape_bsc"], axis=0),
        n("Reshape", ["o_bshd", "shape_bsc"], ["output"]),
    ]  # fmt: skip
    return helper.make_function(
        ONNX_DOMAIN, OP, INPUTS, OUTPUTS, nodes, [helper.make_opsetid("", opset)], attributes=list(ATTRIBUTES)
    )
