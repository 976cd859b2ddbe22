"""The math cookbook's sums task for the real model (cookbooks/math/agentrl_math/arithmetic.py): distinct, disjoint
rows with the one-line instruction, and the strict and lenient readings of a reply."""

import pytest
from agentrl_math.arithmetic import SumEvaluator, grade, lenient_answer, make_sum_rows, strict_answer

from agentrl import Episode, Task
from agentrl.data import validate_row


def test_rows_are_distinct_disjoint_and_say_the_format():
    train, heldout = make_sum_rows(num_train=1000, num_test=200)
    train_sums = {row["extra_info"]["expression"] for row in train}
    heldout_sums = {row["extra_info"]["expression"] for row in heldout}
    assert len(train_sums) == 1000 and len(heldout_sums) == 200
    assert not train_sums & heldout_sums
    row = heldout[0]
    validate_row(row, 0, "heldout")
    expression, truth = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
    assert row["prompt"] == [
        {"role": "user", "content": f"What is {expression}? Reply with one line: {expression} = <number>"}
    ]
    assert int(truth) == sum(map(int, expression.split(" + ")))
    assert row["extra_info"]["response"] == f"{expression} = {truth}"
    assert make_sum_rows(num_train=1000, num_test=200) == (train, heldout)  # the same sums every time


@pytest.mark.parametrize(
    ("reply", "strict", "lenient"),
    [
        ("23 + 45 = 68", True, True),
        ("  23+45 =68.\n", True, True),
        ("23 + 45 = 67", False, False),
        ("68", False, True),  # the right number, not in the asked-for line
        ("23 + 45 = 68\nThis is because 3 + 5 = 8.", False, False),  # more than the line; last number 8
        ("The sum is 20 + 40 + 8 = 68", False, True),
        ("45 + 23 = 68", False, True),  # the line of another expression
        ("", False, False),
        (None, False, False),
    ],
)
def test_strict_and_lenient_readings(reply, strict, lenient):
    row = {"reward_model": {"ground_truth": "68"}, "extra_info": {"expression": "23 + 45"}}
    assert grade(reply, row) == (strict, lenient)


def test_readings_return_the_number():
    assert strict_answer("23 + 45 = 69", "23 + 45") == "69"
    assert strict_answer("23 + 45 = 68 apples", "23 + 45") is None
    assert lenient_answer("first 12, then -7 and 68.") == "68"
    assert lenient_answer("no digits") is None
    with pytest.raises(ValueError, match="expected an expression"):
        strict_answer("1", "23 - 45")


def test_evaluator_rewards_only_the_right_line():
    task = Task(
        id="t", data={"reward_model": {"ground_truth": "68"}, "extra_info": {"expression": "23 + 45"}}
    )
    right = SumEvaluator().evaluate(task, Episode(answer="23 + 45 = 68"))
    assert (right.reward, right.is_correct, right.metrics) == (
        1.0,
        True,
        {"lenient_correct": 1.0, "format": 1.0},
    )
    wrong_line = SumEvaluator().evaluate(task, Episode(answer="23 + 45 = 70"))
    assert (wrong_line.reward, wrong_line.metrics) == (
        0.0,
        {"lenient_correct": 0.0, "format": 1.0},
    )  # no format-only reward
    number_only = SumEvaluator().evaluate(task, Episode(answer="It is 68"))
    assert (number_only.reward, number_only.metrics) == (0.0, {"lenient_correct": 1.0, "format": 0.0})
