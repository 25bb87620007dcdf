"""int4 weights for the onnxruntime-genai folder export: onnxruntime's `MatMulNBits` (as onnxruntime-genai's
model builder writes them), made from the finished fp32 graph by onnxruntime's `MatMulNBitsQuantizer`.

Every MatMul whose weight is a constant becomes MatMulNBits with 4-bit blocks of 32 along the input dimension,
symmetric, accuracy level 4 (int8 activations in the CPU kernel, as the builder's default for CPU). The
embedding, the attention nodes and the MultiMax nodes stay as they are (no constant MatMul weight); onnxruntime
runs the result on CPU. The file keeps its metadata and is rewritten atomically.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from export.onnx_export import save_atomic
from export.precision import copy_without_value_info

BLOCK_SIZE = 32
ACCURACY_LEVEL = 4


def quantize_int4(path: Path) -> int:
    """Quantize the model at `path` in place; returns how many MatMuls became MatMulNBits."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    proto = copy_without_value_info(onnx.load(str(path)))
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs every node it visits
    try:
        quantizer = MatMulNBitsQuantizer(proto, bits=4, block_size=BLOCK_SIZE, is_symmetric=True,
                                         accuracy_level=ACCURACY_LEVEL, op_types_to_quantize=("MatMul",))
        quantizer.process()
    finally:
        root.setLevel(level)
    out = quantizer.model.model
    count = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    save_atomic(out, path)
    return count
