"""Launching, once, every kernel an engine launches when it starts and in its first stretch of serving.

`kiln build --device cuda` runs this module in a child process with an empty Triton cache
(`python -m kiln.runtime.engine.kernel_warmup ENGINE --device cuda:N`) and stores what Triton compiled into the engine
(builder/kernel_store.py). Starting the engine does what every start does (the activation profile at the
limits, every decode and prefill CUDA graph size); `warm_up` then runs the steps that graphs do not cover:
single prompts of every prefill size and longer (chunked), packed batches of many sequence counts and
prompt lengths (the kernels' tile sizes follow tokens per step and per sequence), a burst of mixed prefill and
decode steps like a throughput run's, and each sampling feature (penalties, top-k/p, min-p, logprobs).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.engine.llm import LLM
from kiln.runtime.worker.prefill_graphs import prefill_sizes

logger = logging.getLogger("kiln.runtime")

_SEQ_COUNTS = (2, 3, 4, 8, 16, 64, 256, 1024)
# Tokens per sequence: the attention tiles follow them, and the longest block table's width (a kernel argument
# that Triton specializes when it is 1 or a multiple of 16) follows the longest prompt: 250 and 500 tokens fill
# 16 and 32 blocks of 16.
_TOKENS_PER_SEQ = (1, 2, 3, 5, 9, 17, 40, 130, 250, 500)


def _params(i: int, max_tokens: int) -> SamplingParams:
    """The i-th of the sampling setups serving sees: greedy, top-k/top-p with a seed, min-p with penalties,
    logprobs."""
    kinds = (dict(temperature=0.0),
             dict(temperature=0.8, top_p=0.9, top_k=40, seed=i),
             dict(temperature=1.0, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2),
             dict(temperature=0.7, logprobs=True, top_logprobs=5))
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kinds[i % len(kinds)])


def warm_up(llm: LLM) -> int:
    """Runs the warm-up workload on a started engine within its limits; returns how many requests it ran."""
    runtime = llm.engine.runtime
    vocab = llm.engine.model_config.vocab_size
    batch, step_tokens, seq_len = runtime.max_batch_size, runtime.max_num_tokens, runtime.max_seq_len
    longest = seq_len - 4  # room for the outputs
    if longest < 4:
        return 0

    def prompt(n: int, salt: int) -> list[int]:
        return [(7 * i + 13 * salt) % (vocab - 3) + 3 for i in range(n)]

    count = 0

    def run(prompts: list[list[int]], max_tokens: int, salt: int = 0, **extra) -> None:
        nonlocal count
        params = [_params(salt + i, max_tokens) for i in range(len(prompts))]
        if extra:
            params = [dataclasses.replace(p, **extra) for p in params]
        llm.generate(prompts, params)
        count += len(prompts)

    # One sequence: every prefill graph size and the sizes around it, a whole step, a chunked prompt.
    singles = {1, 2, 3, 17, *prefill_sizes(step_tokens), 600, step_tokens, step_tokens + step_tokens // 2 + 7}
    for n in sorted(s for s in singles if s <= longest):
        run([prompt(n, n)], 3, salt=n)
    # Packed batches: sequences x tokens each, within a few steps.
    for seqs in (s for s in _SEQ_COUNTS if s <= batch):
        for per_seq in (t for t in _TOKENS_PER_SEQ if t <= longest and seqs * t <= 4 * step_tokens):
            run([prompt(per_seq + i % 3 if per_seq + 2 <= longest else per_seq, i) for i in range(seqs)], 3)
    # A throughput run's mixture: requests joining while others decode, of many lengths.
    burst = min(2 * batch, 2048)
    lengths = [1 + (37 * i) % max(1, min(256, longest)) for i in range(burst)]
    prompts = [prompt(n, i) for i, n in enumerate(lengths)]
    params = [_params(i, 1 + (11 * i) % min(24, seq_len - n)) for i, n in enumerate(lengths)]
    llm.generate(prompts, params)
    count += burst
    # Logprobs of every prompt position (an eager step with logits for all its tokens).
    run([prompt(min(50, longest), 5)], 2, prompt_logprobs=True, prompt_top_logprobs=2)
    return count + mixed_steps(llm, prompt)


def mixed_steps(llm: LLM, prompt) -> int:
    """Steps that mix prompts of many lengths into sequences decoding at contexts whose block tables are 1, 9 and
    16 blocks wide, as a server's steps do when requests arrive while others decode: the attention's tile follows
    tokens per sequence, and Triton specializes the table's width (a kernel argument) when it is 1 or a multiple
    of 16. `prompt(n, salt)` makes a prompt of n tokens. Returns how many requests it ran."""
    engine, runtime = llm.engine, llm.engine.runtime
    decoders = max(1, min(16, runtime.max_batch_size // 2))
    newcomers = max(1, min(decoders, runtime.max_batch_size - decoders))
    lengths = [n for n in (3, 8, 16, 24, 48, 128, 256)
               if decoders + newcomers * n <= runtime.max_num_tokens and n < runtime.max_seq_len]
    count = 0
    for blocks in (1, 9, 16):
        start = (blocks - 1) * runtime.block_size + 1  # the shortest context of a table this wide
        max_tokens = 3 * len(lengths) + 4  # the decoders outlive every case
        if start + max_tokens > runtime.max_seq_len:
            continue
        ids = [engine.add_request(prompt(start, 1000 + i), _params(i, max_tokens)) for i in range(decoders)]
        _step_until(engine, set(ids), final_only=False)  # their prompts' step
        for n in lengths:
            _step_until(engine, {engine.add_request(prompt(n, 2000 + j), _params(j, 1)) for j in range(newcomers)},
                        final_only=True)
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
        count += decoders + newcomers * len(lengths)
    return count


def _step_until(engine, waiting: set[str], *, final_only: bool) -> None:
    """Steps until every request in `waiting` has an output (final_only: has finished)."""
    for _ in range(10_000):  # a few steps; the bound only turns a scheduling bug into an error, not a hang
        if not waiting:
            return
        waiting = waiting - {out.request_id for out in engine.step(final_only=final_only) if out.token_ids}
    raise RuntimeError(f"kernel warm-up: requests {sorted(waiting)[:3]} made no progress in 10000 steps")


@contextmanager
def count_compiles() -> Iterator[list[str]]:
    """Within the block, the names of the kernels Triton compiles (cache misses; Triton 3.4+), in order."""
    from triton import knobs

    compiled: list[str] = []

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        if not cache_hit:
            compiled.append(metadata.get("name", "?"))

    before, knobs.compilation.listener = knobs.compilation.listener, listener
    try:
        yield compiled
    finally:
        knobs.compilation.listener = before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.runtime.engine.kernel_warmup", description=__doc__.split("\n")[0])
    parser.add_argument("engine", help="engine directory")
    parser.add_argument("--device", default="cuda", help="device to run on (default: cuda)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    with count_compiles() as compiled:
        llm = LLM(args.engine, device=args.device, verify_checksums=False)
        started = time.perf_counter()
        requests = warm_up(llm)
    llm.shutdown()
    print(f"kernel warm-up: engine started in {started - start:.1f}s, then {requests} requests in "
          f"{time.perf_counter() - started:.1f}s; Triton compiled {len(compiled)} kernels", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
