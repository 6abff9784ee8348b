"""Per-request sampling settings, validated at construction (no torch here)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.runtime.core.guided_decoding import GuidedDecoding


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")


MAX_TOP_LOGPROBS = 20
# What each update of a request holds (vLLM's RequestOutputKind): everything so far, what is new since the
# previous update, or nothing until the one final update.
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# Beam search's early_stopping values (Hugging Face's and TensorRT-LLM's).
EARLY_STOPPING = (True, False, "never")
# Caps on the banned words of one request: each is checked at every step of that request.
MAX_BAD_WORDS = 256
MAX_WORD_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. Penalties, then temperature, then top_k, top_p and min_p are applied
    to the logits in that order. `seed` gives the request its own random generator, so its tokens do
    not depend on what else is in the batch. `logprobs` returns the log-probability of each sampled
    token under the model's own distribution (log_softmax of the raw logits, before any of the
    processing above). `prompt_logprobs` returns, for each prompt token, its log-probability given the
    tokens before it (None for the first). `top_logprobs` (with `logprobs`) also returns, per generated
    token, the most likely `top_logprobs` tokens of that same distribution; `prompt_top_logprobs` (with
    `prompt_logprobs`) does the same for every prompt position after the first. `min_tokens`: EOS and
    `stop_token_ids` do not end the request before that many tokens are generated (stop strings still do).
    `skip_special_tokens=False` keeps special tokens' text in the output text. `guided_decoding`
    constrains the output to a JSON schema, any JSON object, a regex, an EBNF grammar or a list of choices
    (`GuidedDecoding`; needs xgrammar); EOS then ends the request only where the constraint allows it.
    `num_speculative_tokens`: on an engine that speculates, at most this many draft tokens per step for this
    request (None: the engine's K; 0: none). Speculation never changes what is sampled: greedy output is the
    same token for token, sampled output follows the same distribution. `output_kind` (vLLM's
    RequestOutputKind): "cumulative" updates hold everything so far; "delta" updates hold only what is new
    since the previous one (tokens, text, logprobs; prompt logprobs in the first), so a stream costs the
    host in proportion to new tokens, not to the output so far; "final_only" gives one update, when the
    request ends (`LLM.generate` always does). `return_context_logits` / `return_generation_logits`
    (TensorRT-LLM's): the model's raw float32 logits (before penalties, temperature, masks or biases) at every
    prompt position ([prompt_len, vocab], `RequestOutput.context_logits`; the request skips the prefix cache)
    and for every generated token ([len, vocab], `generation_logits`); `return_perf_metrics`: the request's
    timings and KV-cache reuse (`RequestOutput.perf_metrics`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    guided_decoding: GuidedDecoding | None = None
    num_speculative_tokens: int | None = None
    output_kind: str = "cumulative"
    n: int = 1
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # TensorRT-LLM's LLM API names: the raw logits of every prompt position (RequestOutput.context_logits),
    # of every generated token (CompletionOutput.generation_logits), and the request's timings and KV-cache
    # reuse (RequestOutput.perf_metrics). Only requests that ask pay for them.
    return_context_logits: bool = False
    return_generation_logits: bool = False
    return_perf_metrics: bool = False
    # Words never generated (vLLM's bad_words: strings, matched on text; TensorRT-LLM's bad_words_list: token-id
    # sequences), multi-token stop sequences (TensorRT-LLM's stop_words_list) and vLLM's / OpenAI's logit_bias
    # (token id -> added to its logit). Semantics and guarantees: runtime/core/bad_words.py.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    stop_token_sequences: tuple[tuple[int, ...], ...] = ()
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        # Accept a single string / list for stop and a list for stop_token_ids, store tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
                 "must be an integer >= 1")
        _require(_is_num(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
                 "must be a finite number >= 0 (0 means greedy)")
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k,
                 "must be an integer >= 0 (0 disables top-k)")
        _require(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _require(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _require(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 self.repetition_penalty, "must be > 0 (1 disables it)")
        _require(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
                 self.presence_penalty, "must be in [-2, 2]")
        _require(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
                 self.frequency_penalty, "must be in [-2, 2]")
        _require(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed", self.seed,
                 "must be None or an integer in [0, 2**63)")
        for s in self.stop:
            _require(isinstance(s, str) and s != "", "stop", self.stop, "must be non-empty strings")
        for t in self.stop_token_ids:
            _require(_is_int(t) and t >= 0, "stop_token_ids", self.stop_token_ids,
                     "must be non-negative integers")
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")
        for name in ("ignore_eos", "logprobs", "prompt_logprobs", "skip_special_tokens", "return_context_logits",
                     "return_generation_logits", "return_perf_metrics"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, value, "must be True or False")
        _require(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
                 self.top_logprobs, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        _require(self.top_logprobs == 0 or self.logprobs, "top_logprobs", self.top_logprobs,
                 "needs logprobs=True")
        _require(_is_int(self.prompt_top_logprobs) and 0 <= self.prompt_top_logprobs <= MAX_TOP_LOGPROBS,
                 "prompt_top_logprobs", self.prompt_top_logprobs, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        _require(self.prompt_top_logprobs == 0 or self.prompt_logprobs, "prompt_top_logprobs",
                 self.prompt_top_logprobs, "needs prompt_logprobs=True")
        _require(self.guided_decoding is None or isinstance(self.guided_decoding, GuidedDecoding),
                 "guided_decoding", self.guided_decoding, "must be None or a GuidedDecoding")
        _require(self.num_speculative_tokens is None
                 or (_is_int(self.num_speculative_tokens) and self.num_speculative_tokens >= 0),
                 "num_speculative_tokens", self.num_speculative_tokens,
                 "must be None (the engine's) or an integer >= 0 (0: not speculated)")
        _require(self.output_kind in OUTPUT_KINDS, "output_kind", self.output_kind,
                 f"must be one of {', '.join(OUTPUT_KINDS)}")
        self._check_word_lists()
        self._check_beam_search()

    def _check_word_lists(self) -> None:
        """bad_words, bad_words_token_ids, stop_token_sequences: normalized to tuples; logit_bias: to a dict of
        int -> float (None when empty)."""
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        object.__setattr__(self, "bad_words", words)
        _require(len(words) <= MAX_BAD_WORDS, "bad_words", f"<{len(words)} words>", f"at most {MAX_BAD_WORDS} words")
        for w in words:
            _require(isinstance(w, str) and w.strip() != "" and len(w) <= MAX_WORD_CHARS, "bad_words", w,
                     f"each must be a string with a non-space character, at most {MAX_WORD_CHARS} characters")
        for name in ("bad_words_token_ids", "stop_token_sequences"):
            value = getattr(self, name)
            try:
                seqs = tuple(tuple(seq) for seq in value)
            except TypeError:
                seqs = None
            _require(seqs is not None, name, value, "must be a list of token-id lists")
            _require(len(seqs) <= MAX_BAD_WORDS, name, f"<{len(seqs)} sequences>", f"at most {MAX_BAD_WORDS}")
            for seq in seqs:
                _require(0 < len(seq) <= MAX_WORD_CHARS and all(_is_int(t) and t >= 0 for t in seq), name, list(seq),
                         f"each must be 1 to {MAX_WORD_CHARS} token ids, each an integer >= 0")
            object.__setattr__(self, name, seqs)
        if self.logit_bias is not None:
            bias = self.logit_bias
            _require(hasattr(bias, "items"), "logit_bias", bias, "must be None or a dict of token id -> bias")
            for token, value in bias.items():
                _require(_is_int(token) and token >= 0, "logit_bias", token, "keys must be token ids (integers >= 0)")
                _require(_is_num(value), "logit_bias", value, "values must be finite numbers")
            object.__setattr__(self, "logit_bias", {int(t): float(v) for t, v in bias.items()} or None)

    def _check_beam_search(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _require(isinstance(self.use_beam_search, bool), "use_beam_search", self.use_beam_search,
                 "must be True or False")
        _require(self.n == 1 or self.use_beam_search, "n", self.n,
                 "n > 1 needs use_beam_search=True (n is the beam width; parallel sampling is not supported)")
        _require(_is_num(self.length_penalty), "length_penalty", self.length_penalty, "must be a finite number")
        _require(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping", self.early_stopping,
                 'must be True, False or "never"')
        if not self.use_beam_search:
            return
        _require(self.temperature in (0, 1), "temperature", self.temperature,
                 "must be 0 or 1 with use_beam_search (beam search is deterministic: no temperature)")
        defaults = SamplingParams()
        for name in ("top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "min_tokens", "guided_decoding", "prompt_logprobs", "top_logprobs",
                     "bad_words", "bad_words_token_ids", "logit_bias"):
            value = getattr(self, name)
            _require(value == getattr(defaults, name), name, value,
                     f"is not supported with use_beam_search (leave it at {getattr(defaults, name)!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def beam_width(self) -> int:
        """Beams kept per step: n with beam search, else 0 (no beam search)."""
        return self.n if self.use_beam_search else 0

    @property
    def needs_prompt_positions(self) -> bool:
        """Whether every prompt position must be computed (prompt logprobs, context logits): such a request
        skips the prefix cache."""
        return self.prompt_logprobs or self.return_context_logits

    @property
    def has_word_bans(self) -> bool:
        """Whether each step bans tokens after the text so far (bad_words, bad_words_token_ids)."""
        return bool(self.bad_words or self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the tokens generated so far (repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
