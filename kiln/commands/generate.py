"""`kiln generate`: complete one prompt, streaming the text to stdout."""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from .flags import field_flags
from .runtime_args import add_runtime_args, runtime_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from an engine",
                       description="Load an engine and complete one prompt, streaming the text to stdout.")
    p.add_argument("--engine", required=True, help="engine directory made by `kiln build`")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    add_runtime_args(p)
    p.set_defaults(run=run, field_flags=field_flags(p))


def run(args: argparse.Namespace) -> int:
    from kiln.runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    start = time.perf_counter()
    llm = LLM(args.engine, options=runtime_options(args))
    loaded = time.perf_counter()
    stream = llm.stream(args.prompt, params)
    first = next(stream, None)  # checks the request (prompt length, max_tokens) before anything is printed
    sys.stdout.write(args.prompt)
    shown = 0
    out = None
    for out in itertools.chain([first] if first is not None else [], stream):
        sys.stdout.write(out.text[shown:])
        sys.stdout.flush()
        shown = len(out.text)
    sys.stdout.write("\n")
    done = time.perf_counter()
    n = len(out.token_ids) if out else 0
    spec = llm.speculation_stats()
    speculation = "" if not spec else (f"; speculative: mean accepted length {spec['mean_accepted_length']:.2f}, "
                                       f"acceptance {spec['acceptance_rate']:.0%}")
    print(f"[{n} tokens, finish_reason={out.finish_reason if out else None}; load {loaded - start:.2f}s, "
          f"generate {done - loaded:.2f}s, {n / max(done - loaded, 1e-9):.1f} tok/s{speculation}]", file=sys.stderr)
    return 0
