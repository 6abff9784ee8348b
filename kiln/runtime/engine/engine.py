"""The engine core: one step = schedule, run the model, sample, update requests, decide who finished.

Single-threaded by design; `LLM` drives it from the caller's thread and `AsyncLLM` from a background
thread. Invalid input is rejected in `add_request` before the scheduler sees it, so nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import TYPE_CHECKING

from kiln.model_defs.rope_params import rope_switch_length
from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.capacity import capacity_policy
from kiln.runtime.core.lora_request import LoRARequest
from kiln.runtime.core.outputs import RequestOutput
from kiln.runtime.core.request import Request, RequestStatus
from kiln.runtime.core.request_checks import Prompt, check_fits, tokenize_prompt
from kiln.runtime.core.request_failure import RequestFailed
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.core.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from kiln.runtime.engine.beam_stage import BeamStage, check_beam_search, start_beams
from kiln.runtime.engine.extra_outputs import ExtraOutputs
from kiln.runtime.engine.kv_tiers import kv_tiers
from kiln.runtime.engine.launched import Launched, token_feed
from kiln.runtime.engine.lora_admission import LoRAAdmission
from kiln.runtime.engine.text_stage import TextStage
from kiln.runtime.engine.tracked_request import TrackedRequest
from kiln.runtime.sampling.bad_words import WordBans
from kiln.runtime.sampling.min_tokens import apply_min_tokens
from kiln.runtime.sampling.sampler import Sampler
from kiln.runtime.sampling.token_mask import TokenMasker
from kiln.runtime.speculative.speculator import verification_rows
from kiln.runtime.worker.engine_loader import EngineInfo, RuntimeConfig
from kiln.runtime.worker.executor import Executor
from kiln.runtime.worker.memory import MemoryReport
from kiln.runtime.worker.model_step import StepInput

if TYPE_CHECKING:
    from kiln.runtime.sampling.guided_masker import GuidedMasker
    from kiln.runtime.speculative.speculator import Speculator


class LLMEngine:
    """Schedules, samples and detokenizes; the network runs behind `executor` (built by engine_factory).
    `speculator`: drafts tokens for decoding requests, verified in the next step (speculative decoding)."""

    def __init__(self, info: EngineInfo, runtime: RuntimeConfig, executor: Executor,
                 speculator: Speculator | None = None) -> None:
        self.info = info
        self.model_config = info.model_config
        self.tokenizer = info.tokenizer
        self.executor = executor
        self.runtime = runtime = dataclasses.replace(runtime, num_kv_blocks=executor.num_kv_blocks)
        self.block_manager = BlockManager(runtime.num_kv_blocks, runtime.block_size, runtime.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerLimits(runtime.max_batch_size, runtime.max_num_tokens,
                                                   runtime.max_loras if runtime.enable_lora else None,
                                                   rope_switch_length(self.model_config.rope, runtime.max_seq_len)),
                                   self.block_manager,
                                   capacity_policy(runtime.capacity_scheduler_policy, self.block_manager))
        self.sampler = Sampler()
        self.speculator = speculator
        # The sampler's token-mask stage (guided decoding sets it); None: every token may be sampled.
        self.token_masker: TokenMasker | None = None
        # The GuidedMasker, made on the first constrained request (it needs xgrammar). The lock: AsyncLLM
        # compiles constraints off the engine thread, through the same masker.
        self._guided: GuidedMasker | None = None
        self._guided_lock = threading.Lock()
        self.eos_token_ids = frozenset(info.model_config.eos_token_ids)
        self.word_bans = WordBans(self.tokenizer, info.model_config.vocab_size, self.eos_token_ids)  # bad words
        self._tracked: dict[str, TrackedRequest] = {}
        self._ids = itertools.count()
        self._inflight: Launched | None = None
        # Async scheduling: schedule and launch step N+1 before step N's tokens are read back, its input
        # tokens fed from N's samples on the device, so the host's work overlaps the GPU's. On by default
        # where the host and the device run side by side (CUDA); the CPU computes inside the launch, where
        # overlapping would only hold each token back a step.
        overlap = runtime.async_scheduling
        if overlap is None:
            overlap = runtime.device.type == "cuda"
        self.async_scheduling = bool(overlap) and getattr(executor, "accepts_token_feed", False) and \
            speculator is None
        # Tokens read back but not yet turned into text (the next step() does, while the GPU runs).
        self._text = TextStage()
        # Requests ended by a failure of their own since the last step() returned: their final updates.
        self._failed: list[RequestOutput] = []
        self.num_preemptions = 0
        self.beams = BeamStage(self.block_manager, runtime.max_seq_len)  # beam search's part of each step
        # Adapters of LoRA requests: read off the engine thread (AsyncLLM), admitted and pinned here.
        self.lora = LoRAAdmission(executor, runtime, info.model_config)
        self.extras = ExtraOutputs()  # context / generation logits and perf metrics, for the requests that ask
        self.kv_tiers = kv_tiers(self.block_manager, executor, info, runtime)  # host and disk tiers, if any

    @property
    def memory_report(self) -> MemoryReport:
        """Where rank 0's device memory went at startup (each rank alike); says when the weights are dummy ones
        drawn at load."""
        return dataclasses.replace(self.executor.memory_report,
                                   dummy_weights_at_load=self.info.config.build.weights_at_load)

    @property
    def graph_capture_seconds(self) -> float:
        return self.executor.graph_capture_seconds

    @property
    def fault(self) -> str | None:
        """Why the executor cannot run steps any more (a tensor-parallel rank failed), None while it can."""
        return self.executor.fault

    def shutdown(self) -> None:
        """Releases the executor (stops a tensor-parallel engine's other ranks) and a draft model; the engine
        is unusable after."""
        if self.speculator is not None:
            self.speculator.shutdown()
        if self._guided is not None:  # its grammar worker processes
            self._guided.compiler.close()
        self.kv_tiers.close()
        self.executor.shutdown()

    # ---- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Turns a prompt into token ids and checks them; raises ValueError naming the problem."""
        return tokenize_prompt(prompt, self.tokenizer, self.model_config.vocab_size)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises ValueError when a request could never run: longer than max_seq_len or than the KV cache."""
        check_fits(num_prompt_tokens, params, self.runtime.max_seq_len, self.block_manager)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, lora_request: LoRARequest | None = None) -> str:
        """Queues a request; `lora_request`: the LoRA adapter it runs with (None: the base model), read here
        unless already held (`self.lora.admit`: AsyncLLM reads it on a worker thread first), so that an adapter
        that cannot be served is a ValueError naming it before anything is scheduled."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if lora_request is not None:
            self.lora.admit(lora_request)
        token_ids = self.tokenize(prompt)
        params = self.word_bans.prepare(params)  # word lists' token ids checked, stop sequences resolved
        self.check_fits(len(token_ids), params)
        if params.use_beam_search:
            check_beam_search(params, self.info.config.build.max_beam_width, self.runtime, self.speculator)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.guided_decoding is not None:  # compiles it: a bad constraint fails before scheduling
            self.guided_masker().add_request(request_id, params.guided_decoding)
        request = Request(request_id, token_ids, params, self.eos_token_ids,
                          lora_int_id=0 if lora_request is None else lora_request.lora_int_id,
                          beams=start_beams(request_id, params, self.eos_token_ids))
        self._tracked[request_id] = TrackedRequest.start(request, self.tokenizer, self.runtime.device,
                                                         self.runtime.block_size)
        self.extras.add(request)
        self.scheduler.add_request(request)
        self.kv_tiers.probe(request)  # its prefix read from the disk tier first, if it is there
        self.lora.pin(request_id, request.lora_int_id)  # until _release
        return request_id

    def guided_masker(self) -> GuidedMasker:
        """The engine's GuidedMasker (the token masker of guided decoding), made on first use; a ValueError
        when xgrammar is not installed or the engine has no tokenizer. Its compiler may be used from any
        thread; the rest of it belongs to the engine thread."""
        with self._guided_lock:
            if self._guided is None:
                if self.token_masker is not None:
                    raise ValueError("guided_decoding cannot be combined with this engine's own token_masker")
                try:
                    from kiln.runtime.sampling.guided_masker import GuidedMasker
                except ModuleNotFoundError as e:
                    if e.name != "xgrammar":
                        raise
                    raise ValueError("guided_decoding needs xgrammar: pip install xgrammar") from None
                self._guided = self.token_masker = GuidedMasker.for_engine(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
            return self._guided

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its KV blocks; returns its final output (None if unknown)."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self._text.drop(tracked, add_text=True)  # its last tokens' text
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._release(request_id)
        return tracked.output()

    def has_unfinished(self) -> bool:
        """Whether step() has more to do: requests to run, a step in flight, or outputs not yet handed out."""
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._text) or \
            bool(self._failed)

    # ---- one step ------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine iteration, pipelined one step deep: wait for the step in flight and advance its
        requests; schedule and launch the next step; then, while the GPU runs it, turn the finished step's
        tokens into text and outputs. Returns an update for every request that produced a token, or with
        `final_only` for every request that finished (vLLM's FINAL_ONLY: no cumulative copy of each running
        request's tokens, text and logprobs every step, which at batch 256 is host time the GPU waits for).

        A stop string is therefore seen one step late: the request has already been scheduled once more,
        and that extra token is dropped. EOS, stop token ids and max_tokens end a request before the next
        step is scheduled.
        """
        inflight, self._inflight = self._inflight, None
        # Async scheduling: the step in flight is advanced with placeholders for its tokens and read back only
        # after the next one is launched; else it is read back first.
        overlap = inflight is not None and inflight.feeds_forward and self.token_masker is None
        finishing: set[str] = set()
        if overlap:
            finishing = self.scheduler.advance_inflight(inflight.schedule, self.runtime.max_seq_len)
        elif inflight is not None:
            self._complete(inflight)
        self.kv_tiers.poll(lambda: inflight is None and not self.scheduler.running)  # blocks read from disk
        if self.speculator is not None:  # drafts for the decoding requests, verified by the step scheduled next
            self.speculator.propose(self.scheduler.running, lambda rid: self._tracked[rid].sampling_row())
        scheduled = self.scheduler.schedule(finishing)
        self.num_preemptions += len(scheduled.preempted_ids)
        if not scheduled.is_empty:
            self._inflight = self._launch(scheduled, inflight if overlap else None)
        if overlap:
            self._complete(inflight, resolve=True)
        outputs = self._text.emit(final_only, self._stop, self._fail)
        outputs.extend(self.beams.emit(final_only))
        if self._failed:
            outputs.extend(self._failed)
            self._failed = []
        return outputs

    def _launch(self, scheduled: SchedulerOutput, previous: Launched | None = None) -> Launched:
        """Runs the network and queues the sampling of a scheduled step. `previous`: the step still in flight
        whose sampled tokens are this step's PLACEHOLDER inputs (async scheduling)."""
        requests = [self.beams.owner(r.request_id, self._tracked).request for r in scheduled.requests]
        targets = self.extras.targets(scheduled.requests, requests, self._tracked)
        result = self.executor.execute(StepInput(scheduled, targets, token_feed(scheduled, previous)))
        self.extras.store_prompt(result.prompt_logprobs, lambda rid: self.beams.owner(rid, self._tracked))
        offsets = result.logits_offsets
        if offsets[-1] == len(result.request_ids) and all(offsets[i] == i for i in range(len(offsets))):
            row_ids = list(result.request_ids)  # one row each: a decode batch, the common case
            rows = [self.beams.sampling_row(rid, self._tracked) for rid in row_ids]
        else:  # several rows of a request: verified drafts, seen by each row as accepted so far
            row_ids = [rid for i, rid in enumerate(result.request_ids) for _ in result.rows_of(i)]
            rows = verification_rows(scheduled.requests, offsets,
                                     lambda rid: self.beams.sampling_row(rid, self._tracked))
        sample = beams = logit_rows = None
        if row_ids:
            logit_rows = self.extras.copy_generation(result.logits, row_ids,
                                                     lambda rid: self.beams.owner(rid, self._tracked))
            vocab_size, device = result.logits.shape[1], result.logits.device
            mask = None
            if self.token_masker is not None:
                mask = self.token_masker.token_mask(row_ids, rows, vocab_size, device)
                for request_id, failure in self.token_masker.take_failures().items():
                    self._tracked[request_id].failure = failure  # its token is not kept: _complete ends it
            mask = self.word_bans.apply(mask, rows, vocab_size, device)
            mask = apply_min_tokens(mask, rows, self.eos_token_ids, vocab_size, device)
            drafts = None
            if self.speculator is not None:
                drafts = self.speculator.draft_rows(scheduled.requests, offsets, vocab_size, device)
            sample = self.sampler.sample(result.logits, rows, mask, drafts)
            beams = self.beams.launch(result.logits, row_ids, self._tracked)
        feeds_forward = self.async_scheduling and self.token_masker is None and \
            all(offsets[i + 1] - offsets[i] <= 1 for i in range(len(requests))) and \
            not any(r.sampling_params.has_penalties or r.sampling_params.has_word_bans or r.beams for r in requests)
        return Launched(scheduled, result.request_ids, result.logits_offsets, sample, feeds_forward, beams,
                        logit_rows)

    def _complete(self, launched: Launched, resolve: bool = False) -> None:
        """Reads a launched step's tokens back, advances its requests and ends those that hit EOS, a stop
        token id or their length, checking token by token; their text is left for `TextStage.emit`. One pass
        per request: this runs between the GPU's steps, for every request in the batch. `resolve`: the step was
        already advanced (`Scheduler.advance_inflight`), its tokens replace the placeholders."""
        out = launched.sample.to_host() if launched.sample is not None else None
        offsets = launched.logits_offsets
        eos, max_seq_len = self.eos_token_ids, self.runtime.max_seq_len
        accepted: dict[str, list[int]] = {}
        endings: list[tuple[str, RequestStatus]] = []
        for i, request_id in enumerate(launched.request_ids):
            first_row, end_row = offsets[i], offsets[i + 1]
            tracked = self._tracked.get(request_id)
            if first_row == end_row or tracked is None:  # nothing sampled, or ended while the step ran
                continue
            if tracked.failure is not None:  # its row could not be masked: nothing it sampled is kept
                endings.append((request_id, RequestStatus.FINISHED_ERROR))
                continue
            request = tracked.request
            params = request.sampling_params
            num_output, num_tokens = len(request.output_token_ids), request.num_tokens
            if resolve:  # the placeholder stands for this step's token
                num_output, num_tokens = num_output - 1, num_tokens - 1
            # One token per sampled row; with drafts, the tokens up to the first that differs from its draft.
            drafts = launched.schedule.requests[i].draft_token_ids
            if drafts and self.speculator is not None:  # counted; a tree's accepted path comes back as a chain
                drafts = self.speculator.verified(launched.schedule.requests[i], out, first_row)
            row_tokens = out.token_ids[first_row:end_row]
            status, last_adds_text, kept = None, True, end_row - first_row
            for n, token in enumerate(row_tokens, start=1):
                # EOS and stop token ids end the request without adding their text (after min_tokens).
                if ((token in eos and not params.ignore_eos) or token in params.stop_token_ids) \
                        and num_output + n > params.min_tokens:
                    status, last_adds_text = RequestStatus.FINISHED_STOPPED, False
                elif num_output + n >= params.max_tokens or num_tokens + n >= max_seq_len:
                    status = RequestStatus.FINISHED_LENGTH
                if status is not None or (n <= len(drafts) and token != drafts[n - 1]):
                    kept = n
                    break
            tokens = accepted[request_id] = out.token_ids[first_row:first_row + kept]
            for k, token in enumerate(tokens):
                if tracked.logprobs is not None:
                    tracked.logprobs.append(out.logprobs[first_row + k])
                if tracked.top_logprobs is not None:
                    tracked.top_logprobs.append(dict(out.top_logprobs[first_row + k]))
                self._text.add(tracked, token, num_output + k, last_adds_text or k < kept - 1)
            if tracked.generation_logits is not None or tracked.perf is not None:
                tracked.keep_generated(launched.logit_rows, first_row, tokens, drafts)
            if status is not None:
                endings.append((request_id, status))
        endings += self.beams.complete(launched.schedule, launched.beams, self._tracked)
        if resolve:
            self.scheduler.resolve_inflight(launched.schedule, accepted)
        else:
            self.scheduler.update_after_step(launched.schedule, accepted)
        if self.token_masker is not None:
            ending = {request_id for request_id, _ in endings}
            for request_id, tokens in accepted.items():
                # A constraint that has ended (its grammar took EOS under ignore_eos or min_tokens) ends it.
                try:
                    if self.token_masker.accept(request_id, tokens) and request_id not in ending:
                        endings.append((request_id, RequestStatus.FINISHED_STOPPED))
                except RequestFailed as e:
                    self._tracked[request_id].failure = e.failure
                    endings.append((request_id, RequestStatus.FINISHED_ERROR))
        for request_id, status in endings:
            if status == RequestStatus.FINISHED_ERROR:
                self._fail(self._tracked[request_id])
            else:
                self._end(request_id, status)

    def _end(self, request_id: str, status: RequestStatus) -> None:
        """Ends a running request: frees its KV blocks, matcher and drafts."""
        self.scheduler.finish_request(request_id, status)
        del self._tracked[request_id]
        self._release(request_id)

    def _stop(self, request_id: str) -> None:
        """Ends a running request that completed a stop string."""
        self._end(request_id, RequestStatus.FINISHED_STOPPED)

    def _fail(self, tracked: TrackedRequest) -> None:
        """Ends a request whose `failure` is set with finish_reason "error" and queues its final update. A
        running one is ended (`_end`, its tokens not yet turned into text dropped); one that ended within this
        step already (its text failed) only changes its finish reason."""
        request_id = tracked.request.request_id
        if request_id in self._tracked:
            self._text.drop(tracked)
            self._end(request_id, RequestStatus.FINISHED_ERROR)
        else:
            tracked.request.status = RequestStatus.FINISHED_ERROR
        self._failed.append(tracked.output())

    def _release(self, request_id: str) -> None:
        """The one place a request leaves the engine (ended, aborted, failed)."""
        self.lora.release(request_id)
        self.extras.release(request_id)
        if self.token_masker is not None:
            self.token_masker.release(request_id)
        if self.speculator is not None:
            self.speculator.release(request_id)

    # ---- introspection -------------------------------------------------------------------------
    def kv_cache_stats(self) -> dict[str, int | float]:
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
            **self.kv_tiers.stats(),
        }

    def speculation_stats(self) -> dict | None:
        """Speculative decoding's counters and rates (`SpeculationStats.as_dict`); None without speculation."""
        return None if self.speculator is None else self.speculator.stats.as_dict()

