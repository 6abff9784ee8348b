"""Reading Hugging Face checkpoints, below both the builder (which converts them) and kiln.quant (whose
pre-quantized formats look into them): `reader.CheckpointReader`, name-addressed tensors of a checkpoint
directory."""
