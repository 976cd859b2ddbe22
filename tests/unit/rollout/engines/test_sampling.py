"""Per-row sampling: filtering by hand-computed values, greedy, raw logprobs, per-row seeds."""

import math

import torch

from agentrl.rollout.engines._sampling import RowSampling, filter_logits, select_tokens


def _row(temperature=1.0, top_p=1.0, top_k=-1, seed=None, top_logprobs=0):
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return RowSampling(temperature, top_p, top_k, generator, top_logprobs)


def test_filter_logits_top_k_keeps_the_k_largest():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = filter_logits(logits, torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([2]))
    assert out.tolist() == [[2.0, 1.0, float("-inf"), float("-inf")]]


def test_filter_logits_top_p_keeps_the_smallest_set_reaching_p():
    # probs = [0.5, 0.25, 0.125, 0.125]: mass before each = [0, .5, .75, .875]; top_p=0.6 keeps 2.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    out = filter_logits(logits, torch.tensor([1.0]), torch.tensor([0.6]), torch.tensor([-1]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    # top_p=0.4: the mass before the second token (0.5) is already above p, so only the first stays.
    out = filter_logits(logits, torch.tensor([1.0]), torch.tensor([0.4]), torch.tensor([-1]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_filter_logits_temperature_divides_and_rows_are_independent():
    logits = torch.tensor([[2.0, 1.0, 0.0], [3.0, 0.0, 1.0]])
    out = filter_logits(logits, torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([-1, 1]))
    assert out[0].tolist() == [1.0, 0.5, 0.0]
    assert out[1].tolist() == [3.0, float("-inf"), float("-inf")]


def test_greedy_rows_take_argmax_and_report_raw_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    step = select_tokens(logits, [_row(temperature=0.0), _row(temperature=0.0, top_logprobs=2)])
    assert step.token_ids == [1, 0]
    expected0 = 3.0 - math.log(math.exp(0) + math.exp(3) + math.exp(1))
    assert math.isclose(step.logprobs[0], expected0, rel_tol=1e-6)
    assert step.top_logprobs[0] is None
    top = step.top_logprobs[1]
    assert list(top) == [0, 1] and math.isclose(top[0], step.logprobs[1], rel_tol=1e-6)


def test_sampled_logprob_is_raw_not_processed():
    logits = torch.tensor([[1.0, 1.0, -10.0]])
    step = select_tokens(logits, [_row(temperature=0.5, top_k=1, seed=0)])
    # top_k=1 makes the processed probability 1, but the reported logprob is the raw log(0.5).
    assert step.token_ids == [0]
    assert math.isclose(
        step.logprobs[0], math.log(math.exp(1) / (2 * math.exp(1) + math.exp(-10))), rel_tol=1e-6
    )


def test_seeded_row_is_reproducible_whatever_shares_its_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    alone = [select_tokens(logits, [_row(seed=7)]).token_ids[0] for _ in range(1)]
    draws_alone, draws_batched = [], []
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(20):
        draws_alone.append(select_tokens(logits, [RowSampling(1.0, 1.0, -1, gen_a)]).token_ids[0])
        batch = torch.cat([torch.randn(1, 50), logits, torch.randn(1, 50)])
        rows = [_row(seed=3), RowSampling(1.0, 1.0, -1, gen_b), _row(temperature=0.0)]
        draws_batched.append(select_tokens(batch, rows).token_ids[1])
    assert draws_alone == draws_batched
    assert alone[0] == draws_alone[0]
    assert len(set(draws_alone)) > 1  # it really samples
