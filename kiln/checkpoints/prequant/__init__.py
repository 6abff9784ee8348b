"""Pre-quantized Hugging Face checkpoints (ModelOpt, compressed-tensors, FP8 block, AWQ, GPTQ), read exactly
into kiln's quantized engine tensors: `detect.detect_checkpoint_quantization` finds the format, one module
per format reads it."""
