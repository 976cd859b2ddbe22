"""HSDP (`fsdp_config.fsdp_size` dividing the ranks: a 2-D mesh) trains exactly like plain FSDP.

Four gloo processes on CPU build the real `PolicyWorker` twice, once over a 1-D mesh (4,) and once over a
(2 replicate x 2 shard) mesh, and run the same two PPO updates on the same shards of one batch. HSDP changes only
which ranks hold which shard and how gradients are reduced, so losses, gradient norms, log-probs after the
update and the updated weights must agree to float rounding.
"""

from __future__ import annotations

import socket

import pytest
import torch

from agentrl.training.parallel.fsdp import mesh_shape

pytestmark = pytest.mark.slow
WORLD = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(fsdp_size: int):
    from agentrl.config import load_config

    return load_config(
        [
            "actor_rollout_ref.model.path=tiny:qwen2",
            "trainer.backend=ray",
            f"trainer.n_gpus_per_node={WORLD}",
            f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size}",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.shuffle=false",
            "actor_rollout_ref.actor.optim.lr=1e-3",
        ]
    )


def _rank_main(rank: int, port: int, out: str) -> None:
    """One rank: both meshes in turn, the same shard of the same batch; rank 0 saves what it saw."""
    from agentrl.models import load_tokenizer, resolve_model_path
    from agentrl.training.parallel.distributed import destroy_process_group, init_worker_process_group
    from agentrl.training.parallel.served_weights import served_state_dict
    from agentrl.training.workers.dispatch import split_batch
    from agentrl.training.workers.policy_worker import PolicyWorker
    from benchmarks.fsdp_parity import synthetic_batch

    torch.set_num_threads(1)
    init_worker_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}", "cpu")
    try:
        vocab = len(load_tokenizer(resolve_model_path("tiny:qwen2")))
        batch = synthetic_batch(16, prompt_len=6, response_len=10, vocab=vocab)
        shard = split_batch(batch, WORLD, balance_tokens=False)[0][rank]
        results = {}
        for fsdp_size in (-1, 2):
            torch.manual_seed(0)
            worker = PolicyWorker(_config(fsdp_size), total_steps=2)
            param = next(worker.actor.parameters())
            first = worker.update_actor(shard)
            after = worker.compute_log_prob(shard)["old_log_probs"]
            second = worker.update_actor(shard)
            weights = served_state_dict(worker.actor)  # a collective: every rank gathers
            results[fsdp_size] = {
                "mesh": tuple(param.device_mesh.shape),
                "placements": [type(p).__name__ for p in param.placements],
                "local_rows": param.to_local().shape[0],
                "rows": param.shape[0],
                "first": first,
                "second": second,
                "log_probs_after": after,
                "weights": weights,
            }
        if rank == 0:
            torch.save(results, out)
    finally:
        destroy_process_group()


def test_hsdp_on_a_2x2_mesh_trains_like_fsdp_on_4_ranks(tmp_path):
    out = tmp_path / "results.pt"
    torch.multiprocessing.spawn(_rank_main, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    results = torch.load(out, weights_only=False)
    fsdp, hsdp = results[-1], results[2]
    assert fsdp["mesh"] == (4,) and fsdp["placements"] == ["Shard"]
    assert hsdp["mesh"] == (2, 2) and hsdp["placements"] == ["Replicate", "Shard"]
    # each parameter is split in 2 under HSDP (replicated across the 2 groups), in 4 under FSDP
    assert hsdp["local_rows"] == -(-hsdp["rows"] // 2) and fsdp["local_rows"] == -(-fsdp["rows"] // 4)
    for update in ("first", "second"):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert hsdp[update][key] == pytest.approx(fsdp[update][key], rel=1e-5, abs=1e-7), (update, key)
    assert fsdp["first"]["actor/grad_norm"] > 0
    # the update moved the weights, and both meshes moved them alike
    assert (hsdp["log_probs_after"] - fsdp["log_probs_after"]).abs().max() < 1e-5
    assert hsdp["second"]["actor/entropy"] != pytest.approx(hsdp["first"]["actor/entropy"], rel=1e-6)
    assert hsdp["weights"].keys() == fsdp["weights"].keys()
    # Two Adam steps of lr 1e-3 move weights by ~2e-3; the meshes sum gradients in another order (seen: 1.2e-6).
    assert max((hsdp["weights"][k] - fsdp["weights"][k]).abs().max().item() for k in fsdp["weights"]) < 1e-5


def test_mesh_shape_is_1d_2d_or_a_clear_error():
    assert mesh_shape(4, -1) == (4,) and mesh_shape(4, 4) == (4,) and mesh_shape(4, 8) == (4,)
    assert mesh_shape(4, 2) == (2, 2) and mesh_shape(16, 8) == (2, 8) and mesh_shape(4, 1) == (4, 1)
    with pytest.raises(ValueError, match=r"fsdp_size=3 does not divide the 4 ranks.*\[1, 2, 4\]"):
        mesh_shape(4, 3)
