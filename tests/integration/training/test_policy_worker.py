"""PolicyWorker on CPU with its colocated embedded engine: verified weight sync, and LoRA training."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from agentrl.config import load_config
from agentrl.models import load_causal_lm
from agentrl.rollout.engines.embedded import fingerprint_state_dict
from agentrl.training.lora_fused import is_fused, kept_merged_weight
from agentrl.training.parallel.served_weights import served_state_dict
from agentrl.training.update.assembly import TrainingRow, rows_to_batch
from agentrl.training.update.forward import compute_log_probs
from agentrl.training.workers.policy_worker import PolicyWorker
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow

BASE = [
    "actor_rollout_ref.model.path=tiny:qwen2-mini",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.optim.lr=1e-2",
]


def _start(overrides: list[str], *, engine_copy: bool = False) -> PolicyWorker:
    """A worker with its rollout started; `engine_copy`: the engine loads its own copy of the weights (as with
    FSDP shards or offload) instead of serving the actor module, so pushes and their checks are exercised."""
    torch.manual_seed(0)
    worker = PolicyWorker(load_config(BASE + overrides), total_steps=4, device="cpu")
    with pytest.MonkeyPatch.context() as patch:
        if engine_copy:
            patch.setattr(worker, "_engine_can_share_actor", lambda: False)
        worker.start_rollout()
    return worker


@pytest.fixture(scope="module")
def worker():
    worker = _start([], engine_copy=True)
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def shared_worker():
    worker = _start([])
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def lora_worker():
    worker = _start(["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"])
    yield worker
    worker.shutdown()


def _batch(pad_token_id: int):
    """Four rows of made-up tokens: a 4-token prompt, then 3 to 5 'sampled' tokens; two groups."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i, response_len in enumerate([3, 5, 4, 3]):
        ids = torch.randint(10, 1000, (4 + response_len,), generator=generator).tolist()
        rows.append(
            TrainingRow(
                ids,
                [0] * 4 + [1] * response_len,
                [0.0] * len(ids),
                float(i % 2),
                group_key=str(i // 2),
                trajectory_key=str(i),
            )
        )
    batch = rows_to_batch(rows, pad_token_id=pad_token_id)
    batch["advantages"] = torch.where(batch.response_mask, torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None], 0.0)
    return batch


def _train_once(worker: PolicyWorker) -> dict[str, float]:
    batch = _batch(worker.tokenizer_pad_id())
    batch.tensors.update(worker.compute_log_prob(batch))
    return worker.update_actor(batch)


def _served(worker: PolicyWorker) -> str:
    return worker.rollout.engine.weights_fingerprint()


def _trained(worker: PolicyWorker) -> str:
    return fingerprint_state_dict(served_state_dict(worker.actor))


def test_sync_pushes_trained_weights_and_restores_corrupted_ones(worker):
    assert _served(worker) == _trained(worker)
    metrics = _train_once(worker)
    assert metrics["actor/grad_norm"] > 0
    assert _served(worker) != _trained(worker)  # trained, not yet synced
    version = worker.rollout.engine.policy_version
    assert worker.sync_weights() == {"rollout/policy_version": float(version + 1)}
    assert _served(worker) == _trained(worker)
    engine_state = worker.rollout.engine.model.state_dict()
    for name, value in worker.actor.state_dict().items():
        assert torch.equal(engine_state[name], value), name

    with torch.no_grad():
        worker.rollout.engine.model.model.norm.weight.add_(1.0)  # the engine drifts on its own
    assert _served(worker) != _trained(worker)
    worker.sync_weights()
    assert _served(worker) == _trained(worker)


def test_the_engine_serves_the_actor_module_itself_when_it_can(shared_worker, worker, lora_worker):
    worker_, engine = shared_worker, shared_worker.rollout.engine
    assert engine.model is worker_.actor and not engine.owns_weights
    assert lora_worker.rollout.engine.model is not lora_worker.actor  # LoRA: a plain model over its tensors
    before = _served(worker_)
    version = engine.policy_version
    metrics = _train_once(worker_)
    assert metrics["actor/grad_norm"] > 0
    assert worker_.sync_weights() == {"rollout/policy_version": float(version + 1)}  # no copy, a new version
    assert _served(worker_) == _trained(worker_) != before
    worker_.sleep_rollout()  # frees the KV cache only: the actor's weights stay where they are
    assert all(p.device.type == "cpu" for p in worker_.actor.parameters()) and engine.is_sleeping
    worker_.wake_rollout()
    assert (
        not worker_.actor.training
    )  # prefill must not run in train mode (gradient checkpointing drops the cache)
    sampled, scored = _sample_and_score(worker_, worker_.actor)  # the engine samples from the trained weights
    assert torch.allclose(sampled, scored, atol=1e-4)


