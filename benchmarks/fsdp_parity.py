"""FSDP2 over N devices against 1: the same first-step loss on the same batch, and the update's time.

Builds one synthetic batch (fixed seed: random prompt and response ids, random advantages), then for each
device count starts a Ray policy worker group, runs `update_actor` on the batch once (first-step pg_loss and
grad_norm) and times `--repeats` more updates at the same global batch. Prints one JSON line per device count
and the ratios. GPU command (docs/benchmarks.md):

    source .device/prelude.sh && python benchmarks/fsdp_parity.py --devices 1 2 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from agentrl.config import load_config
from agentrl.training.update.assembly import TrainingRow, rows_to_batch


def synthetic_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(rows):
        ids = torch.randint(0, vocab, (prompt_len + response_len,), generator=g).tolist()
        items.append(
            TrainingRow(
                input_ids=ids,
                response_mask=[0] * prompt_len + [1] * response_len,
                rollout_log_probs=[0.0] * len(ids),
                reward=float(i % 2),
                group_key=f"g{i // 8}",
                trajectory_key=f"t{i}",
            )
        )
    batch = rows_to_batch(items, pad_token_id=0)
    batch["advantages"] = torch.randn(rows, 1, generator=g) * batch.response_mask
    return batch


def measure(devices: int, args: argparse.Namespace, batch) -> dict:
    from agentrl.training.workers.policy_worker import PolicyWorker
    from agentrl.training.workers.ray_cluster import RayCluster

    config = load_config(
        [
            f"actor_rollout_ref.model.path={args.model}",
            f"actor_rollout_ref.model.dtype={args.dtype}",
            "trainer.backend=ray",
            f"trainer.n_gpus_per_node={devices}",
            f"data.train_batch_size={len(batch) // 8}",
            "actor_rollout_ref.rollout.n=8",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={len(batch) // 8}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.shuffle=false",
        ]
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cluster = RayCluster(config, device)
    try:
        group = cluster.worker_group(
            PolicyWorker,
            devices=devices,
            share=1.0,
            name="policy",
            config=config,
            total_steps=args.repeats + 1,
        )
        first = group.dispatch("update_actor", batch)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            last = group.dispatch("update_actor", batch)
            times.append(time.perf_counter() - start)
        group.shutdown()
    finally:
        cluster.shutdown()
    return {
        "devices": devices,
        "first_pg_loss": first["actor/pg_loss"],
        "first_grad_norm": first["actor/grad_norm"],
        "update_s_median": statistics.median(times),
        "peak_gb_per_device": last.get("perf/max_memory_allocated_gb"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default="tiny:qwen2.5-0.5b-shape")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from agentrl.models import load_tokenizer, resolve_model_path

    vocab = len(load_tokenizer(resolve_model_path(args.model)))
    batch = synthetic_batch(args.rows, args.prompt_len, args.response_len, vocab)
    results = [measure(d, args, batch) for d in args.devices]
    for r in results:
        print(json.dumps(r))
    base = results[0]
    for r in results[1:]:
        rel = abs(r["first_pg_loss"] - base["first_pg_loss"]) / max(abs(base["first_pg_loss"]), 1e-12)
        print(
            f"{r['devices']} vs {base['devices']} devices: pg_loss rel diff {rel:.2e}, grad_norm "
            f"{r['first_grad_norm']:.6g} vs {base['first_grad_norm']:.6g}, update time ratio "
            f"{r['update_s_median'] / base['update_s_median']:.2f}"
        )


if __name__ == "__main__":
    main()
