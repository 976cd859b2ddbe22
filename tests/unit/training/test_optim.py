"""Learning-rate schedule: linear warm-up, then constant or cosine decay to min_lr_ratio * lr."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.config.schema_workers import OptimConfig
from agentrl.training.optim import build_lr_scheduler, build_optimizer, warmup_steps


def _lrs(optim: OptimConfig, total_steps: int, steps: int) -> list[float]:
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], optim)
    scheduler = build_lr_scheduler(optimizer, optim, total_steps)
    values = []
    for _ in range(steps):
        values.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return values


def test_warmup_then_cosine_values():
    optim = OptimConfig(lr=1.0, lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    lrs = _lrs(optim, total_steps=10, steps=11)
    # warm-up: (step + 1) / (warmup + 1); then 0.1 + 0.9 * (1 + cos(pi * (step - 2) / 8)) / 2.
    expected = [1 / 3, 2 / 3] + [
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 11)
    ]
    assert lrs == pytest.approx(expected)
    assert lrs[2] == pytest.approx(1.0)
    assert lrs[6] == pytest.approx(0.55)
    assert lrs[10] == pytest.approx(0.1)


def test_warmup_from_ratio_then_constant():
    optim = OptimConfig(lr=2.0, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.3, lr_scheduler_type="constant")
    assert warmup_steps(optim, 10) == 3
    assert _lrs(optim, total_steps=10, steps=6) == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0, 2.0])


def test_optimizer_takes_only_trainable_parameters():
    frozen = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    trained = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer([frozen, trained], OptimConfig(lr=0.1))
    assert optimizer.param_groups[0]["params"] == [trained]
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([frozen], OptimConfig(lr=0.1))
