"""Turns a `GuidedDecoding` into an xgrammar `CompiledGrammar` for one engine's tokenizer, with a cache and a
time limit (one compiler per engine; `guided_masker.py` uses it)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import xgrammar as xgr

from .guided_decoding import GuidedDecoding


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the `guided_decoding` field."""


@dataclass(frozen=True)
class GrammarCompilerConfig:
    """`max_grammar_compile_seconds`: a constraint whose compilation takes longer is refused (GrammarError).
    xgrammar cannot interrupt a compilation, so it runs in a worker thread and the caller stops waiting at
    the limit; the abandoned compilation finishes in the background (at most `max_concurrent_compiles` run
    at once, so slow schemas cannot take every core), and the refusal is cached so the same constraint is
    refused at once next time. The limit counts wall time, so a loaded machine may refuse a schema near it.

    `cache_size`: compiled grammars kept (LRU, keyed by `GuidedDecoding.key()`). `json_any_whitespace`:
    False makes JSON output use fixed separators (`{"a": 1, "b": [2, 3]}`), so a model cannot loop on
    whitespace until max_tokens; True allows any whitespace between tokens of the JSON text.
    """

    max_grammar_compile_seconds: float = 10.0
    cache_size: int = 256
    max_concurrent_compiles: int = 2
    json_any_whitespace: bool = False
    max_threads: int = 8  # xgrammar's own threads per compilation (building the token-mask cache)

    def __post_init__(self) -> None:
        if not self.max_grammar_compile_seconds > 0:
            raise ValueError(f"max_grammar_compile_seconds={self.max_grammar_compile_seconds!r} must be > 0")
        for name in ("cache_size", "max_concurrent_compiles", "max_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GrammarCompilerConfig.{name}={value!r} must be an integer >= 1")


_WHAT = {"json": "invalid JSON schema", "json_object": "cannot compile the JSON grammar",
         "regex": "invalid regex", "grammar": "invalid EBNF grammar", "choice": "cannot compile the choices"}
# xgrammar prefixes its C++ errors with a time and a source location: "[18:01:57] /project/cpp/x.cc:83: ".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompiler:
    """Compiles constraints against one tokenizer: xgrammar's TokenizerInfo is built once, here.

    `vocab_size` is the model's (the logits' width); ids past the tokenizer's vocabulary are never allowed.
    `stop_token_ids` (the engine's EOS ids) are the tokens a matcher allows once the constraint is complete.
    Thread-safe: the engine thread and an asyncio front may compile at once.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 config: GrammarCompilerConfig | None = None) -> None:
        self.config = config or GrammarCompilerConfig()
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids))
        # Our LRU replaces xgrammar's cache, which is keyed differently and unbounded by default.
        self._xgr = xgr.GrammarCompiler(self.tokenizer_info, max_threads=self.config.max_threads,
                                        cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.config.max_concurrent_compiles)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def compile(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        """The compiled grammar of `guided` (cached, failures included); raises GrammarError naming the
        field."""
        key = guided.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            cached = self._compile_with_limit(guided)
            with self._lock:
                self._cache[key] = cached
                self._cache.move_to_end(key)
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, GrammarError):
            raise GrammarError(str(cached))  # a fresh exception: no traceback shared between requests
        return cached

    def _compile_with_limit(self, guided: GuidedDecoding) -> xgr.CompiledGrammar | GrammarError:
        """The grammar, or the GrammarError to remember for this constraint (invalid, or too slow)."""
        limit = self.config.max_grammar_compile_seconds
        deadline = time.monotonic() + limit
        kind = guided.kind
        if not self._slots.acquire(timeout=limit):  # not this constraint's fault: raised, not remembered
            raise GrammarError(f"guided_decoding.{kind}: the grammar compiler is busy with slow constraints; "
                               f"try again later")
        result: list[xgr.CompiledGrammar | GrammarError] = []
        done = threading.Event()

        def work() -> None:
            try:
                result.append(self._compile_now(guided))
            except Exception as e:  # xgrammar raises RuntimeError (and sometimes ValueError) for bad input
                result.append(GrammarError(f"guided_decoding.{kind}: {_WHAT[kind]}: {_xgr_message(e)}"))
            finally:
                self._slots.release()
                done.set()

        # A daemon thread: an abandoned compilation must not hold up the interpreter's exit.
        started = time.monotonic()
        threading.Thread(target=work, name="kiln-grammar-compile", daemon=True).start()
        if done.wait(max(0.0, deadline - time.monotonic())):
            return result[0]
        if time.monotonic() - started < limit:  # part of the time went waiting for a slot: do not remember
            raise GrammarError(f"guided_decoding.{kind}: the grammar compiler is busy with slow constraints; "
                               f"try again later")
        return GrammarError(f"guided_decoding.{kind}: the constraint took longer than {limit:g} s to compile "
                            f"(max_grammar_compile_seconds); simplify it")

    def _compile_now(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        kind, ws = guided.kind, self.config.json_any_whitespace
        if kind == "json":
            return self._xgr.compile_json_schema(guided.schema_text(), any_whitespace=ws)
        if kind == "json_object":
            # xgrammar's builtin JSON grammar also allows a top-level array; a non-strict object schema is
            # exactly "any JSON object" (any keys, any values).
            return self._xgr.compile_json_schema('{"type": "object"}', any_whitespace=ws, strict_mode=False)
        if kind == "regex":
            return self._xgr.compile_regex(guided.regex)
        if kind == "grammar":
            return self._xgr.compile_grammar(guided.grammar)
        # JSON string escapes are valid EBNF string literals in xgrammar's dialect.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in guided.choice)
        return self._xgr.compile_grammar(f"root ::= {alternatives}")


def _xgr_message(e: Exception) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _LOCATION.sub("", lines[0]) if lines else type(e).__name__
