"""KServe v2 (the Triton Inference Server protocol) over HTTP and gRPC, with TensorRT-LLM's tensor names."""
