"""The Triton Inference Server model repository: the writer (`kiln triton-repo`), the Python backend model
the server loads, and TensorRT-LLM's request and response tensors. (`triton` alone in kiln names the
kernel language, `plugins/triton_*`.)"""
