"""`kiln bench`: benchmarks (serve: against any OpenAI-compatible server)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark an engine or a server")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    raise ValueError("not implemented yet")
