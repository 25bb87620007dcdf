"""`python -m export`: checkpoints to validated ONNX with MultiMax as fused custom nodes."""
