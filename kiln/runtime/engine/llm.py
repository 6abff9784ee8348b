"""The Python API: `LLM(engine_dir).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.core.outputs import RequestOutput
from kiln.runtime.core.request_checks import Prompt
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.engine.factory import create_engine
from kiln.runtime.options import RuntimeOptions, runtime_options


def normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A string or a list of token ids is one prompt; a list of those is many."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompt is empty (an empty list is neither a token-id prompt nor a list of prompts)")
    if any(isinstance(t, int) for t in prompts):  # token ids (the engine checks every one of them)
        return [prompts]
    return prompts


def normalize_params(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts; pass one, or one per prompt")
    return params


def normalize_lora_requests(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                            count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} lora_request entries for {count} prompts; pass one, or one per prompt")
    return loras


class LLM:
    """An engine loaded for generation in this process.

    Runtime limits default to what the engine was built with and may only be lowered. `num_kv_blocks`
    defaults to `kv_cache_memory_fraction` of the memory left after the weights and one step's activations
    (on the CPU: up to max_batch_size sequences of max_seq_len). On CUDA, decode steps run as CUDA graphs
    captured at startup unless `cuda_graphs=False`, and each step is scheduled while the one before still runs
    (async scheduling) unless `async_scheduling=False` (True turns it on off CUDA too, for tests).

    Every engine file's size and sha256 are checked against engine.json's manifest; a file's hash is
    computed once per file version and then trusted through a stamp kept outside the engine (see
    `kiln.engine_format.stamps`). `verify_checksums=False` checks sizes only. (Every option: `RuntimeOptions`.)

    `speculative_config` turns on speculative decoding: a `SpeculativeConfig`, or its fields as a dict (vLLM's
    form), e.g. `{"method": "draft_model", "model": DRAFT_ENGINE_DIR, "num_speculative_tokens": 4}` or
    `{"method": "ngram", "num_speculative_tokens": 4, "ngram_max": 4}`; `speculation_stats()` reports acceptance.
    """

    def __init__(self, engine_dir: str | Path, *, options: RuntimeOptions | None = None, **keywords: Any) -> None:
        """`options`: how to run the engine (a RuntimeOptions; None: the defaults); `keywords`: RuntimeOptions'
        field names, set over `options` (`LLM(engine_dir, max_batch_size=8)`); others are a TypeError."""
        self.engine = create_engine(engine_dir, runtime_options(options, keywords, "LLM"))
        self._aborted: list[RequestOutput] = []  # final outputs of abort() calls, for stream() to yield
        self._streamed: set[str] = set()  # requests some stream() is iterating over

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _add_all(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[str]:
        prompt_list = normalize_prompts(prompts)
        params = normalize_params(sampling_params, len(prompt_list))
        loras = normalize_lora_requests(lora_request, len(prompt_list))
        ids: list[str] = []
        try:
            for i, (prompt, p, lora) in enumerate(zip(prompt_list, params, loras)):
                try:
                    ids.append(self.engine.add_request(prompt, p, lora_request=lora))
                except ValueError as e:
                    if len(prompt_list) > 1:
                        raise ValueError(f"prompt {i}: {e}") from None
                    raise
        except BaseException:
            for request_id in ids:  # all or nothing: a bad prompt leaves no request behind
                self.engine.abort(request_id)
            raise
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Runs the prompts to completion with in-flight batching; outputs come in prompt order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model); needs
        enable_lora."""
        ids = self._add_all(prompts, sampling_params, lora_request)
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(ids):
                for out in self.engine.step(final_only=True):
                    final[out.request_id] = out
        except BaseException:
            for request_id in ids:
                if request_id not in final:
                    self.engine.abort(request_id)
            raise
        return [final[i] for i in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> Iterator[RequestOutput]:
        """Yields a cumulative RequestOutput each time a request advances, until all have finished.
        `abort(request_id)` during iteration ends that request; leaving the loop early aborts the rest.
        `lora_request`: as in `generate`."""
        ids = self._add_all(prompts, sampling_params, lora_request)
        pending = set(ids)
        self._streamed |= pending
        try:
            while pending:
                updates, self._aborted = self._aborted + self.engine.step(), []
                for out in updates:
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for request_id in pending:
                self.engine.abort(request_id)
            self._streamed -= set(ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request and frees its KV blocks; returns its final output, or None if it is unknown."""
        out = self.engine.abort(request_id)
        if out is not None and request_id in self._streamed:
            self._aborted.append(out)
        return out

    def kv_cache_stats(self) -> dict[str, int]:
        """{"total_blocks", "free_blocks", ...}: free_blocks counts cached blocks no request uses."""
        return self.engine.kv_cache_stats()

    def reset_prefix_cache(self, device_only: bool = False) -> None:
        """Forgets every cached prefix block no request uses (vLLM's name); `device_only`: the device pool's
        only, so the host tier (kv_offloading_size) serves a repeated prefix."""
        self.engine.block_manager.reset_prefix_cache(device_only)

    def speculation_stats(self) -> dict | None:
        """Speculative decoding's acceptance counters and rates (None when the engine does not speculate)."""
        return self.engine.speculation_stats()

    def lora_stats(self) -> dict[str, int] | None:
        """LoRA adapters' counters (None without enable_lora): slot_loads (adapters put in a device slot, swaps
        included), disk_reads (read on the engine's thread), host_adapters (kept in host memory),
        pinned_adapters (those live requests use, never evicted), device_slots (max_loras)."""
        return self.engine.lora.stats()

    def shutdown(self) -> None:
        """Releases the engine now rather than at exit (a tensor-parallel engine's other ranks stop)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
