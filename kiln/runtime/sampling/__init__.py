"""Turning logits into tokens: the sampler, its masking stages (token masks, min_tokens, the guided masker
with its grammar compiler and worker process) and prompt logprobs. Imports the core, never the worker or
the engine."""
