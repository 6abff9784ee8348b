"""kiln: build Hugging Face checkpoints into engines and serve them with in-flight batching."""

__version__ = "0.1.0"
