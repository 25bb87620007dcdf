"""The reweighting family's custom ops (MultiMax and the other reweighting functions, one registry: `family`):
references (`reference`), ONNX function bodies (`onnx_bodies`, `onnx_functions`), onnxruntime CPU ops (`ort_ops`),
the Triton kernels (`kernel`, `reweight_kernel`) and their ahead-of-time compilation (`aot`), the PyTorch custom op
(`torch_op`), the TensorRT plugins and engine builder (`trt_plugin`, `build_engine`) and `python -m plugins.selftest`.

Nothing is imported here: triton and tensorrt load only in the modules that need them.
"""
