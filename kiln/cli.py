"""The `kiln` command line; each subcommand lives in `kiln.commands`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kiln
from kiln.commands import bench, build, evaluate, generate, serve, triton_repo
from kiln.commands.flags import with_flags

COMMANDS = (build, generate, evaluate, serve, triton_repo, bench)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Build LLM engines from Hugging Face checkpoints "
                                                              "and run them.")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (default: WARNING)")
    parser.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    from kiln.builder.build import BuildError
    from kiln.engine_format import EngineError

    try:
        return args.run(args)
    except (BuildError, EngineError, ValueError) as e:
        kind = getattr(args, "eval_kind", None) or getattr(args, "bench_kind", None)
        name = args.command + (f" {kind}" if kind else "")
        # the runtime names its fields (SamplingParams.top_p); the user typed flags (--top-p)
        print(f"kiln {name}: error: {with_flags(str(e), getattr(args, 'field_flags', {}))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`kiln generate ... | head`): what it wanted it has. Point stdout at /dev/null so
        # that the interpreter's last flush does not fail again, and exit as a pipe writer killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
