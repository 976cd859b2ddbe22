"""The actor update alone: `PolicyWorker.update_actor` on a made-up GRPO batch, timed and profiled.

`benchmarks/grpo_step.py` times whole steps; this isolates the update (forward with chunked log-probs and
entropy, backward, clipping, AdamW) so its parts can be read: median time per call, tokens/s, model FLOPs
utilisation (`perf/mfu/actor`'s estimate), peak memory, and with `--profile` the device kernels that took
the time. Each `--micro-batch` value is its own worker on the same batch, measured one after the other.

    python benchmarks/update_step.py --micro-batch 64 128 --profile      # GPU, Qwen2.5-0.5B shape, bf16
    python benchmarks/update_step.py --model tiny:qwen2 --dtype float32 --device cpu --rows 64 --response 16
    python benchmarks/update_step.py --micro-batch 64 --lora-rank 32        # LoRA's update against full's
    python benchmarks/update_step.py --micro-batch 64 --lora-rank 32 --lora-product thin   # one way everywhere
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agentrl.config import load_config
from agentrl.training import lora_fused
from agentrl.training.update.assembly import TrainingRow, rows_to_batch
from agentrl.training.workers.policy_worker import PolicyWorker


def make_batch(rows: int, prompt: int, response: int, group: int, pad_token_id: int, vocab: int):
    """`rows` rows of random tokens (prompt, then response), groups of `group` with +-1 advantages."""
    generator = torch.Generator().manual_seed(0)
    training_rows = []
    for i in range(rows):
        ids = torch.randint(10, vocab - 10, (prompt + response,), generator=generator).tolist()
        training_rows.append(
            TrainingRow(
                ids, [0] * prompt + [1] * response, [-1.0] * len(ids), float(i % 2), str(i // group), str(i)
            )
        )
    batch = rows_to_batch(training_rows, pad_token_id=pad_token_id)
    signs = torch.tensor([1.0 if i % 2 else -1.0 for i in range(rows)])
    batch["advantages"] = torch.where(batch.response_mask, signs[:, None], 0.0)
    batch["returns"] = batch["advantages"].clone()
    return batch


def measure(args: argparse.Namespace, micro_batch: int) -> dict[str, float]:
    config = load_config(
        [
            f"actor_rollout_ref.model.path={args.model}",
            f"actor_rollout_ref.model.dtype={args.dtype}",
            f"actor_rollout_ref.model.enable_gradient_checkpointing={str(not args.no_checkpointing).lower()}",
            f"trainer.device={args.device}",
            f"data.train_batch_size={args.rows // args.group}",
            f"actor_rollout_ref.rollout.n={args.group}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.rows // args.group}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            f"actor_rollout_ref.model.lora_rank={args.lora_rank}",
            f"actor_rollout_ref.model.lora_alpha={2 * max(args.lora_rank, 1)}",
        ]
    )
    worker = PolicyWorker(config, total_steps=args.calls + 1, device=args.device)
    vocab = worker.actor.get_input_embeddings().weight.shape[0]
    batch = make_batch(args.rows, args.prompt, args.response, args.group, worker.tokenizer_pad_id(), vocab)
    cuda = args.device == "cuda"
    times, metrics = [], {}
    for call in range(args.calls + 1):  # the first call warms up (allocator, kernels) and is left out
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = worker.update_actor(batch)
        if cuda:
            torch.cuda.synchronize()
        if call:
            times.append(time.perf_counter() - start)
    result = {
        "micro_batch": micro_batch,
        "update_s": statistics.median(times),
        "tokens_per_s": args.rows * (args.prompt + args.response) / statistics.median(times),
        "mfu": metrics.get("perf/mfu/actor", 0.0),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
    }
    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            worker.update_actor(batch)
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
        print(f"--- micro-batch {micro_batch}: {kernels} device kernels in one update; top by device time:")
        print(
            events.table(sort_by="device_time_total", row_limit=args.profile_rows, max_name_column_width=70)
        )
    del worker
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny:qwen2.5-0.5b-shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=128, help="rows per update (one mini-batch)")
    parser.add_argument("--group", type=int, default=8, help="rows per GRPO group")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--response", type=int, default=256, help="response tokens per row")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--calls", type=int, default=3, help="timed calls after one warm-up call")
    parser.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="LoRA adapters of this rank (alpha 2R) on every linear layer"
    )
    parser.add_argument(
        "--lora-product",
        choices=["auto", "thin", "merged"],
        default="auto",
        help="how every adapted layer computes (agentrl/training/lora_fused.py); auto picks per layer",
    )
    parser.add_argument("--profile", action="store_true", help="profile one more call (CUDA): top kernels")
    parser.add_argument("--profile-rows", type=int, default=25)
    args = parser.parse_args()
    if args.lora_product != "auto":  # the worker runs in this process: its layers read the constant per call
        lora_fused.FLOPS_PER_BYTE = 0 if args.lora_product == "thin" else float("inf")
    torch.manual_seed(0)
    results = [measure(args, size) for size in args.micro_batch]
    print(
        f"{args.model} {args.dtype} on {args.device}: {args.rows} rows x ({args.prompt} + {args.response}) tokens, "
        f"gradient checkpointing {'off' if args.no_checkpointing else 'on'}"
    )
    print(f"{'micro-batch':>12} {'update s':>9} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
    for r in results:
        print(
            f"{r['micro_batch']:>12} {r['update_s']:>9.3f} {r['tokens_per_s']:>10.0f} {r['mfu']:>6.1%} "
            f"{r['peak_gib']:>9.2f}"
        )


if __name__ == "__main__":
    main()
