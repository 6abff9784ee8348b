"""kiln's runtime: load an engine and generate with in-flight batching over a paged KV cache.

The public names load lazily, so `kiln.runtime.scheduler` and `kiln.runtime.block_manager` (plain
Python) can be imported without pulling in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .async_llm import AsyncLLM
    from .guided_decoding import GuidedDecoding
    from .llm import LLM
    from .options import RuntimeOptions
    from .outputs import RequestOutput
    from .sampling_params import SamplingParams

_PUBLIC = {"LLM": ".llm", "AsyncLLM": ".async_llm", "RequestOutput": ".outputs", "SamplingParams": ".sampling_params",
           "GuidedDecoding": ".guided_decoding", "RuntimeOptions": ".options"}
__all__ = ["LLM", "AsyncLLM", "RequestOutput", "SamplingParams", "GuidedDecoding", "RuntimeOptions"]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
