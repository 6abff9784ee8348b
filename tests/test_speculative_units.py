"""Speculative decoding's pieces on their own: the rejection rule's output distribution (chi-square over 20k
samples), n-gram lookup, drafts in the schedule (budget, rollback, blocks given back)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime import SamplingParams
from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.request import Request
from kiln.runtime.core.scheduler import Scheduler, SchedulerLimits
from kiln.runtime.sampling.sampler import Sampler, SamplingRow, processed_probs
from kiln.runtime.speculative.ngram import lookup
from kiln.runtime.speculative.rejection import DraftRows
from kiln.runtime.speculative.speculator import num_accepted

N = 20_000
# Chi-square critical values at significance 0.001 by degrees of freedom (tokens with p > 0, minus one): a
# correct sampler fails such a test once in a thousand seeds, a wrong one (a few percent off on any token)
# almost always.
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def _fits(tokens: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether N sampled tokens fit distribution p (chi-square at 0.001); tokens with p = 0 must not occur."""
    counts = torch.bincount(tokens, minlength=len(p)).double()
    expected = N * p.double() / p.double().sum()
    possible = expected > 0
    assert counts[~possible].sum() == 0
    statistic = float(((counts - expected)[possible] ** 2 / expected[possible]).sum())
    return statistic < CHI2_999[int(possible.sum()) - 1]


def _rows(params: SamplingParams, generator: torch.Generator | None = None) -> list[SamplingRow]:
    return [SamplingRow(params, [0], [], generator)] * N


P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q = torch.tensor([0.10, 0.30, 0.05, 0.40, 0.05, 0.10])


def test_rejection_rule_samples_the_target_distribution():
    torch.manual_seed(0)
    logits = P.log().expand(N, -1).contiguous()  # temperature 1: the target distribution is P itself
    drafts = torch.multinomial(Q, N, replacement=True)  # [N] d ~ q
    rows = DraftRows(drafts.tolist(), Q.expand(N, -1).contiguous(), frozenset(range(N)))
    tokens = Sampler().sample(logits, _rows(SamplingParams(temperature=1.0)), drafts=rows).token_ids
    assert _fits(tokens, P)
    # Drafts are kept with probability sum(min(p, q)) = 0.65 here; 4 standard deviations of N draws.
    kept = (tokens == drafts).double().mean().item()
    assert kept == pytest.approx(float(torch.minimum(P, Q).sum()), abs=4 * (0.65 * 0.35 / N) ** 0.5)


def test_a_certain_draft_is_kept_with_its_target_probability_and_the_rest_follows_the_target():
    # n-gram drafts carry no q: one-hot at the draft, for which the rule keeps it with probability p(d).
    torch.manual_seed(1)
    params = SamplingParams(temperature=0.7, top_k=5)
    logits = P.log().expand(N, -1).contiguous()
    target = processed_probs(logits[:1], logits[:1], [SamplingRow(params, [0], [])])[0]  # [V]
    rows = DraftRows([3] * N, None, frozenset())
    tokens = Sampler().sample(logits, _rows(params), drafts=rows).token_ids
    assert _fits(tokens, target)
    assert target[5] == 0 and not (tokens == 5).any()  # top_k dropped the least likely token
    kept = (tokens == 3).double().mean().item()
    assert kept == pytest.approx(float(target[3] / target.sum()), abs=4 * (0.25 / N) ** 0.5)


def test_draft_sampling_returns_the_distribution_it_drew_from():
    torch.manual_seed(2)
    params = SamplingParams(temperature=1.3, top_p=0.9)
    logits = Q.log().expand(N, -1).contiguous()
    tokens, q = Sampler().draw_with_probs(logits, _rows(params))
    assert q.shape == (N, 6) and torch.allclose(q[0], q[-1])
    assert _fits(tokens, q[0])
    greedy_tokens, none = Sampler().draw_with_probs(logits[:3], [SamplingRow(SamplingParams(temperature=0), [0], [])] * 3)
    assert none is None and greedy_tokens.tolist() == [3, 3, 3]


def test_seeded_rejection_draws_are_reproducible():
    logits = P.log().expand(64, -1).contiguous()
    rows = DraftRows([1] * 64, Q.expand(64, -1).contiguous(), frozenset(range(64)))

    def run() -> list[int]:
        generator = torch.Generator().manual_seed(7)
        params = SamplingParams(temperature=1.0, seed=7)
        return Sampler().sample(logits, [SamplingRow(params, [0], [], generator)] * 64, drafts=rows).token_ids.tolist()

    assert run() == run()


def test_ngram_lookup_takes_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    # Suffix [2, 3] last occurred at 6..7 (followed by 7, 8, 4); [4, 2, 3] never did before.
    assert lookup(tokens, 3, ngram_min=1, ngram_max=3) == [7, 8, 4]
    assert lookup(tokens, 2, ngram_min=1, ngram_max=3) == [7, 8]
    assert lookup([5, 6, 7], 3, ngram_min=1, ngram_max=3) == []
    assert lookup([5, 5], 4, ngram_min=1, ngram_max=2) == [5]  # the match runs into the suffix itself
    assert lookup([1, 2, 1], 2, ngram_min=2, ngram_max=2) == []  # only 1-token matches, below ngram_min


def test_num_accepted_is_the_agreeing_prefix():
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert num_accepted([5], [4, 2]) == 0


def test_drafts_are_scheduled_within_the_budget_and_rejected_slots_go_back():
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerLimits(max_batch_size=4, max_num_tokens=4), bm)
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=20))
    sched.add_request(request)
    sched.update_after_step(sched.schedule(), {"a": [4]})  # prefill: 3 computed, token 4 to come
    request.draft_token_ids = [5, 6, 7, 8, 9]
    step = sched.schedule()
    item = step.requests[0]
    # The budget (4 tokens) leaves room for the last token and 3 drafts; every position is sampled.
    assert item.token_ids == (4, 5, 6, 7) and item.num_sampled == 4 and item.draft_token_ids == (5, 6, 7)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 14
    sched.update_after_step(step, {"a": [5, 42]})  # draft 5 accepted, 6 rejected: the target says 42
    assert request.output_token_ids == [4, 5, 42] and request.num_computed_tokens == 5
    assert request.draft_token_ids == []
    assert len(bm.block_table("a")) == 2  # 6 tokens known: two blocks of 4 stay
    request.draft_token_ids = [1, 1, 1]
    step = sched.schedule()
    sched.update_after_step(step, {"a": [7]})  # every draft rejected
    assert request.num_computed_tokens == 6 and len(bm.block_table("a")) == 2 and bm.num_free_blocks == 14
