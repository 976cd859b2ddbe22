"""The default run's task: distinct problems, nothing held out is trained on, sums never carry, and the shipped
samples are what the generator writes with its defaults."""

from __future__ import annotations

import json
import random

import pytest

from agentrl.data import sample_path
from agentrl.tasks.arithmetic import distinct_problems, main, make_rows, two_digit_sum


def _expressions(rows):
    return [row["extra_info"]["expression"] for row in rows]


def test_two_digit_sums_never_carry():
    rng = random.Random(0)
    for _ in range(500):
        expression, answer = two_digit_sum(rng)
        a, b = (int(x) for x in expression.split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and answer == a + b
        assert a % 10 + b % 10 <= 9 and a // 10 + b // 10 <= 9, expression


def test_held_out_problems_are_distinct_and_never_trained_on():
    train, test = make_rows(1000, 200, seed=5)
    assert len(train) == 1000 and len(test) == 200
    everything = _expressions(train) + _expressions(test)
    assert len(set(everything)) == 1200
    for row in train + test:
        a, b = (int(x) for x in row["extra_info"]["expression"].split(" + "))
        assert row["reward_model"]["ground_truth"] == str(a + b) == row["extra_info"]["response"]


def test_distinct_problem_counts_and_the_error_past_them():
    # tens digits 1..8 whose sum is at most 9: 36 pairs; units 0..9 with sum at most 9: 55 pairs.
    assert distinct_problems("two-digit", 9) == 36 * 55
    # single-digit, operands 0..9: 100 ordered sums + 55 differences a - b with a >= b.
    assert distinct_problems("single-digit", 9) == 155
    with pytest.raises(ValueError, match="only 1980 distinct two-digit problems; asked for 1900 \\+ 100"):
        make_rows(1900, 100)
    with pytest.raises(ValueError, match="unknown kind 'carry'"):
        make_rows(10, 10, kind="carry")
    train, test = make_rows(115, 40, kind="single-digit")
    assert len(set(_expressions(train + test))) == 155


def test_shipped_samples_are_the_generator_defaults(tmp_path):
    main(["--output", str(tmp_path)])
    for name in ("arithmetic_train", "arithmetic_test"):
        shipped = [json.loads(line) for line in open(sample_path(name))]
        written = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
        assert shipped == written, name
    assert len(shipped) == 200
