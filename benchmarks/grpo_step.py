"""One GRPO workload, agentrl against TRL's GRPOTrainer, alternating A/B in one invocation.

Both train the same model folder on the same prompts: `--prompts` prompts per step x `--n` answers of exactly
`--max-tokens` tokens (EOS masked: agentrl's `actor_rollout_ref.rollout.ignore_eos`, TRL's
`generation_kwargs={"min_new_tokens": ...}`), temperature 1, one optimizer step per step, no KL term, gradient
checkpointing on (TRL's default; `--gradient-checkpointing off` turns it off on both sides), the model's dtype for
weights and compute; `--lora-rank R` trains LoRA adapters of rank R (alpha 2R) on every linear layer on both sides. The reward is a deterministic
function of the answer's text, so groups have non-zero advantages and both really update.

Each A/B round runs each trainer in its own subprocess (so peak memory is its own) for `--steps` steps; the
first step of every run is warm-up and left out. Reported per trainer: median step time, its generation and
training parts, generated tokens/s, peak memory, time to the end of the first step from the trainer's
construction (model load, compilation and graph capture included: the cold start), and the ratio TRL / agentrl
(above 1: agentrl is faster). agentrl's row also gives its peak host memory (process tree RSS, Ray workers
included, and the machine's used memory above the start) and nvidia-smi's peak (`memory_phases.PeakSampler`).
`--memory-phases` also prints agentrl's peak GPU memory per worker call
(`benchmarks/memory_phases.py`). An agentrl run that fails after training its steps (in the final HF export, say)
still reports the steps it logged and its peaks, with the error beside them, and the command exits non-zero.

    python benchmarks/grpo_step.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --device cuda   # GPU
    python benchmarks/grpo_step.py --model tiny:qwen2 --dtype float32 --device cpu \\
        --prompts 8 --n 8 --max-tokens 16 --steps 4 --rounds 1                                     # CPU
TRL must be importable (it is packed for the device machine: ../shared/device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

QUESTIONS = [f"What is {a} plus {b}? Think step by step." for a in range(3, 40, 3) for b in range(2, 9, 3)]


def text_reward(text: str) -> float:
    """Varies between answers (and is cheap), so GRPO advantages are not all zero."""
    return (sum(map(ord, text)) % 97) / 97.0


def _prompts(count: int) -> list[str]:
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]


def _peak_gib(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def _first_line_time(path: Path, start: float, stop: threading.Event, found: list[float]) -> None:
    """Seconds from `start` until `path` holds a line (agentrl's first step written to metrics.jsonl)."""
    while not stop.is_set():
        if path.exists() and path.read_text().strip():
            found.append(time.perf_counter() - start)
            return
        time.sleep(0.05)


def run_agentrl(args: argparse.Namespace) -> dict:
    from memory_phases import PeakSampler

    from agentrl import AgentTrainer, EvalOutput, SingleTurnChatFlow, evaluator

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.memory_phases:
        from memory_phases import record_worker_phases

        record_worker_phases()

    @evaluator
    def score(task, episode):
        return EvalOutput(reward=text_reward(episode.answer or ""))

    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": q}],
            "reward_model": {"ground_truth": ""},
        }
        for q in _prompts(args.prompts * args.steps)
    ]
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            f"actor_rollout_ref.model.path={args.model}",
            f"actor_rollout_ref.model.dtype={args.dtype}",
            f"actor_rollout_ref.model.enable_gradient_checkpointing={args.gradient_checkpointing == 'on'}",
            f"actor_rollout_ref.model.lora_rank={args.lora_rank}",
            f"actor_rollout_ref.model.lora_alpha={2 * max(args.lora_rank, 1)}",
            f"trainer.device={args.device}",
            f"data.train_batch_size={args.prompts}",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"data.max_response_length={args.max_tokens}",
            "actor_rollout_ref.rollout.ignore_eos=true",
            f"actor_rollout_ref.rollout.max_num_seqs={args.prompts * args.n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "data.shuffle=false",
            "sft.enable=false",
            f"trainer.total_training_steps={args.steps}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={run_dir}",
            *args.extra,
        ]
        first_step: list[float] = []
        stop = threading.Event()
        watcher = threading.Thread(
            target=_first_line_time,
            args=(Path(run_dir) / "metrics.jsonl", time.perf_counter(), stop, first_step),
            daemon=True,
        )
        watcher.start()
        sampler = PeakSampler().start()
        error = None
        try:
            AgentTrainer(
                flow=SingleTurnChatFlow(), evaluator=score, train_dataset=rows, config=overrides
            ).train()
        except Exception as exc:  # the steps logged before it are still measured; the error goes beside them
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"
        finally:
            memory = sampler.stop()
            stop.set()
        metrics = Path(run_dir) / "metrics.jsonl"
        history = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    timed = [r for r in history if "timing/step" in r]
    if error and len(timed) < 2:  # the first step is warm-up: nothing measured
        sys.exit(f"agentrl failed after {len(timed)} logged steps, before any measured one: {error}")
    first, *steps = timed
    empty = [r.get("step") for r in steps if "response_length/mean" not in r]
    if empty:  # every episode of the step failed (a timeout, a dead engine): nothing was generated to time
        sys.exit(f"agentrl: steps {empty} trained nothing; the run's 'rollout ... failed' warnings say why")
    tokens = [r["response_length/mean"] * r["batch/rows"] for r in steps]
    parts = sorted({k for r in steps for k in r if k.startswith("timing/")})
    counts = sorted({k for r in steps for k in r if k.startswith("perf/engine_")})
    return {
        "parts_s": {
            k[len("timing/") :]: round(statistics.median(r.get(k, 0.0) for r in steps), 3) for k in parts
        },
        "engine_counts": {k[len("perf/engine_") :]: [r.get(k) for r in steps] for k in counts},
        "step_s": [r["timing/step"] for r in steps],
        "gen_s": [r["timing/gen"] for r in steps],
        "update_s": [r.get("timing/update_actor", 0.0) for r in steps],
        "tokens": tokens,
        "peak_gib": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in history)
        or _peak_gib(args.device),
        "peak_reserved_gib": max(r.get("perf/max_memory_reserved_gb", 0.0) for r in history),
        "peak_gpu_used_gib": memory["gpu_used"],
        "peak_host_rss_gib": memory["host_rss"],
        "peak_host_used_gib": memory["host_used"],
        "first_step_s": first_step[0] if first_step else float("nan"),
        # The first update's figures, for parity between runs that differ only in where they ran (scale.py).
        "first_update": {k: first.get(k) for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy")},
        "error": error,
    }


