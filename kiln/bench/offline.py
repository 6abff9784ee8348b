"""Offline benchmarks over the Python API: `kiln bench latency` and `kiln bench throughput`.

Prompts are random token ids (seeded), so any engine works, dummy weights included, and no two prompts share
a prefix the cache could reuse; or, with `prompt_text`, windows of a real text (what speculative decoding
needs: random tokens give a proposer nothing to guess). Generation ignores EOS, so every request produces
exactly output_len tokens. With a `BenchLoRA`, requests take its adapters round-robin (kiln/bench/lora.py).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from kiln.bench.lora import NO_LORA, BenchLoRA
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.engine.llm import LLM


@dataclass(frozen=True)
class BenchSpec:
    """What to run. latency: batch 1, `num_iters` timed runs after `warmup` untimed ones. throughput:
    `num_requests` requests queued at once, after an untimed warm-up of up to two batches' worth of short
    requests (`warmup` 0: none)."""

    input_len: int
    output_len: int
    num_requests: int = 1
    num_iters: int = 3
    warmup: int = 1
    seed: int = 0
    prompt_text: str | None = None  # prompts are windows of this text's tokens instead of random tokens

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_requests", "num_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup!r} must be >= 0")


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def text_prompts(token_ids: list[int], count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` tokens at seeded offsets in `token_ids` (a ValueError when it is shorter)."""
    if len(token_ids) < length:
        raise ValueError(f"the prompt text has {len(token_ids)} tokens, fewer than --input-len {length}")
    rng = random.Random(seed)
    starts = [rng.randrange(len(token_ids) - length + 1) for _ in range(count)]
    return [token_ids[s:s + length] for s in starts]


def make_prompts(llm: LLM, spec: BenchSpec, count: int, seed: int) -> list[list[int]]:
    """The benchmark's prompts: random tokens, or windows of `spec.prompt_text`."""
    if spec.prompt_text is None:
        return random_prompts(count, spec.input_len, llm.engine.model_config.vocab_size, seed)
    if llm.tokenizer is None:
        raise ValueError("this engine has no tokenizer: a prompt file needs one")
    return text_prompts(list(llm.tokenizer.encode(spec.prompt_text)), count, spec.input_len, seed)


def _params(spec: BenchSpec, output_len: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=output_len or spec.output_len, temperature=0.0, ignore_eos=True)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def run_latency(llm: LLM, spec: BenchSpec, loras: BenchLoRA = NO_LORA) -> dict:
    """Batch 1: time to first token, decode tokens/s (tokens after the first over the time after it) and
    inter-token latency p50/p99 over all timed iterations. An update that brings several tokens (accepted
    drafts) counts its gap once per token. Iteration i runs `loras`' adapter i (round-robin; warm-up first)."""
    prompts = make_prompts(llm, spec, spec.warmup + spec.num_iters, spec.seed)
    adapters = loras.assign(len(prompts))
    if spec.warmup and loras.adapters:  # read every adapter before the clock starts (LLM reads them in stream)
        llm.generate([prompts[0]] * len(loras.adapters), _params(spec, 1), list(loras.adapters))
    ttfts, decode_rates, itls, totals = [], [], [], []
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        start = time.perf_counter()
        stamps: list[tuple[float, int]] = []  # (time, tokens so far) at each update that added tokens
        for out in llm.stream(prompt, _params(spec), lora_request=adapter):
            if not stamps or len(out.token_ids) > stamps[-1][1]:
                stamps.append((time.perf_counter(), len(out.token_ids)))
        if i < spec.warmup:
            continue
        ttfts.append(stamps[0][0] - start)
        totals.append(stamps[-1][0] - start)
        for (t0, n0), (t1, n1) in zip(stamps, stamps[1:]):
            itls.extend([(t1 - t0) / (n1 - n0)] * (n1 - n0))
        if len(stamps) > 1:
            decode_rates.append((stamps[-1][1] - stamps[0][1]) / (stamps[-1][0] - stamps[0][0]))
    return {
        "ttft_ms": 1000 * statistics.median(ttfts),
        "decode_tokens_per_s": statistics.median(decode_rates) if decode_rates else float("nan"),
        "itl_p50_ms": 1000 * _percentile(itls, 50),
        "itl_p99_ms": 1000 * _percentile(itls, 99),
        "end_to_end_s": statistics.median(totals),
    }


def run_throughput(llm: LLM, spec: BenchSpec, loras: BenchLoRA = NO_LORA) -> dict:
    """`num_requests` requests at once through in-flight batching; output and total tokens per second. Request
    i runs `loras`' adapter i (round-robin)."""
    if spec.warmup:
        # Compiles the kernels of the run's step shapes before the clock starts: prefill steps, full decode
        # batches, and the mixed steps in which a second wave of requests joins the first as it finishes.
        # (One wave of 4 tokens left kernels of mixed steps to compile inside the timed run: on a machine with
        # a cold Triton cache, FP8 128/128 measured 16,956 output tok/s, then 21,128 on the next run.)
        waves = min(spec.num_requests, 2 * llm.engine.runtime.max_batch_size)
        # The warm-up runs the adapters too, so none is read from disk inside the timed run.
        llm.generate(make_prompts(llm, spec, waves, spec.seed + 1), _params(spec, min(spec.output_len, 8)),
                     loras.assign(waves))
    prompts = make_prompts(llm, spec, spec.num_requests, spec.seed)
    adapters = loras.assign(spec.num_requests)
    start = time.perf_counter()
    outputs = llm.generate(prompts, _params(spec), adapters)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    return {
        "elapsed_s": elapsed,
        "requests_per_s": spec.num_requests / elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + spec.num_requests * spec.input_len) / elapsed,
        "output_tokens": generated,
    }


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
