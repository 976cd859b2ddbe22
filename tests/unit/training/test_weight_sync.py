"""Probe checks of the weight sync: tolerances, gaps, and scoring tokens with a model of known log-probs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from agentrl.rollout.serving import ProbeResult
from agentrl.training.parallel.weight_sync import check_probe, max_logprob_gap, probe_tolerance, score_tokens


class BigramLM(torch.nn.Module):
    """logits[t] = table[input_ids[t]]: the next token's distribution depends only on the current one."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])


@pytest.fixture
def model() -> BigramLM:
    # After token 0: logits [0, ln 3, 0] -> probs [1/5, 3/5, 1/5]. After token 1: uniform over 3.
    table = torch.tensor([[0.0, math.log(3.0), 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    return BigramLM(table).train()


def test_probe_tolerance_is_tight_only_when_both_sides_are_float32():
    assert probe_tolerance("float32", "float32") == 1e-3
    assert probe_tolerance("float32", "bfloat16") == 0.25
    assert probe_tolerance("bfloat16", "float32") == 0.25
    assert probe_tolerance("float32", "auto") == 0.25


def test_max_logprob_gap():
    assert max_logprob_gap([-1.0, -2.0], [-1.5, -1.75]) == 0.5
    assert max_logprob_gap([-1.0], [-1.0, -2.0]) == math.inf  # the server returned fewer tokens
    assert max_logprob_gap([], []) == math.inf


def test_score_tokens_gives_each_tokens_log_prob_and_keeps_train_mode(model):
    # prompt [2, 0]; then token 1 (after 0: 3/5), then token 2 (after 1: 1/3)
    scores = score_tokens(model, [2, 0], [1, 2])
    assert scores == pytest.approx([math.log(3 / 5), math.log(1 / 3)], abs=1e-6)
    assert model.training


def test_check_probe_returns_the_worst_gap_and_names_the_server_that_is_off(model):
    prompt = [2, 0]
    good = ProbeResult("http://a", [1, 2], [math.log(3 / 5) + 2e-4, math.log(1 / 3)])
    assert check_probe(model, prompt, [good], tolerance=1e-3) == pytest.approx(2e-4, abs=1e-6)
    stale = ProbeResult(
        "http://b", [1, 2], [math.log(1 / 3), math.log(1 / 3)]
    )  # as if the table were uniform
    # gap |ln(1/3) - ln(3/5)| = ln(9/5) = 0.5878
    with pytest.raises(RuntimeError, match=r"server http://b log-probs differ from the trainer's by 0\.588"):
        check_probe(model, prompt, [good, stale], tolerance=1e-3)
