"""Turns a `GuidedDecoding` into an xgrammar `CompiledGrammar` for one engine's tokenizer, with size limits, a
cache and a time limit enforced in killable worker processes (one compiler per engine; `guided_masker.py` uses
it)."""

from __future__ import annotations

import json
import re
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import xgrammar as xgr

from kiln.runtime.core.guided_decoding import GuidedDecoding
from kiln.runtime.sampling.grammar_worker import WorkerPool, WorkerUnavailable, compile_source


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the `guided_decoding` field."""


@dataclass(frozen=True)
class GrammarCompilerConfig:
    """How the compiler guards the server against costly constraints.

    `max_grammar_compile_seconds`: a constraint whose compilation takes longer is refused (GrammarError), and
    the refusal is cached so the same constraint is refused at once next time. xgrammar cannot interrupt a
    compilation, so it runs in a worker process (`grammar_worker.py`) that is killed at the limit: nothing keeps
    running after the client got its error. At most `max_concurrent_compiles` compilations run at once (so slow
    schemas cannot take every core); a constraint that waits longer than the limit for one is refused as "busy"
    (not cached). The limit counts wall time, so a loaded machine may refuse a schema near it. An accepted
    constraint is compiled once more in this process (cheaper than moving the result, see grammar_worker.py).

    Size limits, checked before anything is compiled (a GrammarError naming the field, the size and the limit).
    The defaults are far above what clients of vLLM or SGLang send (schemas of a few KB, tens of choices); the
    time limit still guards against small constraints that are slow to compile:
    `max_choices` (10,000) and `max_choice_chars` (250,000: all choices together) for `choice`;
    `max_json_schema_chars` (100,000: the schema as compact JSON), `max_json_schema_depth` (64: nesting of
    objects and arrays in the schema document, about 30 levels of nested objects in the output) and
    `max_json_schema_properties` (5,000: entries of every `properties` object, `$defs` included) for `json`;
    `max_regex_chars` (10,000) for `regex`; `max_grammar_chars` (100,000) for `grammar`.

    `cache_size`: compiled grammars kept (LRU, keyed by `GuidedDecoding.key()`). `json_any_whitespace`:
    False makes JSON output use fixed separators (`{"a": 1, "b": [2, 3]}`), so a model cannot loop on
    whitespace until max_tokens; True allows any whitespace between tokens of the JSON text.
    """

    max_grammar_compile_seconds: float = 10.0
    cache_size: int = 256
    max_concurrent_compiles: int = 2
    json_any_whitespace: bool = False
    max_threads: int = 8  # xgrammar's own threads per compilation (building the token-mask cache)
    max_choices: int = 10_000
    max_choice_chars: int = 250_000
    max_json_schema_chars: int = 100_000
    max_json_schema_depth: int = 64
    max_json_schema_properties: int = 5_000
    max_regex_chars: int = 10_000
    max_grammar_chars: int = 100_000

    def __post_init__(self) -> None:
        if not self.max_grammar_compile_seconds > 0:
            raise ValueError(f"max_grammar_compile_seconds={self.max_grammar_compile_seconds!r} must be > 0")
        for name in ("cache_size", "max_concurrent_compiles", "max_threads", *_SIZE_LIMITS):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GrammarCompilerConfig.{name}={value!r} must be an integer >= 1")


_SIZE_LIMITS = ("max_choices", "max_choice_chars", "max_json_schema_chars", "max_json_schema_depth",
                "max_json_schema_properties", "max_regex_chars", "max_grammar_chars")

_WHAT = {"json": "invalid JSON schema", "json_object": "cannot compile the JSON grammar",
         "regex": "invalid regex", "grammar": "invalid EBNF grammar", "choice": "cannot compile the choices"}
# xgrammar prefixes its C++ errors with a time and a source location: "[18:01:57] /project/cpp/x.cc:83: ".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompiler:
    """Compiles constraints against one tokenizer: xgrammar's TokenizerInfo is built once, here.

    `vocab_size` is the model's (the logits' width); ids past the tokenizer's vocabulary are never allowed.
    `stop_token_ids` (the engine's EOS ids) are the tokens a matcher allows once the constraint is complete.
    Thread-safe: the engine thread and an asyncio front may compile at once. The worker processes start on the
    first compilation; `close()` (or dropping the compiler) stops them.
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
        self._workers = WorkerPool(self.tokenizer_info.serialize_json, self.config.max_threads)
        self._finalizer = weakref.finalize(self, self._workers.close)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def close(self) -> None:
        """Stops the worker processes; cached grammars stay usable, new constraints are refused."""
        self._finalizer()

    def compile(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        """The compiled grammar of `guided` (cached, failures included); raises GrammarError naming the
        field."""
        key = guided.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            check_size(guided, self.config)  # raised, not cached: the check costs less than the cache's room
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
        """The grammar, or the GrammarError to remember for this constraint (invalid, empty, too slow, or it
        crashed the worker). Raises (not remembered) when the compiler itself cannot serve it now."""
        limit = self.config.max_grammar_compile_seconds
        kind = guided.kind
        method, text = _source(guided)
        ws = self.config.json_any_whitespace
        if not self._slots.acquire(timeout=limit):  # not this constraint's fault: raised, not remembered
            raise GrammarError(f"guided_decoding.{kind}: the grammar compiler is busy with slow constraints; "
                               f"try again later")
        try:
            try:
                result = self._workers.check(method, text, ws, limit)
            except WorkerUnavailable as e:
                raise GrammarError(f"guided_decoding.{kind}: the grammar compiler is not available: {e}") from None
            if result.status == "timeout":
                return GrammarError(f"guided_decoding.{kind}: the constraint took longer than {limit:g} s to "
                                    f"compile (max_grammar_compile_seconds); simplify it")
            if result.status == "crashed":
                return GrammarError(f"guided_decoding.{kind}: the grammar compiler failed on this constraint "
                                    f"({result.detail}); simplify it")
            if result.status == "invalid":
                return GrammarError(f"guided_decoding.{kind}: {_WHAT[kind]}: {_xgr_message(result.detail)}")
            if result.status == "empty":
                return GrammarError(f"guided_decoding.{kind}: the constraint allows no output at all (no token "
                                    f"can start it and it cannot be empty: a rule or $ref that only leads back "
                                    f"to itself?)")
            # The worker compiled it within the limit: compiling it again here takes about as long.
            try:
                return compile_source(self._xgr, method, text, ws)
            except Exception as e:  # the worker's xgrammar accepted it; ours should too
                return GrammarError(f"guided_decoding.{kind}: {_WHAT[kind]}: {_xgr_message(str(e))}")
        finally:
            self._slots.release()


def check_size(guided: GuidedDecoding, config: GrammarCompilerConfig) -> None:
    """Raises GrammarError when `guided` is over one of the config's size limits (before any compiling)."""
    kind = guided.kind
    if kind == "choice":
        _check_limit(kind, "choices", len(guided.choice), config, "max_choices")
        _check_limit(kind, "characters in all choices", sum(map(len, guided.choice)), config, "max_choice_chars")
    elif kind == "regex":
        _check_limit(kind, "characters", len(guided.regex), config, "max_regex_chars")
    elif kind == "grammar":
        _check_limit(kind, "characters", len(guided.grammar), config, "max_grammar_chars")
    elif kind == "json":
        text = guided.schema_text()
        _check_limit(kind, "characters (as compact JSON)", len(text), config, "max_json_schema_chars")
        try:
            depth, properties = _schema_shape(json.loads(text))
        except RecursionError:  # deeper than Python's parser goes: far over any sensible limit
            depth, properties = sys.getrecursionlimit(), 0
        _check_limit(kind, "levels of nesting", depth, config, "max_json_schema_depth")
        _check_limit(kind, "properties", properties, config, "max_json_schema_properties")


def _check_limit(kind: str, what: str, size: int, config: GrammarCompilerConfig, name: str) -> None:
    limit = getattr(config, name)
    if size > limit:
        raise GrammarError(f"guided_decoding.{kind}: {size} {what} is over the limit of {limit} "
                           f"(GrammarCompilerConfig.{name})")


def _schema_shape(schema: object) -> tuple[int, int]:
    """(nesting depth of objects and arrays, number of entries of every `properties` object) of a parsed JSON
    schema; iterative, so a deep schema cannot exhaust Python's stack."""
    depth = properties = 0
    stack = [(schema, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            depth = max(depth, level)
            if isinstance(value.get("properties"), dict):
                properties += len(value["properties"])
            stack.extend((v, level + 1) for v in value.values())
        elif isinstance(value, list):
            depth = max(depth, level)
            stack.extend((v, level + 1) for v in value)
    return depth, properties


def _source(guided: GuidedDecoding) -> tuple[str, str]:
    """(`compile_source` method, text) of a constraint."""
    kind = guided.kind
    if kind == "json":
        return "json_schema", guided.schema_text()
    if kind == "json_object":
        return "json_object", ""
    if kind == "regex":
        return "regex", guided.regex
    if kind == "grammar":
        return "ebnf", guided.grammar
    # JSON string escapes are valid EBNF string literals in xgrammar's dialect.
    return "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in guided.choice)


def _xgr_message(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return _LOCATION.sub("", lines[0]) if lines else "unknown error"
