"""`kiln eval perplexity`: an engine's perplexity on a text file, through prompt logprobs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .flags import field_flags
from .runtime_args import add_runtime_args, runtime_options
from .text_file import read_text_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate an engine", description="Evaluate an engine.")
    kinds = p.add_subparsers(dest="eval_kind", required=True, metavar="{perplexity}")
    ppl = kinds.add_parser(
        "perplexity", help="perplexity on a text file",
        description="Perplexity of an engine on a UTF-8 text file: exp of the mean negative log-likelihood of "
                    "each token given the tokens before it, computed by the engine's own forward pass. A text "
                    "longer than the engine's max_seq_len - 1 tokens is scored in consecutive windows; each "
                    "window's first token has no context and is not scored.")
    ppl.add_argument("--engine", required=True, help="engine directory made by `kiln build`")
    ppl.add_argument("--text-file", required=True, help="UTF-8 text to score")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    ppl.add_argument("--window", type=int, default=None,
                     help="tokens per window (default and most: the engine's max_seq_len - 1)")
    add_runtime_args(ppl)
    ppl.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ppl.set_defaults(run=run, field_flags=field_flags(ppl, {"window_len": "window"}))


def run(args: argparse.Namespace) -> int:
    from kiln.bench.perplexity import perplexity
    from kiln.runtime import LLM

    path = Path(args.text_file)
    text = read_text_arg(path, "--text-file")
    start = time.perf_counter()
    llm = LLM(args.engine, options=runtime_options(args))
    loaded = time.perf_counter()
    result = perplexity(llm, text, max_tokens=args.max_tokens, window_len=args.window)
    done = time.perf_counter()
    if args.json:
        print(json.dumps({**vars(result), "engine": str(args.engine), "text_file": str(path),
                          "seconds": round(done - loaded, 3)}))
    else:
        print(f"perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.4f} nats/token) over "
              f"{result.num_scored_tokens} scored tokens of {result.num_tokens}, in {result.num_windows} "
              f"window(s) of up to {result.window_len} tokens")
    print(f"[load {loaded - start:.2f}s, score {done - loaded:.2f}s, "
          f"{result.num_tokens / max(done - loaded, 1e-9):.0f} tok/s]", file=sys.stderr)
    return 0