def run_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agentrl.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(args.model)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": q}]} for q in _prompts(args.prompts * args.steps)]
    )
    step_s: list[float] = []
    constructed = time.perf_counter()
    first_step: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.start = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            if args.device == "cuda":
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - self.start)
            if not first_step:
                first_step.append(time.perf_counter() - constructed)

    def reward(completions, **_kwargs):
        return [text_reward(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.prompts * args.n,
            num_generations=args.n,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            max_completion_length=args.max_tokens,
            generation_kwargs={"min_new_tokens": args.max_tokens},
            temperature=1.0,
            learning_rate=1e-6,
            beta=0.0,
            max_steps=args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=args.dtype == "bfloat16",
            use_cpu=args.device == "cpu",
            gradient_checkpointing=args.gradient_checkpointing == "on",
            model_init_kwargs={"dtype": args.dtype},
            shuffle_dataset=False,
            seed=1,
        )
        trainer = GRPOTrainer(
            model=str(path),
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=_trl_lora(args.lora_rank),
        )
        gen_s: list[float] = []
        generate = trainer._generate

        def timed_generate(*a, **k):
            start = time.perf_counter()
            result = generate(*a, **k)
            if args.device == "cuda":
                torch.cuda.synchronize()
            gen_s.append(time.perf_counter() - start)
            return result

        trainer._generate = timed_generate
        trainer.add_callback(StepTimer())
        trainer.train()
        lengths = [
            r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r
        ]
    rows = args.prompts * args.n
    return {
        "step_s": step_s[1:],
        "gen_s": gen_s[1:],
        "tokens": [length * rows for length in lengths][1:],
        "peak_gib": _peak_gib(args.device),
        "first_step_s": first_step[0] if first_step else float("nan"),
    }


def _trl_lora(rank: int):
    """The LoRA agentrl trains with `lora_rank=rank`: every linear layer but the head, alpha 2 x rank."""
    if rank == 0:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"
    )


def run_trainer_process(
    script: str, argv: list[str], name: str, *, show_log: bool = False
) -> tuple[dict, str]:
    """Run `script argv --only name` in a fresh Python (so its peak memory and start-up are its own); returns the
    dict it printed on its `RESULT <json>` line and its whole stdout. With `show_log` its stderr (the trainer's
    log) and the rest of its stdout (the console's line per step) go to this terminal as it runs. Exits, with the
    stderr's tail when captured, if it failed without a result; one that failed after printing its result (its
    `error` set) is returned, its stderr's tail shown."""
    command = [sys.executable, script, *argv, "--only", name]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=None if show_log else subprocess.PIPE, text=True
    ) as child:
        if show_log:
            out = []
            for line in child.stdout:
                out.append(line)
                if not line.startswith("RESULT "):
                    print(line, end="", file=sys.stderr, flush=True)
            stdout, stderr = "".join(out), None
            child.wait()
        else:
            stdout, stderr = child.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    log_tail = (stderr or "(its log is above)")[-4000:]
    if not lines:
        sys.exit(f"{name} failed (exit {child.returncode}):\n{log_tail}")
    if child.returncode != 0:
        print(
            f"{name} failed (exit {child.returncode}) after its measured steps:\n{log_tail}", file=sys.stderr
        )
    return json.loads(lines[-1][len("RESULT ") :]), stdout


