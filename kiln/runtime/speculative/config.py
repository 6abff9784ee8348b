"""How an engine speculates: the typed, frozen runtime option (TensorRT-LLM's and vLLM's words).

`SpeculativeConfig(method="draft_model", model=DIR, num_speculative_tokens=K)` runs a second kiln engine
(same vocabulary) as the proposer; `method="eagle3"` with `model=HEAD_DIR` an EAGLE-3 head (the published
layout: config.json + safetensors) over the target's own hidden states; `method="ngram"` copies the tokens
that followed the last occurrence of the request's last n tokens (prompt lookup, no model). Errors name the
command-line flag of each field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

METHODS = ("draft_model", "ngram", "eagle3")
MODEL_METHODS = ("draft_model", "eagle3")  # the methods that read --speculative-model DIR
MAX_SPECULATIVE_TOKENS = 16  # a verify step computes 1 + K positions per request; more is never worth it
MAX_EAGLE_TOPK = 8  # tree drafts: children a node expands to (EAGLE-2/3 use 4 to 10; SGLang's default 4 at 8B)
# The nodes of a tree plus its root span at most 64 keys (one int64 tree mask a query: plugins/tree_mask.py),
# as do the head's fed-back nodes, eagle_topk per depth.
MAX_DRAFT_TOKENS = 63


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """`num_speculative_tokens`: K, the tokens proposed per request per step (a request may ask for fewer,
    `SamplingParams.num_speculative_tokens`). `model`: the draft engine directory (method "draft_model") or
    the EAGLE-3 head's checkpoint or head engine directory (method "eagle3").
    `ngram_min` .. `ngram_max`: the lengths of the suffix looked up (method "ngram"; the longest match wins).
    Tree drafts (method "eagle3"): `eagle_topk` children per expanded node (1: a chain), `num_draft_tokens` the
    tree's nodes (default K, the chain's), of depth at most K (runtime/speculative/tree.py)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    eagle_topk: int = 1
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-mode {self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not _positive_int(k) or k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--num-speculative-tokens {k!r} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if self.method in MODEL_METHODS:
            if not self.model:
                what = "a kiln engine" if self.method == "draft_model" else "an EAGLE-3 head checkpoint"
                raise ValueError(f"--speculative-mode {self.method} needs --speculative-model DIR ({what})")
            object.__setattr__(self, "model", str(Path(self.model)))
        elif self.model is not None:
            raise ValueError(f"--speculative-model {self.model} is a draft engine, but --speculative-mode is "
                             f"{self.method!r}: leave one of them out")
        for flag, value in (("--ngram-min", self.ngram_min), ("--ngram-max", self.ngram_max)):
            if not _positive_int(value):
                raise ValueError(f"{flag} {value!r} must be a positive integer")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"--ngram-min {self.ngram_min} exceeds --ngram-max {self.ngram_max}")
        self._check_tree()

    @property
    def is_tree(self) -> bool:
        """Whether drafts are a tree (eagle_topk > 1) rather than a chain."""
        return self.eagle_topk > 1

    @property
    def max_draft_nodes(self) -> int:
        """The drafts (nodes) a request verifies per step at most: num_draft_tokens, else K."""
        return self.num_speculative_tokens if self.num_draft_tokens is None else self.num_draft_tokens

    def _check_tree(self) -> None:
        topk, nodes, k = self.eagle_topk, self.num_draft_tokens, self.num_speculative_tokens
        if not _positive_int(topk) or topk > MAX_EAGLE_TOPK:
            raise ValueError(f"eagle_topk {topk!r} must be an integer in [1, {MAX_EAGLE_TOPK}]")
        if nodes is not None and (not _positive_int(nodes) or nodes > MAX_DRAFT_TOKENS):
            raise ValueError(f"num_draft_tokens {nodes!r} must be an integer in [1, {MAX_DRAFT_TOKENS}]")
        if topk == 1:
            if nodes is not None and nodes != k:
                raise ValueError(f"num_draft_tokens {nodes} with eagle_topk 1 (a chain) must equal "
                                 f"--num-speculative-tokens {k}, or be left out")
            return
        if self.method != "eagle3":
            raise ValueError(f"eagle_topk {topk} (tree drafts) needs --speculative-mode eagle3; "
                             f"{self.method!r} proposes a chain (eagle_topk 1)")
        if topk * (k - 1) > MAX_DRAFT_TOKENS + 1:
            raise ValueError(f"eagle_topk {topk} x (--num-speculative-tokens {k} - 1) = {topk * (k - 1)} nodes "
                             f"fed back to the head exceed {MAX_DRAFT_TOKENS + 1} (one int64 tree mask)")

    @classmethod
    def from_dict(cls, fields: dict) -> SpeculativeConfig:
        """vLLM's `speculative_config` dict: method, model, num_speculative_tokens, ngram_min / ngram_max
        (vLLM's prompt_lookup_min / prompt_lookup_max are read too), eagle_topk and num_draft_tokens (SGLang's
        names; tree drafts); a ValueError names an unknown key."""
        fields = dict(fields)
        for theirs, ours in (("prompt_lookup_min", "ngram_min"), ("prompt_lookup_max", "ngram_max")):
            if theirs in fields:
                fields[ours] = fields.pop(theirs)
        known = {"method", "model", "num_speculative_tokens", "ngram_min", "ngram_max", "eagle_topk",
                 "num_draft_tokens"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in fields:
            fields["method"] = "draft_model" if fields.get("model") else "ngram"
        if "num_speculative_tokens" not in fields:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**fields)

    @classmethod
    def from_options(cls, *, speculative_model: str | None = None, speculative_mode: str | None = None,
                     num_speculative_tokens: int | None = None, ngram_min: int = 1, ngram_max: int = 4,
                     eagle_topk: int = 1, num_draft_tokens: int | None = None) -> SpeculativeConfig | None:
        """The config the command-line flags (or `LLM(...)` keywords) ask for; None when they ask for none.
        A draft model alone implies method "draft_model"; K defaults to 4 (vLLM's usual choice is 3 to 5)."""
        if speculative_model is None and speculative_mode is None:
            if num_speculative_tokens is not None:
                raise ValueError("--num-speculative-tokens needs --speculative-model DIR or --speculative-mode "
                                 "ngram")
            if eagle_topk != 1 or num_draft_tokens is not None:
                raise ValueError("--speculative-eagle-topk / --speculative-num-draft-tokens (tree drafts) need "
                                 "--speculative-mode eagle3 --speculative-model HEAD_DIR")
            return None
        method = speculative_mode or "draft_model"
        k = 4 if num_speculative_tokens is None else num_speculative_tokens
        return cls(method=method, num_speculative_tokens=k, model=speculative_model, ngram_min=ngram_min,
                   ngram_max=ngram_max, eagle_topk=eagle_topk, num_draft_tokens=num_draft_tokens)


def speculative_config_of(value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
    """A SpeculativeConfig from what `LLM(speculative_config=...)` takes: the config, a dict of its fields, None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, dict):
        return SpeculativeConfig.from_dict(value)
    raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")
