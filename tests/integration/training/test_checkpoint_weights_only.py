"""Checkpoints load with `torch.load(weights_only=True)`: a tampered file cannot run code on resume."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from agentrl.config import load_config
from agentrl.training.workers.critic_worker import CriticWorker
from agentrl.training.workers.policy_worker import PolicyWorker

pytestmark = pytest.mark.slow

CONFIG = ["actor_rollout_ref.model.path=tiny:qwen2-mini", "algorithm.adv_estimator=gae"]


class _Payload:
    """Unpickling this runs a shell command: what a malicious checkpoint file would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def workers():
    config = load_config(CONFIG)
    return PolicyWorker(config, total_steps=2, device="cpu"), CriticWorker(
        config, total_steps=2, device="cpu"
    )


def test_every_checkpoint_file_loads_with_weights_only(tmp_path, workers):
    for worker in workers:
        worker.save(tmp_path)
    pt_files = sorted(tmp_path.rglob("*.pt"))
    assert {p.name for p in pt_files} >= {"actor_optim.pt", "critic_optim.pt"}
    for path in pt_files:
        torch.load(path, weights_only=True)  # raises UnpicklingError on anything but tensors and plain data
    for worker in workers:
        worker.load(tmp_path)


@pytest.mark.parametrize(("index", "name"), [(0, "actor_optim.pt"), (1, "critic_optim.pt")])
def test_a_tampered_optimizer_file_is_refused_without_running_it(tmp_path, workers, index, name):
    worker = workers[index]
    worker.save(tmp_path)
    marker = tmp_path / "pwned"
    with open(tmp_path / name, "wb") as f:
        pickle.dump({"optimizer": _Payload(marker)}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        worker.load(tmp_path)
    assert not marker.exists()