def summarise(runs: list[dict]) -> dict:
    step = [s for r in runs for s in r["step_s"]]
    gen = [s for r in runs for s in r["gen_s"]]
    tokens = [t for r in runs for t in r["tokens"]]
    median_gen = statistics.median(gen)
    return {
        "step_s": round(statistics.median(step), 3),
        "gen_s": round(median_gen, 3),
        "train_s": round(statistics.median(step) - median_gen, 3),
        "gen_tokens_per_s": round(statistics.median(tokens) / median_gen, 1),
        "peak_gib": round(max(r["peak_gib"] for r in runs), 2),
        "first_step_s": round(statistics.median(r["first_step_s"] for r in runs), 2),
        "steps_measured": len(step),
        **{  # agentrl only (a TRL run reports peak_gib alone)
            key: round(max(r[key] for r in runs), 2)
            for key in ("peak_reserved_gib", "peak_gpu_used_gib", "peak_host_rss_gib", "peak_host_used_gib")
            if all(key in r for r in runs)
        },
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny:qwen2.5-0.5b-shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--micro-batch", type=int, default=64, help="agentrl rows per forward/backward (TRL: all at once)"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="agentrl: Python's GIL switch interval in seconds (default 0.005)",
    )
    parser.add_argument("--gradient-checkpointing", choices=["on", "off"], default="on", help="both trainers")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="LoRA adapters of this rank on both sides (0: off)"
    )
    parser.add_argument(
        "--memory-phases", action="store_true", help="agentrl: peak GPU memory per worker call"
    )
    parser.add_argument("--extra", nargs="*", default=[], help="more agentrl overrides (key=value)")
    parser.add_argument("--trainers", nargs="+", choices=["agentrl", "trl"], default=["agentrl", "trl"])
    parser.add_argument("--only", choices=["agentrl", "trl"], help="internal: run one trainer, print JSON")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.only:
        result = run_agentrl(args) if args.only == "agentrl" else run_trl(args)
        print("RESULT " + json.dumps(result), flush=True)
        if result.get("error"):
            sys.exit(1)
        return
    runs: dict[str, list[dict]] = {name: [] for name in args.trainers}
    for round_index in range(args.rounds):
        for name in args.trainers if round_index % 2 == 0 else args.trainers[::-1]:
            result, stdout = run_trainer_process(__file__, sys.argv[1:], name)
            runs[name].append(result)
            print(f"round {round_index + 1}: {name} steps {[round(s, 2) for s in runs[name][-1]['step_s']]}")
            if result.get("error"):
                print(f"round {round_index + 1}: {name} failed after these steps: {result['error']}")
            print("\n".join(line for line in stdout.splitlines() if line.startswith("MEMORY ")))
    table = {name: summarise(r) for name, r in runs.items()}
    print(
        f"{args.model} {args.dtype} on {args.device}: {args.prompts} prompts x {args.n} answers x {args.max_tokens}"
    )
    print(
        f"{'':10} {'step s':>8} {'gen s':>8} {'train s':>8} {'gen tok/s':>10} {'peak GiB':>9} {'first s':>8}"
    )
    for name, row in table.items():
        print(
            f"{name:10} {row['step_s']:>8.2f} {row['gen_s']:>8.2f} {row['train_s']:>8.2f} "
            f"{row['gen_tokens_per_s']:>10.0f} {row['peak_gib']:>9.1f} {row['first_step_s']:>8.1f}"
        )
    ratio = {}
    if set(table) == {"agentrl", "trl"}:
        ratio = {k: round(table["trl"][k] / table["agentrl"][k], 2) for k in ("step_s", "gen_s", "train_s")}
        print(f"TRL / agentrl time (above 1: agentrl faster): {ratio}")
    if "agentrl" in runs:
        row = table["agentrl"]
        print(
            f"agentrl peak memory: GPU {row['peak_gib']:.1f} GiB allocated, {row['peak_reserved_gib']:.1f} GiB "
            f"reserved (torch, the worker), {row['peak_gpu_used_gib']:.1f} GiB used (nvidia-smi); host "
            f"{row['peak_host_rss_gib']:.1f} GiB RSS (process tree), {row['peak_host_used_gib']:.1f} GiB used "
            f"above the start (machine)"
        )
        print(f"agentrl step parts (median s, last run): {runs['agentrl'][-1]['parts_s']}")
        print(f"agentrl engine counts per step (last run): {runs['agentrl'][-1]['engine_counts']}")
    errors = {name: [r["error"] for r in rs if r.get("error")] for name, rs in runs.items()}
    errors = {name: e for name, e in errors.items() if e}
    print(json.dumps({"table": table, "ratio_trl_over_agentrl": ratio, "errors": errors}))
    if errors:
        sys.exit(f"measured, but runs failed: {errors}")


if __name__ == "__main__":
    main()
