"""The runtime options every command that loads an engine takes (generate, serve, eval, bench): one flag per
`RuntimeOptions` field, generated from its fields, so a new option reaches every command by itself."""

from __future__ import annotations

import argparse
import dataclasses

from kiln.runtime.options import RuntimeOptions
from kiln.runtime.speculative import SpeculativeConfig
from kiln.runtime.speculative.config import METHODS

# Flags that set a part of a field rather than the whole of it (speculative_config is built from several).
SPECULATIVE_FLAGS = ("--speculative-model", "--speculative-mode", "--num-speculative-tokens", "--ngram-min",
                     "--ngram-max", "--speculative-eagle-topk", "--speculative-num-draft-tokens")


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """A flag per RuntimeOptions field, dest the field's name: booleans get --X/--no-X (argparse's
    BooleanOptionalAction, e.g. --no-enable-prefix-caching, --no-cuda-graphs), the rest take a value; the
    defaults are the fields'. speculative_config gets the speculative-decoding group."""
    g = p.add_argument_group("runtime")
    for f in dataclasses.fields(RuntimeOptions):
        if f.metadata.get("flags") == "speculative":
            add_speculative_args(p)
            continue
        if "type" in f.metadata:
            g.add_argument(flag_of(f.name), dest=f.name, type=f.metadata["type"], default=f.default,
                           choices=f.metadata.get("choices"), help=_with_default(f.metadata["help"], f.default))
        else:  # a boolean (async_scheduling's None default: on CUDA only)
            g.add_argument(flag_of(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f.metadata["help"])


def _with_default(help: str, default) -> str:
    return help if default is None or "default" in help else f"{help} (default: {default})"


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """The speculative-decoding flags (speculative_config_of_args reads them)."""
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-model", default=None, metavar="DIR",
                   help="a draft kiln engine (same vocabulary) that proposes tokens the engine verifies, or "
                        "with --speculative-mode eagle3 an EAGLE-3 head checkpoint (config.json + safetensors) "
                        "or a head engine (kiln build --speculative-target)")
    s.add_argument("--speculative-mode", default=None, choices=METHODS,
                   help="draft_model or eagle3 (with --speculative-model) or ngram (prompt lookup, no model)")
    s.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed per request per step (default 4)")
    s.add_argument("--ngram-min", type=int, default=1, help="ngram: shortest suffix looked up (default 1)")
    s.add_argument("--ngram-max", type=int, default=4, help="ngram: longest suffix looked up (default 4)")
    s.add_argument("--speculative-eagle-topk", type=int, default=1, metavar="N",
                   help="eagle3: tree drafts, N children per expanded node (default 1: a chain; SGLang's flag)")
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="N",
                   help="eagle3 trees: the nodes verified per step (default K)")


def runtime_options(args: argparse.Namespace) -> RuntimeOptions:
    """The RuntimeOptions the flags above ask for (a ValueError names a bad value or speculative-decoding flag)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RuntimeOptions)
              if f.name != "speculative_config"}
    return RuntimeOptions(**values, speculative_config=speculative_config_of_args(args))


def speculative_config_of_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The SpeculativeConfig add_speculative_args' flags ask for (None: none; a ValueError names a bad flag)."""
    return SpeculativeConfig.from_options(
        speculative_model=args.speculative_model, speculative_mode=args.speculative_mode,
        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        eagle_topk=args.speculative_eagle_topk, num_draft_tokens=args.speculative_num_draft_tokens)
