"""The local backend's mixed precision: float32 master weights (`actor.fsdp_config.model_dtype=float32`) computing
in `model.dtype=bfloat16` under autocast, as TRL's `bf16=True` on a float32 model does; on CPU with the colocated
embedded engine, which serves a bfloat16 copy."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import load_config
from agentrl.rollout.engines.embedded import fingerprint_state_dict
from agentrl.training.parallel.served_weights import served_state_dict
from agentrl.training.update.forward import compute_log_probs
from agentrl.training.workers.policy_worker import PolicyWorker
from tests.integration.training.test_policy_worker import BASE, _batch

pytestmark = pytest.mark.slow

MIXED = [
    *BASE,
    "actor_rollout_ref.model.dtype=bfloat16",
    "actor_rollout_ref.actor.fsdp_config.model_dtype=float32",
    "actor_rollout_ref.actor.optim.lr=1e-5",
    "actor_rollout_ref.actor.use_kl_loss=true",
]


@pytest.fixture(scope="module")
def worker():
    torch.manual_seed(0)
    worker = PolicyWorker(load_config(MIXED), total_steps=4, device="cpu")
    worker.start_rollout()
    yield worker
    worker.shutdown()


def test_master_weights_are_float32_and_log_probs_compute_in_bfloat16(worker):
    assert {p.dtype for p in worker.actor.parameters()} == {torch.float32}
    assert {p.dtype for p in worker.ref.parameters()} == {torch.bfloat16}  # frozen: no master copy
    batch = _batch(worker.tokenizer_pad_id())
    old = worker.compute_log_prob(batch)["old_log_probs"]
    with torch.no_grad():
        in_float32 = compute_log_probs(worker.actor, batch)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            in_bfloat16 = compute_log_probs(worker.actor, batch)[0]
    assert torch.equal(old, in_bfloat16)
    assert not torch.allclose(old, in_float32, atol=1e-4)


def test_the_update_keeps_steps_that_bfloat16_weights_would_round_away(worker):
    before = {n: p.detach().clone() for n, p in worker.actor.named_parameters()}
    batch = _batch(worker.tokenizer_pad_id())
    batch.tensors.update(worker.compute_log_prob(batch))
    batch["ref_log_probs"] = worker.compute_ref_log_prob(batch)
    metrics = worker.update_actor(batch)
    assert metrics["actor/grad_norm"] > 0
    moved = kept_only_in_float32 = 0
    for name, param in worker.actor.named_parameters():
        changed = param.detach() != before[name]
        moved += int(changed.sum())
        same_in_bf16 = param.detach().bfloat16() == before[name].bfloat16()
        kept_only_in_float32 += int((changed & same_in_bf16).sum())
    # an lr of 1e-5 moves weights by less than bfloat16's spacing: most steps exist only in the master weights
    assert moved > 0 and kept_only_in_float32 > moved / 2
    states = list(worker.optimizer.state.values())
    assert states and all(s["exp_avg_sq"].dtype == torch.float32 for s in states)


def test_the_engine_serves_the_master_weights_rounded_to_bfloat16(worker):
    engine = worker.rollout.engine
    assert engine.model is not worker.actor
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    worker.sync_weights()  # raises unless the engine's fingerprint is the pushed one
    rounded = served_state_dict(worker.actor, torch.bfloat16)
    assert engine.weights_fingerprint() == fingerprint_state_dict(rounded)
    served = engine.model.state_dict()
    for name, value in worker.actor.state_dict().items():
        assert torch.equal(served[name], value.bfloat16()), name


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["actor_rollout_ref.model.dtype=bfloat16"], True),
        (
            [
                "actor_rollout_ref.model.dtype=bfloat16",
                "actor_rollout_ref.actor.fsdp_config.model_dtype=float32",
            ],
            False,
        ),
        (
            ["actor_rollout_ref.model.dtype=bfloat16", "actor_rollout_ref.model.lora_rank=4"],
            False,
        ),  # float32 adapters
        (["actor_rollout_ref.model.dtype=float32"], False),
    ],
    ids=["bfloat16-weights", "float32-master", "lora", "float32"],
)
def test_bfloat16_weights_that_would_drop_most_steps_are_named_loudly(caplog, overrides, warned):
    config = load_config([*BASE, "actor_rollout_ref.actor.optim.lr=1e-6", *overrides])
    with caplog.at_level("WARNING", logger="agentrl"):
        PolicyWorker(config, total_steps=1, device="cpu").shutdown()
    messages = [r.getMessage() for r in caplog.records if "round away" in r.getMessage()]
    assert bool(messages) == warned
    if warned:
        assert "actor.optim.lr=1e-06" in messages[0] and "fsdp_config.model_dtype=float32" in messages[0]
