"""The GPU core on a real-size model: run on the device machine (docs/development.md gives the command).

A Qwen2.5-0.5B-shaped model (random weights, offline tokenizer) in bf16: the fingerprint of its 136M-element
embedding, the compiled log-prob head against whole logits, a full and a LoRA policy step with weight sync, and
FSDP2 over 2 GPUs against 1 (when 2 are there).
"""

from __future__ import annotations

import pytest
import torch

from agentrl.config import load_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)"),
]

SHAPE = "tiny:qwen2.5-0.5b-shape"


def test_fingerprint_of_a_tensor_past_2_pow_24_elements_on_cuda():
    from agentrl.rollout.engines._weights import fingerprint_state_dict

    embedding = torch.randn(151936, 896, device="cuda", dtype=torch.bfloat16)
    on_gpu = fingerprint_state_dict({"e": embedding})
    torch.cuda.synchronize()
    assert on_gpu == fingerprint_state_dict({"e": embedding.cpu()})
    changed = embedding.clone()
    changed[-1, -1] += 1  # the last element is sampled
    assert fingerprint_state_dict({"e": changed}) != on_gpu


def test_the_compiled_log_prob_head_equals_whole_logits_on_cuda():
    """What training runs on a GPU (`actor.use_torch_compile`): values and the gradients they send into every
    weight, against the whole (B, L, V) logits in float32 (the 0.5B shape in fp32, 151,936-token vocabulary)."""
    from agentrl.models import load_causal_lm
    from agentrl.training.update.assembly import TrainingRow, rows_to_batch
    from agentrl.training.update.forward import compute_log_probs

    torch.manual_seed(0)
    model = load_causal_lm(SHAPE, dtype="float32", device="cuda")
    rows = [
        TrainingRow(
            torch.randint(10, 150_000, (40,)).tolist(), [0] * 8 + [1] * 32, [0.0] * 40, 1.0, "g", str(i)
        )
        for i in range(4)
    ]
    batch = rows_to_batch(rows, pad_token_id=0)
    ids, mask = batch.input_ids.cuda(), batch.response_mask.cuda()

    def loss_and_grads(log_probs, entropy):
        model.zero_grad(set_to_none=True)
        ((log_probs - 0.1 * entropy) * mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits = model(input_ids=ids, attention_mask=batch.attention_mask.cuda()).logits[:, :-1].float()
    log_softmax = torch.log_softmax(logits, -1)
    want_lp = torch.nn.functional.pad(log_softmax.gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    want_ent = torch.nn.functional.pad(-(log_softmax.exp() * log_softmax).sum(-1), (1, 0))
    want_grads = loss_and_grads(want_lp, want_ent)
    got_lp, got_ent = compute_log_probs(model, batch, with_entropy=True, compile_head=True)
    got_grads = loss_and_grads(got_lp, got_ent)
    assert torch.allclose(got_lp[mask], want_lp[mask], atol=1e-4)
    assert torch.allclose(got_ent[mask], want_ent[mask], atol=1e-4)
    # float32 sums over 128 tokens and 151,936 logits in another order: on the H200 the worst of the embedding's
    # 136M gradient entries differed by 7.3e-5 where its largest is 32.5 (the eager chunked path: 7.7e-5).
    for name, grad in got_grads.items():
        scale = want_grads[name].abs().max()
        assert torch.allclose(grad, want_grads[name], atol=1e-5 * float(scale), rtol=1e-3), name


def _batch_from_rollouts(worker, prompts: int = 4, n: int = 4):
    """Real rollouts from the worker's engine (token ids and logprobs), assembled into a TrainBatch."""
    import asyncio

    from agentrl.training.update.assembly import TrainingRow, rows_to_batch
    from agentrl.types import SamplingParams

    engine = worker.rollout.engine
    rows = []

    async def run():
        for p in range(prompts):
            prompt = worker.tokenizer.encode(f"What is {p} + {p}?")
            outs = await engine.generate(prompt, SamplingParams(n=n, max_tokens=32, temperature=1.0, seed=p))
            for i, out in enumerate(outs):
                rows.append(
                    TrainingRow(
                        input_ids=prompt + out.token_ids,
                        response_mask=[0] * len(prompt) + [1] * len(out.token_ids),
                        rollout_log_probs=[0.0] * len(prompt) + out.logprobs,
                        reward=float(i % 2),
                        group_key=f"t{p}",
                        trajectory_key=f"t{p}-{i}",
                    )
                )

    asyncio.run(run())
    batch = rows_to_batch(rows, pad_token_id=worker.tokenizer_pad_id())
    batch["advantages"] = (batch.rewards - 0.5).unsqueeze(1) * batch.response_mask
    return batch


@pytest.mark.parametrize("lora_rank", [0, 32])
def test_a_bf16_policy_step_with_weight_sync_on_the_0_5b_shape(tmp_path, lora_rank):
    from agentrl.training.workers.policy_worker import PolicyWorker

    config = load_config(
        [
            f"actor_rollout_ref.model.path={SHAPE}",
            "actor_rollout_ref.model.dtype=bfloat16",
            f"actor_rollout_ref.model.lora_rank={lora_rank}",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    worker = PolicyWorker(config, total_steps=2, device="cuda")
    try:
        worker.start_rollout()  # the first sync: fingerprint of the 136M-element embedding included
        batch = _batch_from_rollouts(worker)
        batch["ref_log_probs"] = worker.compute_ref_log_prob(batch)
        metrics = worker.update_actor(batch)
        assert metrics["actor/grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
        sync = worker.sync_weights()  # bf16 LoRA merge: the served fingerprint must match the trainer's
        assert sync["rollout/policy_version"] == 2
        assert not worker.rollout.engine.owns_weights  # LoRA too: the engine serves the trainer's tensors
        after = _batch_from_rollouts(
            worker, prompts=2
        )  # graphs captured before the update read the new merge
        trained = worker.compute_log_prob(after)["old_log_probs"][after.response_mask]
        assert (trained - after.rollout_log_probs[after.response_mask]).abs().max() < 0.25
        assert metrics["perf/max_memory_allocated_gb"] > 0
        assert 0 < metrics["perf/mfu/actor"] < 1  # an H100/H200 has a known peak
    finally:
        worker.shutdown()


def test_training_forwards_on_padded_batches_use_no_cudnn_attention():
    """cuDNN's attention builds a plan for every new shape: 1-2 s stalls inside single updates of an RL run,
    whose batches change shape every step. A worker on CUDA leaves it out: the padded batch's attention, which
    runs on cuDNN when it is allowed, runs on another kernel, and the log-probs agree within bf16 rounding."""
    from torch.profiler import ProfilerActivity, profile

    from agentrl.training.update.assembly import TrainingRow, rows_to_batch
    from agentrl.training.workers.policy_worker import PolicyWorker

    torch.backends.cuda.enable_cudnn_sdp(True)
    config = load_config([f"actor_rollout_ref.model.path={SHAPE}", "actor_rollout_ref.model.dtype=bfloat16"])
    worker = PolicyWorker(config, total_steps=1, device="cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    rows = [
        TrainingRow(
            list(range(10, 30 + 7 * i)), [0] * 8 + [1] * (12 + 7 * i), [0.0] * (20 + 7 * i), 1.0, "g", str(i)
        )
        for i in range(4)
    ]
    batch = rows_to_batch(rows, pad_token_id=0)

    def log_probs_and_cudnn_kernels():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            log_probs = worker.compute_log_prob(batch)["old_log_probs"]
            torch.cuda.synchronize()
        return log_probs, [e.key for e in prof.key_averages() if "cudnn" in e.key.lower()]

    without, kernels = log_probs_and_cudnn_kernels()
    assert not kernels, kernels
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        with_cudnn, kernels = log_probs_and_cudnn_kernels()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)
    assert kernels, (
        "this GPU does not pick cuDNN's attention for a padded batch: the check above proves nothing"
    )
    mask = batch.response_mask.bool()
    assert (without - with_cudnn)[mask].abs().max() < 0.1