def _sample_and_score(worker: PolicyWorker, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Six tokens the engine samples after a prompt, with its log-probs, and `model`'s log-probs of them."""
    prompt = _batch(worker.tokenizer_pad_id()).input_ids[0, :4].tolist()
    out = asyncio.run(
        worker.rollout.engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=6, seed=5))
    )[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, 3:-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    return torch.tensor(out.logprobs), expected


def test_a_lora_engine_serves_the_actors_own_tensors_and_a_sync_copies_nothing(lora_worker):
    """LoRA on the hybrid engine: the engine's model is a plain model whose every tensor is one the actor
    holds (its frozen base, each adapted layer's kept merged weight), so nothing is copied at a sync; after an
    update the merge is formed again into the same tensors, and the engine samples from the adapted policy."""
    worker, engine = lora_worker, lora_worker.rollout.engine
    assert not engine.owns_weights
    kept = [kept_merged_weight(m) for m in worker.actor.modules() if is_fused(m)]
    held = {t.data_ptr() for t in (*worker.actor.parameters(), *kept)}
    addresses = {name: t.data_ptr() for name, t in engine.model.state_dict().items()}
    assert kept and all(address in held for address in addresses.values())
    _train_once(worker)
    worker.sync_weights()
    served = engine.model.state_dict()
    assert {name: t.data_ptr() for name, t in served.items()} == addresses  # written in place
    merged = served_state_dict(worker.actor)
    assert all(torch.equal(served[name], merged[name]) for name in merged)
    sampled, scored = _sample_and_score(worker, worker.actor)
    assert torch.allclose(sampled, scored, atol=1e-4)


def test_sync_raises_when_the_engine_does_not_serve_what_was_pushed(worker, monkeypatch):
    engine = worker.rollout.engine
    real_update = engine.update_weights

    def lossy_update(state_dict):
        version = real_update(state_dict)
        with torch.no_grad():  # the push "lands" but one tensor is not what was sent
            engine.model.model.layers[0].mlp.up_proj.weight.add_(1.0)
        return version

    monkeypatch.setattr(engine, "update_weights", lossy_update)
    with pytest.raises(RuntimeError, match="weight sync failed"):
        worker.sync_weights()
    monkeypatch.undo()
    worker.sync_weights()  # a good push heals it
    assert _served(worker) == _trained(worker)


def test_lora_trains_only_adapters(lora_worker):
    params = dict(lora_worker.actor.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.requires_grad for n, p in params.items() if "lora_" in n)
    optimized = {id(p) for group in lora_worker.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(params[n]) for n in trainable}


def test_lora_update_changes_the_served_weights_and_the_reference_is_the_base(lora_worker):
    worker = lora_worker
    before = _served(worker)
    _train_once(worker)
    worker.sync_weights()
    assert _served(worker) != before
    assert _served(worker) == _trained(worker)

    batch = _batch(worker.tokenizer_pad_id())
    base = load_causal_lm(worker.model_path)
    with torch.no_grad():
        expected, _ = compute_log_probs(base, batch)
        served, _ = compute_log_probs(worker.rollout.engine.model, batch)
    reference = worker.compute_ref_log_prob(batch)
    current = worker.compute_log_prob(batch)["old_log_probs"]
    mask = batch.response_mask
    assert torch.allclose(reference[mask], expected[mask], atol=1e-6)
    assert not torch.allclose(current[mask], expected[mask], atol=1e-3)  # the adapter changed the policy
    assert torch.allclose(current[mask], served[mask], atol=1e-4)  # and the engine serves the adapted one


def test_lora_sync_leaves_the_frozen_base_bit_for_bit_unchanged(lora_worker):
    worker = lora_worker
    _train_once(worker)  # non-zero adapters, so the merge changes the served weights
    frozen = {n: p.detach().clone() for n, p in worker.actor.named_parameters() if not p.requires_grad}
    worker.sync_weights()
    changed = [n for n, p in worker.actor.named_parameters() if n in frozen and not torch.equal(p, frozen[n])]
    assert changed == []
    batch = _batch(worker.tokenizer_pad_id())
    with torch.no_grad():
        expected, _ = compute_log_probs(load_causal_lm(worker.model_path), batch)
    assert torch.equal(worker.compute_ref_log_prob(batch)[batch.response_mask], expected[batch.response_mask])


def test_a_non_finite_gradient_skips_the_optimizer_step_and_is_counted(worker, monkeypatch):
    monkeypatch.setattr(worker.config.actor_rollout_ref.actor, "ppo_mini_batch_size", 2)  # 2 mini-batches
    monkeypatch.setattr(worker.config.actor_rollout_ref.actor, "ppo_micro_batch_size_per_gpu", 1)
    batch = _batch(worker.tokenizer_pad_id())
    batch.tensors.update(worker.compute_log_prob(batch))
    batch["advantages"] = torch.where(batch.response_mask, float("nan"), 0.0)
    before = {n: p.detach().clone() for n, p in worker.actor.named_parameters()}
    metrics = worker.update_actor(batch)
    assert metrics["actor/skipped_steps"] == 2.0  # both optimizer steps refused
    for name, param in worker.actor.named_parameters():
        assert torch.equal(param, before[name]), name
    worker.sync_weights()  # the served weights stay what they were, and match


def test_old_log_probs_run_in_micro_batches_of_the_rollout_key_and_match_one_pass(shared_worker, monkeypatch):
    """`rollout.log_prob_micro_batch_size_per_gpu` sets the old-log-prob forwards (4 rows: 2, 2 then 4), and
    the stitched result equals one pass over the batch (the padding a micro-batch drops holds 0)."""
    worker = shared_worker
    batch = _batch(worker.tokenizer_pad_id())
    forwards = []
    hook = worker.actor.register_forward_hook(
        lambda _m, args, kwargs, _o: forwards.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    try:
        results = {}
        for size in (2, 4):
            monkeypatch.setattr(
                worker.config.actor_rollout_ref.rollout, "log_prob_micro_batch_size_per_gpu", size
            )
            results[size] = worker.compute_log_prob(batch)["old_log_probs"]
    finally:
        hook.remove()
    assert forwards == [2, 2, 4]
    torch.testing.assert_close(results[2], results[4], atol=1e-5, rtol=0)
    assert results[4][batch.response_mask.bool()].abs().min() > 0


def test_old_log_probs_are_the_engines_at_the_rollout_temperature(shared_worker, monkeypatch):
    """The engine samples at `rollout.temperature` and reports log softmax(z / T); the actor's log-probs of the
    same tokens are taken at the same T (verl's and TRL's rule), so on-policy they agree, and at another T not."""
    worker = shared_worker
    engine = worker.rollout.engine
    prompt = [11, 42, 97, 5, 260]
    params = SamplingParams(temperature=0.7, max_tokens=12, n=2, seed=4, ignore_eos=True)
    answers = asyncio.run(engine.generate(prompt, params))
    rows = [
        TrainingRow(
            prompt + a.token_ids,
            [0] * len(prompt) + [1] * len(a.token_ids),
            [0.0] * (len(prompt) + 12),
            1.0,
            group_key="g",
            trajectory_key=str(i),
        )
        for i, a in enumerate(answers)
    ]
    batch = rows_to_batch(rows, pad_token_id=worker.tokenizer_pad_id())
    sampled = torch.tensor([a.logprobs for a in answers])
    on = batch.response_mask.bool()

    def old_log_probs(temperature: float) -> torch.Tensor:
        monkeypatch.setattr(worker.config.actor_rollout_ref.rollout, "temperature", temperature)
        return worker.compute_log_prob(batch)["old_log_probs"][on].reshape(sampled.shape)

    torch.testing.assert_close(old_log_probs(0.7), sampled, atol=1e-4, rtol=0)
    assert (old_log_probs(1.0) - sampled).abs().max() > 1e-2  # the untempered policy is another one


def test_bypass_mode_clips_the_ratio_against_the_engines_log_probs(shared_worker, monkeypatch):
    """algorithm.rollout_correction.bypass_mode: PPO's old policy is the engine's. Tokens the engine gave 1 nat
    less than the trainer does have ratio e: clipped where the advantage is positive, and the ratio's mean
    says so; without bypass the same batch's ratio is 1 (the old policy is the current one)."""
    worker = shared_worker
    batch = _batch(worker.tokenizer_pad_id())
    current = worker.compute_log_prob(batch)["old_log_probs"]
    batch.rollout_log_probs = torch.where(batch.response_mask.bool(), current - 1.0, 0.0)

    def ratio_and_clip(bypass: bool) -> tuple[float, float]:
        monkeypatch.setattr(worker.config.algorithm.rollout_correction, "bypass_mode", bypass)
        metrics = worker.update_actor(batch)
        return metrics["actor/ppo_ratio_mean"], metrics["actor/pg_clipfrac"]

    ratio, clipped = ratio_and_clip(True)  # the ratio is taken before the step moves the weights
    assert abs(ratio - math.e) < 1e-3 and clipped > 0.3  # half the rows have positive advantages
    ratio, clipped = ratio_and_clip(False)
    assert abs(ratio - 1.0) < 1e-4 and clipped == 0.0
