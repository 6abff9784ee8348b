"""`kiln triton-repo`: a Triton Inference Server model repository (Python backend) for an engine."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository for an engine")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    raise ValueError("not implemented yet")
