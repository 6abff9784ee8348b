"""kiln's runtime: load an engine and generate with in-flight batching over a paged KV cache."""

from .async_llm import AsyncLLM
from .llm import LLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "RequestOutput", "SamplingParams"]
