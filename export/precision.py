"""Reduced-precision variants of an export: fp16 weights and activations, or int8 weight matmuls.

fp16 is done at trace time (the model is cast before export; the MultiMax nodes compute in fp32
because the squared terms overflow fp16). int8 is onnxruntime's dynamic quantization of the weight
matmuls on the finished fp32 graph. Inputs and outputs stay float32 in every variant.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Literal

import onnx
import torch

# int4: onnxruntime's MatMulNBits, for the onnxruntime-genai folder export only (export.genai_quantize)
Precision = Literal["fp32", "fp16", "int8", "int4"]
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.float32, "int4": torch.float32}


def quantize_int8(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Dynamic int8 quantization of MatMul/Gemm weights (activations quantized per call)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    proto = copy_without_value_info(proto)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # its "consider pre-processing" advice is printed on every call
    try:
        with tempfile.TemporaryDirectory(prefix="multimax-int8.") as tmp:
            out = Path(tmp) / "int8.onnx"
            quantize_dynamic(proto, out, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"])
            return onnx.load(str(out))
    finally:
        root.setLevel(level)


def copy_without_value_info(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The quantizer rewrites Gemm as MatMul on transposed weights; stale shapes would fail its inference."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    del out.graph.value_info[:]
    return out
