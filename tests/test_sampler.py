"""Sampler: greedy, seeded batch invariance, top-k/top-p/min-p exclusion, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.sampling.sampler import Sampler, SamplingRow, apply_penalties

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
])]

sampler = Sampler()


def row(params: SamplingParams, prompt=(), output=(), device="cpu") -> SamplingRow:
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed)
    return SamplingRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output),
                       generator=generator)


def random_logits(batch: int, vocab: int, seed: int, device: str, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=gen) * scale).to(device)  # [B, V] float32


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = random_logits(6, 97, seed=0, device=device)
    out = sampler(logits, [row(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_is_greedy(device):
    logits = random_logits(32, 97, seed=1, device=device)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie: greedy takes the first maximum
    out = sampler(logits, [row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(32)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[0] == 5


def _run_steps(rows_per_step, logits_per_step) -> list[list[int]]:
    """Sample several steps; rows (and their generators) are reused across steps."""
    return [sampler(logits, rows_per_step).token_ids for logits in logits_per_step]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seeded", [
    SamplingParams(temperature=0.9, seed=1234),  # alone it skips the filter stages the batch runs
    SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
])
def test_seeded_row_same_alone_and_in_batch(device, seeded):
    vocab, steps = 64, 6
    logits_steps = [random_logits(5, vocab, seed=100 + s, device=device, scale=1.0) for s in range(steps)]

    alone = _run_steps([row(seeded, device=device)], [lg[2:3] for lg in logits_steps])
    batch_rows = [
        row(SamplingParams(temperature=1.0), device=device),  # unseeded, default RNG
        row(SamplingParams(temperature=0.7, top_k=5, seed=7), device=device),  # another seeded row
        row(seeded, device=device),
        row(SamplingParams(temperature=0.0), device=device),
        row(SamplingParams(temperature=1.3, min_p=0.1), device=device),
    ]
    in_batch = _run_steps(batch_rows, logits_steps)
    assert [step[0] for step in alone] == [step[2] for step in in_batch]


@pytest.mark.parametrize("device", DEVICES)
def test_different_seeds_differ(device):
    logits_steps = [torch.zeros(1, 50, device=device)] * 20  # uniform: every token equally likely

    def tokens(seed):
        return [s[0] for s in _run_steps([row(SamplingParams(seed=seed), device=device)], logits_steps)]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)


def _log_probs(probs: list[float], vocab: int) -> torch.Tensor:
    rest = (1.0 - sum(probs)) / (vocab - len(probs))
    return torch.tensor(probs + [rest] * (vocab - len(probs))).log()  # [V]


# probabilities 0.3, 0.25, 0.2, 0.1, 0.05, then 0.1 spread over 10 tokens (0.01 each)
_PROBS = [0.3, 0.25, 0.2, 0.1, 0.05]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_p=0.7), {0, 1, 2}),  # 0.3 + 0.25 < 0.7 <= 0.3 + 0.25 + 0.2
    (SamplingParams(top_p=0.01), {0}),  # the top token is always kept
    (SamplingParams(min_p=0.5), {0, 1, 2}),  # keep p >= 0.15
    # top_p applies to the top 4 renormalised (0.35, 0.29, 0.24, 0.12): 0.88 >= 0.85 drops token 3;
    # without top_k, token 3 would stay (0.75 < 0.85)
    (SamplingParams(top_k=4, top_p=0.85), {0, 1, 2}),
    (SamplingParams(temperature=0.5, min_p=0.3), {0, 1, 2}),  # T=0.5 squares ratios: 0.2²/0.3² >= 0.3
])
def test_filters_never_pick_excluded_tokens(device, params, allowed):
    vocab, n = 15, 4000
    logits = _log_probs(_PROBS, vocab).expand(n, vocab).contiguous().to(device)
    out = sampler(logits, [row(params) for _ in range(n)])
    assert set(out.token_ids) == allowed  # nothing outside; everything inside is reachable


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_follows_the_distribution(device):
    vocab, n = 15, 40000
    logits = _log_probs(_PROBS, vocab).expand(n, vocab).contiguous().to(device)
    out = sampler(logits, [row(SamplingParams(temperature=1.0)) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double() / n
    expected = torch.softmax(logits[0].double().cpu(), -1)
    assert torch.allclose(counts, expected, atol=0.015)


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    rows = [
        row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[1, 4]),
        row(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
            prompt=[3], output=[2, 2, 2, 5]),
        row(SamplingParams()),  # no penalty: untouched
    ]
    expected = logits.clone()
    # repetition: tokens {0, 1, 4} (prompt + output); positive logits divided, others multiplied
    expected[0, 0] = 2.0 / 2.0
    expected[0, 1] = -1.0 * 2.0
    expected[0, 4] = -2.0 * 2.0
    # presence/frequency over output tokens only (token 3 in the prompt is not penalized)
    expected[1, 2] = 0.5 - 0.5 - 0.25 * 3
    expected[1, 5] = 1.0 - 0.5 - 0.25 * 1
    original = logits.clone()
    torch.testing.assert_close(apply_penalties(logits, rows), expected)
    torch.testing.assert_close(logits, original)  # the caller's logits are not modified


def test_penalties_apply_to_greedy_rows():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    out = sampler(logits, [row(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[0])])
    assert out.token_ids == [1]  # 3.0 / 2 = 1.5 < 2.5


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_from_raw_logits(device):
    logits = random_logits(4, 33, seed=3, device=device)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=True)),
        row(SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.5), output=[1, 2]),
        row(SamplingParams(temperature=1.2, top_p=0.5, frequency_penalty=1.0, logprobs=True), output=[3]),
        row(SamplingParams(min_p=0.2, seed=5, logprobs=True), device=device),
    ]
    out = sampler(logits, rows)
    expected = torch.log_softmax(logits, -1)[torch.arange(4, device=device), torch.tensor(out.token_ids,
                                                                                          device=device)]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_single_finite_logit(device):
    logits = torch.full((6, 20), float("-inf"), device=device)
    logits[:, 7] = 0.5
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1.0, logprobs=True)),
        row(SamplingParams(top_k=3)),
        row(SamplingParams(top_p=0.5, seed=3), device=device),
        row(SamplingParams(min_p=0.9)),
        row(SamplingParams(repetition_penalty=1.3, presence_penalty=1.0), output=[7, 1]),
    ]
    out = sampler(logits, rows)
    assert out.token_ids == [7] * 6
    assert out.logprobs[1] == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_degenerate_rows_fall_back_to_raw_argmax(device):
    logits = random_logits(3, 10, seed=4, device=device)
    logits[0] = float("-inf")  # nothing to sample
    logits[1, 2] = float("nan")
    logits[2, 4] = float("inf")
    out = sampler(logits, [row(SamplingParams(top_p=0.9)) for _ in range(3)])
    assert len(out.token_ids) == 3
    assert all(0 <= t < 10 for t in out.token_ids)
    assert out.token_ids[2] == 4


def test_empty_batch_and_shape_check():
    assert sampler(torch.zeros(0, 5), []).token_ids == []
    with pytest.raises(ValueError, match="logits must be"):
        sampler(torch.zeros(2, 5), [row(SamplingParams())])


def test_logprob_is_finite_for_sampled_token():
    out = sampler(random_logits(1, 10, seed=9, device="cpu"), [row(SamplingParams(logprobs=True))])
    assert math.isfinite(out.logprobs[0]) and out.logprobs[0] <= 0


# -- the token-mask stage (guided decoding plugs in here) -----------------------------------------------


def _mask(batch: int, vocab: int, allowed: list[list[int]]) -> torch.Tensor:
    mask = torch.zeros(batch, vocab, dtype=torch.bool)  # [B, V]
    for i, ids in enumerate(allowed):
        mask[i, ids] = True
    return mask


def test_token_mask_restricts_greedy_and_random_rows():
    logits = random_logits(4, 97, seed=3, device="cpu")
    allowed = [[5, 7], [11], [2, 3, 50], [96]]
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=1.0, seed=1)),
            row(SamplingParams(temperature=2.0, top_p=0.5, top_k=10, seed=2)),
            row(SamplingParams(temperature=1.0, repetition_penalty=1.5, seed=3), prompt=[96])]
    for _ in range(20):
        out = sampler(logits, rows, _mask(4, 97, allowed))
        assert all(token in ids for token, ids in zip(out.token_ids, allowed))
    assert out.token_ids[0] == max(allowed[0], key=lambda t: logits[0, t].item())


def test_token_mask_is_respected_by_the_empty_distribution_fallback():
    logits = random_logits(2, 31, seed=4, device="cpu")
    # min_p=1 keeps only the single best token of the processed distribution; a NaN row empties it all.
    logits[1] = float("nan")
    rows = [row(SamplingParams(temperature=1.0, min_p=1.0, seed=5)), row(SamplingParams(temperature=1.0, seed=6))]
    out = sampler(logits, rows, _mask(2, 31, [[0, 1], [9]]))
    assert out.token_ids[0] in (0, 1) and out.token_ids[1] == 9


def test_token_mask_leaves_logprobs_of_the_model_distribution():
    logits = random_logits(1, 31, seed=5, device="cpu")
    out = sampler(logits, [row(SamplingParams(temperature=0.0, logprobs=True))], _mask(1, 31, [[4]]))
    assert out.token_ids == [4]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[4].item())


def test_token_mask_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="token_mask"):
        sampler(random_logits(1, 31, seed=6, device="cpu"), [row(SamplingParams(temperature=0.0))],
                torch.ones(1, 30, dtype=torch.bool))
