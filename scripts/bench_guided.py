"""What guided decoding costs per step, and how long a JSON schema takes to compile, without the model.

    python scripts/bench_guided.py [--tokenizer examples/kiln-tiny-code] [--batch-sizes 1 64] [--steps 200]
        [--schema FILE.json]

Per step, `GuidedMasker.token_mask` (fill xgrammar's bitmask for every constrained row and unpack it into the
[rows, vocab] bool mask) and `accept` (advance each row's matcher past its token) for N rows all constrained
by the default schema (or --schema). Tokens are drawn at random among the allowed ones (not timed), so the matchers walk
through every part of the schema; a matcher that ends starts over. Prints the median and p90 over --steps
timed steps (after 20 untimed ones) and the compile time of the schema: cold (a new compiler, its
TokenizerInfo timed apart) and cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kiln.runtime import GuidedDecoding
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.sampling.grammar_compiler import GrammarCompiler
from kiln.runtime.sampling.guided_masker import GuidedMasker
from kiln.runtime.sampling.sampler import SamplingRow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def bench_steps(compiler: GrammarCompiler, num_rows: int, steps: int, vocab_size: int,
                schema: dict = SCHEMA) -> tuple[list[float], ...]:
    guided = GuidedDecoding(json=schema)
    masker = GuidedMasker(compiler)
    ids = [f"r{i}" for i in range(num_rows)]
    for request_id in ids:
        masker.add_request(request_id, guided)
    rows = [SamplingRow(SamplingParams(), [0], [])] * num_rows
    device = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    mask_times, accept_times = [], []
    for step in range(steps + 20):
        start = time.perf_counter()
        mask = masker.token_mask(ids, rows, vocab_size, device)
        masked = time.perf_counter()
        # A random allowed token per row (the sampler's job; not timed).
        tokens = torch.multinomial(mask.float(), 1, generator=generator).flatten().tolist()
        start_accept = time.perf_counter()
        ended = [request_id for request_id, token in zip(ids, tokens) if masker.accept(request_id, [token])]
        accepted = time.perf_counter()
        if step >= 20:
            mask_times.append(masked - start)
            accept_times.append(accepted - start_accept)
        for request_id in ended:  # a finished request is replaced by a new one
            masker.release(request_id)
            masker.add_request(request_id, guided)
    return mask_times, accept_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=Path("examples/kiln-tiny-code"))
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's (default: the tokenizer's)")
    parser.add_argument("--eos", type=int, nargs="+", default=None, help="EOS ids (default: the tokenizer's)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--schema", type=Path, default=None, help="a JSON schema file (default: a small object schema)")
    args = parser.parse_args()
    schema = json.loads(args.schema.read_text()) if args.schema else SCHEMA

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = args.vocab_size or len(tokenizer)
    eos = args.eos if args.eos is not None else [tokenizer.eos_token_id]
    print(f"tokenizer {args.tokenizer}: vocab {vocab_size}, eos {eos}; torch threads {torch.get_num_threads()}")

    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    info_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(GuidedDecoding(json=schema))
    cold_s = time.perf_counter() - start
    cached = []
    for _ in range(1000):
        start = time.perf_counter()
        compiler.compile(GuidedDecoding(json=schema))
        cached.append(time.perf_counter() - start)
    print(f"TokenizerInfo + compiler: {info_s * 1e3:.1f} ms (once per engine)")
    print(f"schema compile: cold {cold_s * 1e3:.1f} ms, cached {statistics.median(cached) * 1e6:.1f} us "
          f"(median of 1000; the key is built from the schema each time)")

    print(f"{'rows':>5} {'mask ms (med / p90)':>22} {'accept ms (med / p90)':>24} {'per row us':>11}")
    for num_rows in args.batch_sizes:
        mask_times, accept_times = bench_steps(compiler, num_rows, args.steps, vocab_size, schema)
        med_m, med_a = statistics.median(mask_times), statistics.median(accept_times)
        p90_m = statistics.quantiles(mask_times, n=10)[-1]
        p90_a = statistics.quantiles(accept_times, n=10)[-1]
        per_row = (med_m + med_a) / num_rows * 1e6
        print(f"{num_rows:>5} {med_m * 1e3:>10.3f} / {p90_m * 1e3:<9.3f} {med_a * 1e3:>11.3f} / {p90_a * 1e3:<10.3f}"
              f" {per_row:>11.1f}")


if __name__ == "__main__":
    main()
