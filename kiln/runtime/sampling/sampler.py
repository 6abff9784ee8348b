"""Batched sampling: penalties, greedy, temperature / top-k / top-p / min-p, seeded sampling.

Works on CPU and CUDA logits. The only host sync is reading the sampled tokens (and logprobs) back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kiln.plugins.host_tensors import to_device
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.sampling.logit_bias import apply_logit_bias
from kiln.runtime.speculative.rejection import CheckedDrafts, DraftRows, rejection_rule

# The kinds of random draw a seeded row makes at one output position, each from its own stream: the token
# itself (exponential race, residual draws included), the rejection rule's uniform, a draft model's draft.
TOKEN_DRAW, ACCEPT_DRAW, DRAFT_DRAW = 0, 1, 2
_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int, kind: int) -> int:
    """The generator seed of one draw: splitmix64's finalizer over (seed, position, kind), so neighbouring
    positions get unrelated streams. Returns an integer in [0, 2**63)."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9 + (kind + 1) * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _reseed(row: SamplingRow, kind: int) -> torch.Generator:
    """The row's generator, seeded for its draw of `kind` at its output position."""
    return row.generator.manual_seed(draw_seed(row.params.seed, len(row.output_token_ids), kind))


@dataclass
class SamplingRow:
    """Plain data for one request in this step.

    `generator` is the request's own generator when `params.seed` is set, created by the caller on the
    logits' device; None draws from the default RNG. It is reseeded before every draw from the request's seed,
    the output position drawn for (len(output_token_ids)) and the kind of draw, so a seeded request's tokens
    depend on its seed and its own tokens only: not on the batch, on how its steps were cut (preemption,
    speculative decoding's drafts) or on how many draws came before.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row; `logprobs` (log_softmax of the raw logits at that token) is None
    unless some row asked for it, then it holds one value per row. `top_logprobs` likewise holds, per
    row, that row's `top_logprobs` most likely (token, logprob) pairs, most likely first."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class DeviceSample:
    """A step's sampled tokens still on the logits' device: launching the sampling does not wait for the
    GPU; `to_host` does (the one host sync of a step).

    The copies back to the host are queued when the sample is made, right behind the sampling kernels, and
    an event marks their end: a step launched after this one (async scheduling) queues behind them, so
    `to_host` waits for this step only, not for the GPU's whole queue."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, when some row asked for logprobs
    top: tuple[torch.Tensor, torch.Tensor] | None  # ([B, k] float32 values, [B, k] int64 ids), most likely first
    top_counts: tuple[int, ...]  # per row, how many of the top-k it asked for
    # (host copies of token_ids, logprobs, top, the event recorded after them or None off CUDA); set at init
    _host: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens = self.token_ids.to("cpu", non_blocking=True)
        logprobs = self.logprobs.to("cpu", non_blocking=True) if self.logprobs is not None else None
        top = tuple(t.to("cpu", non_blocking=True) for t in self.top) if self.top is not None else None
        done = None
        if self.token_ids.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.token_ids.device))
        object.__setattr__(self, "_host", (tokens, logprobs, top, done))

    def to_host(self) -> SamplerOutput:
        tokens, logprobs, top, done = self._host
        if done is not None:
            done.synchronize()
        top_pairs = None
        if top is not None:
            values, indices = (t.tolist() for t in top)
            top_pairs = [list(zip(indices[i][:k], values[i][:k])) for i, k in enumerate(self.top_counts)]
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs.tolist() if logprobs is not None else None,
                             top_logprobs=top_pairs)


