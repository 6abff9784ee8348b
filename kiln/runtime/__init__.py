"""kiln's runtime: load an engine and generate with in-flight batching over a paged KV cache.

The public names load lazily, so `kiln.runtime.core.scheduler` and `kiln.runtime.core.block_manager` (plain
Python) can be imported without pulling in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.runtime.core.guided_decoding import GuidedDecoding
    from kiln.runtime.core.lora_request import LoRARequest
    from kiln.runtime.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from kiln.runtime.core.request_checks import Prompt
    from kiln.runtime.core.sampling_params import SamplingParams
    from kiln.runtime.engine.async_llm import AsyncLLM
    from kiln.runtime.engine.llm import LLM
    from kiln.runtime.options import RuntimeOptions

_PUBLIC = {"LLM": ".engine.llm", "AsyncLLM": ".engine.async_llm", "RequestOutput": ".core.outputs",
           "SamplingParams": ".core.sampling_params", "GuidedDecoding": ".core.guided_decoding",
           "RuntimeOptions": ".options", "Prompt": ".core.request_checks",
           "LoRARequest": ".core.lora_request", "CompletionOutput": ".core.outputs",
           "RequestMetrics": ".core.outputs"}
__all__ = ["LLM", "AsyncLLM", "RequestOutput", "SamplingParams", "GuidedDecoding", "RuntimeOptions", "Prompt",
           "LoRARequest", "CompletionOutput", "RequestMetrics"]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
