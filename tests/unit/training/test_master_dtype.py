"""`fsdp_config.model_dtype`: the dtype of a sharded worker's master weights (and so of its gradients and AdamW
moments), on a one-rank gloo group in this process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from agentrl.config import load_config
from agentrl.training.workers.critic_worker import CriticWorker
from agentrl.training.workers.policy_worker import PolicyWorker

BASE = ["actor_rollout_ref.model.path=tiny:qwen2-mini", "actor_rollout_ref.model.dtype=float32"]


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("model_dtype", "expected"), [(None, torch.float32), ("bfloat16", torch.bfloat16)])
def test_sharded_master_weights_gradients_and_moments_take_model_dtype(one_rank_group, model_dtype, expected):
    key = "actor_rollout_ref.actor.fsdp_config.model_dtype"
    overrides = BASE + ([f"{key}={model_dtype}"] if model_dtype else [])
    worker = PolicyWorker(load_config(overrides), total_steps=1, device="cpu")
    params = list(worker.actor.parameters())
    assert all(isinstance(p, DTensor) and p.dtype == expected for p in params)
    ids = torch.tensor([[1, 100, 200, 300, 2]])
    worker.actor(input_ids=ids, labels=ids).loss.backward()
    worker.optimizer.step()
    assert all(p.grad.dtype == expected for p in params)
    moments = [s["exp_avg_sq"] for s in worker.optimizer.state.values()]
    assert len(moments) == len(params) and all(m.dtype == expected for m in moments)


def test_the_critic_takes_its_own_model_dtype(one_rank_group):
    overrides = [*BASE, "algorithm.adv_estimator=gae", "critic.fsdp_config.model_dtype=bfloat16"]
    critic = CriticWorker(load_config(overrides), total_steps=1, device="cpu")
    assert {p.dtype for p in critic.model.parameters()} == {torch.bfloat16}