class Sampler:
    """Picks the next token of every row of a batch of logits.

    Order: logprobs from the raw logits; logit_bias (logit_bias.py); repetition, frequency and presence
    penalties (greedy rows too); the token mask, when given (guided decoding); argmax for greedy rows; for the others
    temperature, top_k, top_p, min_p, then one draw. All math is batched over rows with per-row parameter
    tensors; a stage no row uses is skipped.
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 token_mask: torch.Tensor | None = None) -> SamplerOutput:
        """Samples and reads the result back."""
        return self.sample(logits, rows, token_mask).to_host()

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
               token_mask: torch.Tensor | None = None, drafts: DraftRows | None = None) -> DeviceSample:
        """Queues the sampling of every row on the logits' device; nothing waits for the GPU.

        token_mask: [B, V] bool on the logits' device, True where a row may pick the token (V is the
        model's vocabulary, the logits' width). Every choice respects it, the fallback for a row whose
        distribution is empty included; each row must allow at least one token. Logprobs stay those of
        the model's own distribution.

        drafts: the draft tokens being verified (speculative decoding). A sampled (non-greedy) row whose
        draft came with the distribution q it was drawn from takes the rejection rule: the draft with
        probability min(1, p/q), else a draw from the normalized residual max(p - q, 0). Every other row
        draws from p as usual, which for a certain draft (q one-hot) is the same rule: the draw equals the
        draft with probability p(draft), and otherwise follows p without it, i.e. the residual.
        """
        # logits: [B, V] float32, raw model logits, one row per entry of `rows`
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        raw = logits.float()
        # [B, V] float32, a new tensor if any logit bias or penalty applies
        processed = apply_penalties(apply_logit_bias(raw, rows), rows)
        fallback = raw  # what a row with an empty distribution falls back to (its argmax)
        if token_mask is not None:
            if token_mask.shape != raw.shape or token_mask.dtype != torch.bool:
                raise ValueError(f"token_mask must be bool of the logits' shape {tuple(raw.shape)}, got "
                                 f"{token_mask.dtype} {tuple(token_mask.shape)}")
            processed = processed.masked_fill(~token_mask, float("-inf"))
            fallback = raw.masked_fill(~token_mask, float("-inf"))
        tokens = processed.argmax(dim=-1)  # [B] int64; final for greedy rows
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            index = to_device(random_rows, torch.int64, raw.device)  # [R]
            probs = processed_probs(processed[index], fallback[index], [rows[i] for i in random_rows])
            checked = None if drafts is None else drafts.for_rows(random_rows)
            sampled = _draw(probs, [rows[i] for i in random_rows], checked)
            tokens = tokens.index_copy(0, index, sampled)
        logprobs = top = None
        counts = tuple(row.params.top_logprobs for row in rows)
        if any(row.params.logprobs for row in rows):
            # log_probs: [B, V] float32, the model's own (unprocessed) distribution
            log_probs = torch.log_softmax(raw, dim=-1)
            logprobs = log_probs.gather(1, tokens[:, None]).squeeze(1)
            if max(counts):
                top = log_probs.topk(max(counts), dim=-1)  # ([B, k], [B, k])
                top = (top.values, top.indices)
        return DeviceSample(tokens, logprobs, top, counts)

    def draw_with_probs(self, logits: torch.Tensor,
                        rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a proposer that samples needs: each row's token, drawn as `sample` draws it (penalties, then
        argmax for greedy rows, the processed distribution for the others), and the distributions q they were
        drawn from, [R, V] float32 (one-hot for greedy rows), or None when every row is greedy.
        logits: [R, V] float32. Returns ([R] int64 tokens, q)."""
        raw = logits.float()
        processed = apply_penalties(apply_logit_bias(raw, rows), rows)
        tokens = processed.argmax(dim=-1)  # [R] int64
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random_rows:
            return tokens, None
        index = to_device(random_rows, torch.int64, raw.device)  # [N]
        probs = processed_probs(processed[index], raw[index], [rows[i] for i in random_rows])  # [N, V]
        tokens = tokens.index_copy(0, index, _draw(probs, [rows[i] for i in random_rows], kind=DRAFT_DRAW))
        q = torch.zeros_like(raw).scatter_(1, tokens[:, None], 1.0).index_copy_(0, index, probs)  # [R, V]
        return tokens, q


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalized copy of `logits` ([B, V] float32; returned as is when no row has a penalty).

    Repetition penalty (HF: over prompt + output tokens, a logit > 0 is divided by it, else multiplied),
    then frequency (minus penalty × count) and presence (minus penalty once) penalties (OpenAI: output
    tokens only). Only rows that use a penalty pay for it.
    """
    vocab_size = logits.shape[1]
    rep_rows = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    freq_rows = [i for i, row in enumerate(rows)
                 if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0]
    if not rep_rows and not freq_rows:
        return logits
    logits = logits.clone()
    device = logits.device
    if rep_rows:
        index = to_device(rep_rows, torch.int64, device)  # [N]
        seen = _token_counts([[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in rep_rows],
                             vocab_size, device) > 0  # [N, V] bool
        penalty = to_device([rows[i].params.repetition_penalty for i in rep_rows], logits.dtype,
                             device)[:, None]  # [N, 1]
        sub = logits[index]  # [N, V]
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits.index_copy_(0, index, torch.where(seen, penalized, sub))
    if freq_rows:
        index = to_device(freq_rows, torch.int64, device)  # [N]
        counts = _token_counts([rows[i].output_token_ids for i in freq_rows], vocab_size, device)
        counts = counts.to(logits.dtype)  # [N, V] float32
        freq = to_device([rows[i].params.frequency_penalty for i in freq_rows], logits.dtype,
                          device)[:, None]  # [N, 1]
        presence = to_device([rows[i].params.presence_penalty for i in freq_rows], logits.dtype,
                              device)[:, None]  # [N, 1]
        sub = logits[index] - freq * counts - presence * (counts > 0).to(logits.dtype)
        logits.index_copy_(0, index, sub)
    return logits


def _token_counts(token_lists: list[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each list. Returns [N, V] int64."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    # Pad with an extra id (vocab_size) whose column is dropped, so all rows scatter in one call.
    padded = [list(tokens) + [vocab_size] * (width - len(tokens)) for tokens in token_lists]
    ids = to_device(padded, torch.int64, device).view(len(token_lists), width)  # [N, L]
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]


def processed_probs(logits: torch.Tensor, fallback: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution each row draws from: temperature, top_k, top_p, min_p over `logits`.

    logits: [R, V] float32 after penalties (and the token mask); fallback: [R, V] float32 raw logits, masked
    like `logits`: a row whose distribution is empty (or NaN) is one-hot at its argmax. Returns [R, V]
    float32, not normalized when min_p dropped tokens (every use is scale-free or normalizes itself).
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    params = [row.params for row in rows]
    temperature = to_device([p.temperature for p in params], logits.dtype, device)  # [R]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    use_top_p = [p.top_p < 1.0 for p in params]
    if any(top_k) or any(use_top_p):
        # Sort before dividing by temperature: same order, but no ties made by rounding, so that
        # top_k=1 keeps exactly the greedy (first maximal) token. stable=True keeps ties in id order.
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [R, V] each
        sorted_logits = sorted_logits / temperature[:, None]
        position = torch.arange(vocab_size, device=device)[None, :]  # [1, V]
        if any(top_k):
            k = to_device([k or vocab_size for k in top_k], torch.int64, device)[:, None]  # [R, 1]
            sorted_logits = sorted_logits.masked_fill(position >= k, float("-inf"))
        if any(use_top_p):
            top_p = to_device([p.top_p for p in params], logits.dtype, device)[:, None]  # [R, 1]
            sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [R, V]
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [R, V]
            # Drop a token once the more likely ones already reach top_p; never the top token, and
            # only in rows that use top_p (rounding in the cumsum must not touch the others).
            drop = (mass_before >= top_p) & (position > 0)
            drop &= to_device(use_top_p, torch.bool, device)[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
    else:
        logits = logits / temperature[:, None]
    probs = torch.softmax(logits, dim=-1)  # [R, V] float32
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], probs.dtype, device)[:, None]  # [R, 1]
        # The exponential race needs no renormalisation after dropping tokens.
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    probs = torch.nan_to_num(probs, nan=0.0)
    empty = ~(probs.sum(dim=-1, keepdim=True) > 0)  # [R, 1] bool: all zero (or NaN before nan_to_num)
    one_hot = torch.zeros_like(probs).scatter_(1, fallback.argmax(dim=-1, keepdim=True), 1.0)  # [R, V]
    return torch.where(empty, one_hot, probs)


def _draw(probs: torch.Tensor, rows: Sequence[SamplingRow], drafts: CheckedDrafts | None = None,
          kind: int = TOKEN_DRAW) -> torch.Tensor:
    """One exponential-race draw per row of `probs` ([R, V] float32, processed_probs'); rows with a draft
    and its q take the rejection rule instead (see Sampler.sample). `kind`: which stream seeded rows draw
    from (a draft model's drafts use their own). Returns [R] int64 token ids."""
    num_rows, vocab_size = probs.shape
    q = _exponential_noise(rows, num_rows, vocab_size, probs.device, kind)  # [R, V]
    accept = None
    if drafts is not None:
        uniforms = _uniforms([rows[i] for i in drafts.rows], probs.device)  # [N]
        accept, residual = rejection_rule(probs[drafts.index], drafts.probs, drafts.token_ids, uniforms)
        probs = probs.index_copy(0, drafts.index, residual)
    # argmax(p / q) with q ~ Exp(1) picks token i with probability p_i / sum(p).
    tokens = (probs / q).argmax(dim=-1)  # [R] int64
    if accept is not None:
        chosen = torch.where(accept, drafts.token_ids, tokens[drafts.index])  # [N]
        tokens = tokens.index_copy(0, drafts.index, chosen)
    return tokens


def _uniforms(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    """U[0, 1) per row, [N] float32, from each row's generator where it has one (drawn after its noise)."""
    u = torch.rand(len(rows), device=device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            u[i] = torch.rand((), device=device, generator=_reseed(row, ACCEPT_DRAW))
    return u


def _exponential_noise(rows: Sequence[SamplingRow], num_rows: int, vocab_size: int, device: torch.device,
                       kind: int = TOKEN_DRAW) -> torch.Tensor:
    """Exp(1) noise, [R, V] float32. A row with a generator draws its own V values from it (reseeded for
    this position and `kind`), so a seeded request gets the same noise whatever else is in the batch; the
    rest draw together."""
    q = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    unseeded = [i for i, row in enumerate(rows) if row.generator is None]
    if len(unseeded) == num_rows:
        q.exponential_()
    elif unseeded:
        index = to_device(unseeded, torch.int64, device)
        noise = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=device).exponential_()
        q.index_copy_(0, index, noise)
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise = torch.empty(vocab_size, dtype=torch.float32, device=device)
            q[i] = noise.exponential_(generator=_reseed(row, kind))
    # exponential_ may return exactly 0; 0/0 would be NaN, which argmax would pick.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)
