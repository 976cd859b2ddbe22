"""Per-row sampling: filtering by hand-computed values, greedy, tempered logprobs, per-row seeds, the draw's
distribution, and tokens blocked below min_tokens."""

import math

import torch

from agentrl.rollout.engines._sampling import RowSampling, filter_logits, select_tokens, uniform_draw


def _row(temperature=1.0, top_p=1.0, top_k=-1, seed=0, position=0, top_logprobs=0, blocked=()):
    return RowSampling(temperature, top_p, top_k, seed, position, top_logprobs, tuple(blocked))


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


def test_sampled_logprob_is_tempered_but_not_truncated():
    """The logprob is log softmax(z / T) at the token (the policy the trainer trains), before top-k/top-p."""
    logits = torch.tensor([[1.0, 1.0, -10.0]])
    step = select_tokens(logits, [_row(temperature=0.5, top_k=1, seed=0)])
    # top_k=1 makes the processed probability 1; the reported logprob is softmax(z / 0.5)'s log(~0.5).
    assert step.token_ids == [0]
    assert math.isclose(
        step.logprobs[0], math.log(math.exp(2) / (2 * math.exp(2) + math.exp(-20))), rel_tol=1e-6
    )
    sharp = torch.tensor([[2.0, 0.0, -1.0]])
    for temperature in (0.7, 1.0, 1.5):
        step = select_tokens(sharp, [_row(temperature=temperature, seed=3)])
        expected = torch.log_softmax(sharp[0] / temperature, -1)[step.token_ids[0]].item()
        assert math.isclose(step.logprobs[0], expected, rel_tol=1e-6), temperature


def test_seeded_row_is_reproducible_whatever_shares_its_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    draws_alone, draws_batched = [], []
    for position in range(20):
        draws_alone.append(select_tokens(logits, [_row(seed=7, position=position)]).token_ids[0])
        batch = torch.cat([torch.randn(1, 50), logits, torch.randn(1, 50)])
        rows = [_row(seed=3, position=position), _row(seed=7, position=position), _row(temperature=0.0)]
        draws_batched.append(select_tokens(batch, rows).token_ids[1])
    assert draws_alone == draws_batched
    assert len(set(draws_alone)) > 1  # it really samples
    other_seed = [select_tokens(logits, [_row(seed=8, position=p)]).token_ids[0] for p in range(20)]
    assert other_seed != draws_alone


def test_uniform_draws_are_uniform_and_independent_of_neighbours():
    draws = [uniform_draw(seed, position) for seed in range(50) for position in range(200)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    deciles = [sum(int(u * 10) == d for u in draws) / len(draws) for d in range(10)]
    assert max(abs(f - 0.1) for f in deciles) < 0.01
    assert uniform_draw(1, 0) != uniform_draw(0, 1)  # (seed, position) pairs do not alias


def test_sampled_frequencies_follow_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).unsqueeze(0).repeat(4000, 1)
    rows = [_row(seed=11, position=p) for p in range(4000)]
    counts = torch.bincount(torch.tensor(select_tokens(logits, rows).token_ids), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03), counts
    # top_p=0.7 leaves [0.5, 0.3] renormalised to [0.625, 0.375].
    rows = [_row(seed=11, position=p, top_p=0.7) for p in range(4000)]
    counts = torch.bincount(torch.tensor(select_tokens(logits, rows).token_ids), minlength=4).float() / 4000
    assert counts[2:].sum() == 0 and abs(counts[0].item() - 0.625) < 0.03


def test_blocked_tokens_are_never_chosen_but_logprobs_stay_unmasked():
    logits = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    step = select_tokens(logits, [_row(temperature=0.0, blocked=[0]), _row(temperature=1.0, blocked=[0])])
    assert 0 not in step.token_ids
    raw = torch.log_softmax(logits[0], dim=-1)
    assert math.isclose(step.logprobs[0], raw[step.token_ids[0]].item(), rel_tol=1e-6)
    assert select_tokens(logits[:1], [_row(temperature=0.0)]).token_ids == [0]


def _bitmask(allowed: list[int], vocab: int) -> torch.Tensor:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_allowed_bitmask_restricts_the_draw_and_logprobs_stay_unmasked():
    """Constrained rows choose only allowed tokens (greedy and sampled); their logprob is the unmasked
    log-softmax; an unconstrained row in the same batch is untouched. Vocab 40 spans two bitmask words,
    and token 33 sits in the second word, bit 1; token 31 is the sign bit of the first word."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    logits[:, 5] = 20.0  # the unmasked favourite, allowed nowhere it is masked
    allowed = _bitmask([31, 33], 40)
    for position in range(30):
        rows = [
            RowSampling(0.0, 1.0, -1, 0, position, allowed=allowed),
            RowSampling(1.0, 1.0, -1, 9, position, allowed=allowed),
            RowSampling(0.0, 1.0, -1, 0, position),
        ]
        step = select_tokens(logits, rows)
        assert step.token_ids[0] == (31 if logits[0, 31] > logits[0, 33] else 33)
        assert step.token_ids[1] in (31, 33) and step.token_ids[2] == 5
        raw = torch.log_softmax(logits, dim=-1)
        for i in range(3):
            assert math.isclose(step.logprobs[i], raw[i, step.token_ids[i]].item(), rel_tol=1e-6)
    drawn = {
        select_tokens(logits[1:2], [RowSampling(1.0, 1.0, -1, 9, p, allowed=allowed)]).token_ids[0]
        for p in range(40)
    }
    assert drawn == {31, 33}  # both allowed tokens are drawn: the mask renormalises, it does not pick


def test_device_uniforms_equal_the_python_reference_bit_for_bit():
    rng = __import__("random").Random(0)
    seeds = [0, 1, 7, -1, -(2**63), 2**63 - 1, 2**64 - 1, 2**62 + 5] + [
        rng.getrandbits(64) for _ in range(200)
    ]
    positions = [0, 1, 255, 2**31] + [rng.randrange(100_000) for _ in range(204)]
    from agentrl.rollout.engines._sampling import as_int64, uniform_draws

    device = uniform_draws(torch.tensor([as_int64(s) for s in seeds]), torch.tensor(positions))
    reference = torch.tensor(
        [uniform_draw(s, p) for s, p in zip(seeds, positions, strict=True)], dtype=torch.float32
    )
    assert torch.equal(device, reference)


def test_draws_on_the_device_equal_select_tokens_for_plain_rows():
    from agentrl.rollout.engines._sampling import as_int64, filters_needed, sample_on_device

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 3
    rows = [
        _row(temperature=0.0),
        _row(temperature=1.0, seed=11, position=4),
        _row(temperature=0.7, top_k=5, seed=2**62 + 3, position=90),
        _row(temperature=1.3, top_p=0.8, seed=5, position=0),
        _row(temperature=1.0, top_k=20, top_p=0.5, seed=-9, position=17),
        _row(temperature=0.0, top_k=3),
    ]
    on_host = select_tokens(logits, rows)
    chosen, logprobs = sample_on_device(
        logits,
        torch.tensor([r.temperature for r in rows]),
        torch.tensor([r.top_p for r in rows]),
        torch.tensor([r.top_k for r in rows]),
        torch.tensor([as_int64(r.seed) for r in rows]),
        torch.tensor([r.position for r in rows]),
        filters_needed([r.top_k for r in rows], [r.top_p for r in rows], 300),
    )
    assert chosen.tolist() == on_host.token_ids
    assert torch.allclose(logprobs.double(), torch.tensor(on_host.logprobs, dtype=torch.float64), atol=1e-6)
    assert len(set(on_host.token_ids)) > 2  # the rows really differ
