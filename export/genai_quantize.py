"""int4 weights for the onnxruntime-genai folder export: onnxruntime's `MatMulNBits` (as onnxruntime-genai's
model builder writes them), made from the finished fp32 graph by onnxruntime's `MatMulNBitsQuantizer`.

Every MatMul whose weight is a constant becomes MatMulNBits with 4-bit blocks of 32 along the input dimension,
symmetric, accuracy level 4 (int8 activations in the CPU kernel, as the builder's default for CPU). The
embedding, the attention nodes and the MultiMax nodes stay as they are (no constant MatMul weight); onnxruntime
runs the result on CPU. The folder export quantizes the graph in memory before it is first written
(`quantize_int4_proto`: one copy of the weights, not the fp32 file written, read back and copied).
"""

from __future__ import annotations

import logging

import onnx

BLOCK_SIZE = 32
ACCURACY_LEVEL = 4


def quantize_int4_proto(proto: onnx.ModelProto) -> int:
    """Quantize `proto` in place (no copy of its weights: the quantizer edits the graph it is given); returns how
    many MatMuls became MatMulNBits."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    del proto.graph.value_info[:]  # the quantizer rewrites Gemm as MatMul on transposed weights: stale shapes
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs every node it visits
    try:
        quantizer = MatMulNBitsQuantizer(proto, bits=4, block_size=BLOCK_SIZE, is_symmetric=True,
                                         accuracy_level=ACCURACY_LEVEL, op_types_to_quantize=("MatMul",))
        quantizer.process()
    finally:
        root.setLevel(level)
    assert quantizer.model.model is proto, "MatMulNBitsQuantizer returned a new model"
    return sum(n.op_type == "MatMulNBits" for n in proto.graph.node)

