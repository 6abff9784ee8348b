"""The engine core: one step = schedule, run the model, sample, update requests, decide who finished.

Single-threaded by design; `LLM` drives it from the caller's thread and `AsyncLLM` from a background
thread. Invalid input is rejected in `add_request` before the scheduler sees it, so nothing is allocated.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .engine_loader import LoadedEngine, RuntimeConfig
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .request import Request, RequestStatus
from .sampler import Sampler, SamplingRow
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerLimits

Prompt = str | Sequence[int]


@dataclass(eq=False)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    top_logprobs: list[dict[int, float]] | None = None


class LLMEngine:
    def __init__(self, loaded: LoadedEngine, runtime: RuntimeConfig) -> None:
        self.loaded = loaded
        self.runtime = runtime
        self.model_config = loaded.model_config
        self.tokenizer = loaded.tokenizer
        self.block_manager = BlockManager(runtime.num_kv_blocks, runtime.block_size, runtime.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerLimits(runtime.max_batch_size, runtime.max_num_tokens),
                                   self.block_manager)
        self.runner = ModelRunner(loaded.model, loaded.model_config, device=runtime.device, dtype=runtime.dtype,
                                  num_kv_blocks=runtime.num_kv_blocks, block_size=runtime.block_size,
                                  max_seq_len=runtime.max_seq_len)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(loaded.model_config.eos_token_ids)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Turns a prompt into token ids and checks them; raises ValueError naming the problem."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (none was in the checkpoint): pass token ids")
            token_ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, Sequence):
            token_ids = list(prompt)
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token {i} is {t!r}, outside the vocabulary [0, {vocab})")
        return token_ids

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        total = num_prompt_tokens + params.max_tokens
        if total > self.runtime.max_seq_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_seq_len {self.runtime.max_seq_len}"
            )
        blocks = self.block_manager.blocks_needed(total)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks but the cache has only "
                f"{self.block_manager.num_blocks}; lower max_tokens or give the cache more blocks"
            )

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        self.check_fits(len(token_ids), params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, self.eos_token_ids)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runtime.device)
            generator.manual_seed(params.seed)
        self._tracked[request_id] = _Tracked(
            request=request,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.stop),
            generator=generator,
            logprobs=[] if params.logprobs else None,
            top_logprobs=[] if params.top_logprobs else None,
            prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs else None,
        )
        self.scheduler.add_request(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its KV blocks; returns its final output (None if unknown)."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self._output(tracked)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one batched forward pass; returns an update for every request that produced a token."""
        scheduled = self.scheduler.schedule()
        self.num_preemptions += len(scheduled.preempted_ids)
        if scheduled.is_empty:
            return []
        prompts = {r.request_id: self._tracked[r.request_id].request.prompt_token_ids
                   for r in scheduled.requests if self._tracked[r.request_id].prompt_logprobs is not None}
        result = self.runner.execute(scheduled, prompts)
        for request_id, (first, values) in result.prompt_logprobs.items():
            self._tracked[request_id].prompt_logprobs[first + 1:first + 1 + len(values)] = values
        sampled: dict[str, int] = {}
        logprobs: dict[str, float] = {}
        top: dict[str, list[tuple[int, float]]] = {}
        if result.sample_ids:
            rows = [self._sampling_row(self._tracked[rid]) for rid in result.sample_ids]
            out = self.sampler(result.logits, rows)
            sampled = dict(zip(result.sample_ids, out.token_ids))
            if out.logprobs is not None:
                logprobs = dict(zip(result.sample_ids, out.logprobs))
            if out.top_logprobs is not None:
                top = dict(zip(result.sample_ids, out.top_logprobs))
        self.scheduler.update_after_step(scheduled, sampled)
        outputs = []
        for request_id, token in sampled.items():
            tracked = self._tracked[request_id]
            if tracked.logprobs is not None:
                tracked.logprobs.append(logprobs[request_id])
            if tracked.top_logprobs is not None:
                tracked.top_logprobs.append(dict(top[request_id]))
            status = self._check_finished(tracked, token)
            if status is not None:
                self.scheduler.finish_request(request_id, status)
                del self._tracked[request_id]
            outputs.append(self._output(tracked))
        return outputs

    def _sampling_row(self, tracked: _Tracked) -> SamplingRow:
        r = tracked.request
        return SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, tracked.generator)

    def _check_finished(self, tracked: _Tracked, token: int) -> RequestStatus | None:
        request, params = tracked.request, tracked.request.sampling_params
        # EOS and stop token ids end the request without adding their text.
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if tracked.detokenizer.add_token(token) is not None:
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.runtime.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, tracked: _Tracked) -> RequestOutput:
        r = tracked.request
        finished = r.status.finished
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=list(r.output_token_ids),
            text=tracked.detokenizer.readable_text(finished),
            finish_reason=r.status.value if finished else None,
            logprobs=list(tracked.logprobs) if tracked.logprobs is not None else None,
            top_logprobs=list(tracked.top_logprobs) if tracked.top_logprobs is not None else None,
            prompt_logprobs=list(tracked.prompt_logprobs) if tracked.prompt_logprobs is not None else None,
            num_cached_tokens=r.num_cached_prompt_tokens,
        )

    # ---- introspection -------------------------------------------------------------------------
    def kv_cache_stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "total_blocks": bm.num_blocks,
            "free_blocks": bm.num_free_blocks,
            "cached_blocks": bm.num_cached_blocks,
            "block_size": bm.block_size,
            "prefix_cache_query_tokens": bm.prefix_query_tokens,
            "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.num_preemptions,
        }
