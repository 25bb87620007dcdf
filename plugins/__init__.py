"""Fused MultiMax on GPUs: the Triton kernel and its reference (`kernel`, `reference`), ahead-of-time
compilation (`aot`), the PyTorch custom op (`torch_op`), the TensorRT plugins and engine builder
(`trt_plugin`, `build_engine`) and `python -m plugins.selftest`.

Nothing is imported here: triton and tensorrt load only in the modules that need them.
"""
