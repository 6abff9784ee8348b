"""The `kiln` command line; each subcommand lives in `kiln.commands`."""

from __future__ import annotations

import argparse
import logging
import sys

from kiln.commands import bench, build, evaluate, generate, serve, triton_repo

COMMANDS = (build, generate, evaluate, serve, triton_repo, bench)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Build LLM engines from Hugging Face checkpoints "
                                                              "and run them.")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (default: WARNING)")
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
        print(f"kiln {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
