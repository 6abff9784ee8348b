"""Reading Hugging Face checkpoints, below the builder (which converts them): `reader.CheckpointReader`,
name-addressed tensors of a checkpoint directory, and `prequant/`, the readers of checkpoints already
quantized (ModelOpt, compressed-tensors, FP8 block, AWQ, GPTQ), which map a format's config and tensor
layouts onto kiln's schemes. Of kiln.quant they see only the types they answer in (QuantSpec, QuantError)."""
