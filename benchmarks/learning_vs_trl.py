"""One learning problem trained by agentrl and by TRL's GRPOTrainer: held-out accuracy against steps and wall-clock.

The problem is the math cookbook's two-digit sums in a strict one-line format (`agentrl_math.arithmetic`): the same
model, the same 1,000 training problems in the same order (shuffled by `--seed`), the same held-out problems and
the same reward (`SumEvaluator`: 1 for the one-line equation with the right sum). Both run GRPO with the same
settings: `--prompts` problems x `--n` answers per step (the group), one optimizer step per step (AdamW, constant
`--lr`, weight decay 0.01, gradient clip 1.0), `--temperature`, answers of up to `--max-tokens` tokens ending at EOS,
advantages normalised by the group's std, token-mean loss (TRL's `dapo`), clip 0.2, and a k3 KL term to the
starting model with weight `--kl` (TRL's `beta`; agentrl's `low_var_kl`). Each trainer runs in its own process.

Held-out accuracy is measured by ONE function, `evaluate_heldout`, on each trainer's live weights in its own
process, before the first step and every `--eval-every` steps (and after the last): greedy answers of up to
`--eval-max-tokens` tokens with transformers' `generate`, read strictly (the reward) and leniently (the last
integer anywhere in the answer). TRL calls it from a `TrainerCallback` (`on_train_begin`, `on_step_end`) with the
model it trains; agentrl calls it from its validation, which this script replaces in its own process with a
function that hands the local policy worker's actor to `evaluate_heldout` (agentrl's own validation, through its
engine, does not run). Wall-clock runs from the trainer's construction (model loading, engine start and compilation
included) and stops while evaluating, so both trainers' curves count training time only.

Prints a markdown table (step, wall s, strict and lenient accuracy per trainer) and writes `results.json` and
`learning_vs_trl.png` (accuracy against steps and against wall-clock) into `--out`, with agentrl's metrics of every
step (`agentrl.metrics.jsonl`: timings, engine counters).

    python benchmarks/learning_vs_trl.py --device cuda                                    # GPU: 100 steps, 32 x 8
    python benchmarks/learning_vs_trl.py --device cpu --steps 4 --prompts 8 --n 4 --max-tokens 32 \\
        --eval-every 4 --eval-problems 32 --eval-max-tokens 64                            # CPU smoke
    python benchmarks/learning_vs_trl.py --eval-only --device cpu                         # the starting accuracy

Needs the `smollm2-135m-instruct` preset (`make setup-smollm2`), TRL (for `--trainers trl`) and the math cookbook
(`pip install -e cookbooks/math`; found in the checkout otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
# grpo_step's helpers, and agentrl_math where the cookbook is not installed
sys.path += [str(_ROOT / "benchmarks"), str(_ROOT / "cookbooks" / "math")]

from agentrl_math.arithmetic import SumEvaluator, grade, make_sum_rows  # noqa: E402
from grpo_step import _peak_gib, run_trainer_process  # noqa: E402

TRAINERS = ("agentrl", "trl")
WEIGHT_DECAY = 0.01
"""agentrl's default AdamW weight decay; TRL is given the same."""


def evaluate_heldout(
    model: Any,
    tokenizer: Any,
    rows: list[dict],
    *,
    max_tokens: int,
    batch_size: int,
    compute_dtype: str | None = None,
) -> dict:
    """Greedy answers of `model` to `rows` (chat template, up to `max_tokens` new tokens, transformers'
    `generate`), graded strictly and leniently (`agentrl_math.arithmetic.grade`); the model's train/eval mode is
    restored. `tokenizer` pads on the left. `compute_dtype`: generate under autocast to it (mixed precision: the
    dtype both trainers compute in). Returns {"strict": share, "lenient": share}."""
    import contextlib

    import torch

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    strict = lenient = 0
    precision = (
        torch.autocast(device.type, dtype=getattr(torch, compute_dtype))
        if compute_dtype
        else contextlib.nullcontext()
    )
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            texts = [
                tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
                for row in chunk
            ]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.no_grad(), precision:
                out = model.generate(
                    **inputs,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    use_cache=True,  # off in the config of a model trained with gradient checkpointing
                    pad_token_id=tokenizer.pad_token_id,
                )
            answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            for answer, row in zip(answers, chunk, strict=True):
                right, near = grade(answer, row)
                strict, lenient = strict + right, lenient + near
    finally:
        model.train(was_training)
    return {"strict": strict / len(rows), "lenient": lenient / len(rows)}


def load_eval_tokenizer(model: str) -> Any:
    from agentrl.models import load_tokenizer

    tokenizer = load_tokenizer(model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class HeldOutClock:
    """Held-out accuracy at points of one training run, with the wall-clock time since the trainer's
    construction less the time spent evaluating."""

    def __init__(self, name: str, args: argparse.Namespace, rows: list[dict]) -> None:
        self.name, self.args, self.rows = name, args, rows
        self.tokenizer = load_eval_tokenizer(args.model)
        self.points: list[dict] = []
        self.log = Path(args.out) / f"{name}.points.jsonl"
        self.log.unlink(missing_ok=True)
        self.paused = 0.0
        self.start = time.perf_counter()

    def restart(self) -> None:
        """Wall-clock 0: call right before the trainer is constructed."""
        self.start = time.perf_counter()

    def record(self, model: Any, step: int) -> dict:
        self._sync()
        began = time.perf_counter()
        accuracy = evaluate_heldout(
            model,
            self.tokenizer,
            self.rows,
            max_tokens=self.args.eval_max_tokens,
            batch_size=self.args.eval_batch,
            compute_dtype=self.args.dtype if self.args.master_dtype != self.args.dtype else None,
        )
        self._sync()
        spent = time.perf_counter() - began
        point = {"step": step, "wall_s": round(began - self.start - self.paused, 2), **accuracy}
        self.paused += spent
        self.points.append({**point, "eval_s": round(spent, 2)})
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:  # kept as it goes: a run cut short still leaves its curve
            log.write(json.dumps(self.points[-1]) + "\n")
        print(f"{self.name} held-out {point} (evaluated in {spent:.1f} s)", file=sys.stderr, flush=True)
        return accuracy

    def _sync(self) -> None:
        if self.args.device == "cuda":
            import torch

            torch.cuda.synchronize()


def build_data(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The training rows in the order both trainers take them (`--steps` x `--prompts`, cycling through the
    shuffled 1,000), and the first `--eval-problems` held-out rows."""
    train, heldout = make_sum_rows(seed=0)
    random.Random(args.seed).shuffle(train)
    needed = args.steps * args.prompts
    return [train[i % len(train)] for i in range(needed)], heldout[: args.eval_problems]


def run_agentrl(args: argparse.Namespace) -> dict:
    from agentrl import AgentTrainer, SingleTurnChatFlow
    from agentrl.training.controller import Controller

    train, heldout = build_data(args)
    clock = HeldOutClock("agentrl", args, heldout)

    def validate(controller: Controller) -> dict[str, float]:
        worker = getattr(controller.policy, "worker", None)  # trainer.backend=local: the worker is in-process
        if worker is None:
            raise SystemExit(
                "learning_vs_trl.py evaluates agentrl's policy in-process: use trainer.backend=local"
            )
        accuracy = clock.record(worker.actor, controller.global_step)
        return {"val/strict_accuracy": accuracy["strict"], "val/lenient_accuracy": accuracy["lenient"]}

    Controller.validate = validate  # this process only: held-out accuracy by the function TRL's side uses too
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            f"actor_rollout_ref.model.path={args.model}",
            f"actor_rollout_ref.model.dtype={args.dtype}",
            f"actor_rollout_ref.actor.fsdp_config.model_dtype={args.master_dtype}",
            f"actor_rollout_ref.model.enable_gradient_checkpointing={args.gradient_checkpointing == 'on'}",
            f"trainer.device={args.device}",
            f"trainer.seed={args.seed}",
            f"data.train_batch_size={args.prompts}",
            "data.shuffle=false",
            f"data.max_response_length={args.max_tokens}",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"actor_rollout_ref.rollout.temperature={args.temperature}",
            f"actor_rollout_ref.rollout.max_num_seqs={max(64, args.prompts * args.n)}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
            f"actor_rollout_ref.actor.optim.lr={args.lr}",
            f"actor_rollout_ref.actor.optim.weight_decay={WEIGHT_DECAY}",
            "actor_rollout_ref.actor.loss_agg_mode=token-mean",
            f"actor_rollout_ref.actor.use_kl_loss={args.kl > 0}",
            f"actor_rollout_ref.actor.kl_loss_coef={args.kl}",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
            "algorithm.adv_estimator=grpo",
            "algorithm.norm_adv_by_std_in_grpo=true",
            "sft.enable=false",
            f"trainer.total_training_steps={args.steps}",
            "trainer.val_before_train=true",
            f"trainer.test_freq={args.eval_every}",
            "trainer.save_freq=-1",
            "trainer.logger=[console]",
            f"trainer.default_local_dir={run_dir}",
            *args.extra,
        ]
        clock.restart()
        AgentTrainer(
            flow=SingleTurnChatFlow(),
            evaluator=SumEvaluator(),
            config=overrides,
            train_dataset=train,
            val_dataset=heldout,
        ).train()
        for history in Path(run_dir).rglob("metrics.jsonl"):  # every step's metrics, kept beside the curve
            shutil.copyfile(history, Path(args.out) / "agentrl.metrics.jsonl")
    return {"points": clock.points, "peak_gib": round(_peak_gib(args.device), 2)}


def run_trl(args: argparse.Namespace) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agentrl import Episode, Task
    from agentrl.models import load_tokenizer, resolve_model_path

    train, heldout = build_data(args)
    clock = HeldOutClock("trl", args, heldout)
    grader = SumEvaluator()

    def reward(completions, reward_model, extra_info, **_kwargs) -> list[float]:
        """SumEvaluator's reward, as agentrl computes it."""
        return [
            grader.evaluate(
                Task(id="trl", data={"reward_model": truth, "extra_info": info}),
                Episode(answer=completion[0]["content"]),
            ).reward
            for completion, truth, info in zip(completions, reward_model, extra_info, strict=True)
        ]

    class HeldOut(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **_kwargs):
            clock.record(model, 0)

        def on_step_end(self, _args, state, control, model=None, **_kwargs):
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                clock.record(model, state.global_step)

    dataset = Dataset.from_list(
        [{key: row[key] for key in ("prompt", "reward_model", "extra_info")} for row in train]
    )
    tokenizer = load_tokenizer(args.model)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            # one generation of prompts x n answers, trained as one optimizer step in micro-batches of --micro-batch
            per_device_train_batch_size=args.micro_batch,
            num_generations=args.n,
            gradient_accumulation_steps=args.prompts * args.n // args.micro_batch,
            steps_per_generation=args.prompts * args.n // args.micro_batch,
            num_iterations=1,
            max_completion_length=args.max_tokens,
            temperature=args.temperature,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            weight_decay=WEIGHT_DECAY,
            max_grad_norm=1.0,
            beta=args.kl,
            epsilon=0.2,
            loss_type="dapo",
            scale_rewards="group",
            max_steps=args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=args.dtype == "bfloat16",
            use_cpu=args.device == "cpu",
            gradient_checkpointing=args.gradient_checkpointing == "on",
            model_init_kwargs={"dtype": args.master_dtype},  # bf16=True on float32: autocast
            shuffle_dataset=False,
            seed=args.seed,
        )
        clock.restart()
        trainer = GRPOTrainer(
            model=str(resolve_model_path(args.model)),
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[HeldOut()],
        )
        trainer.train()
    return {"points": clock.points, "peak_gib": round(_peak_gib(args.device), 2)}


def run_eval_only(args: argparse.Namespace) -> dict:
    """The starting model's held-out accuracy, once: no training."""
    from agentrl.models import load_causal_lm

    _, heldout = build_data(args)
    model = load_causal_lm(args.model, dtype=args.dtype, device=args.device)
    began = time.perf_counter()
    accuracy = evaluate_heldout(
        model,
        load_eval_tokenizer(args.model),
        heldout,
        max_tokens=args.eval_max_tokens,
        batch_size=args.eval_batch,
    )
    return {**accuracy, "problems": len(heldout), "eval_s": round(time.perf_counter() - began, 1)}


def combine(folders: list[Path]) -> dict[str, dict]:
    """Each trainer's points from the folders of earlier runs (the last folder that has a trainer wins)."""
    results = {}
    for folder in folders:
        for name in TRAINERS:
            log = folder / f"{name}.points.jsonl"
            if log.exists():
                points = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
                results[name] = {"points": points, "peak_gib": None}
    if not results:
        raise SystemExit(f"--combine: no <trainer>.points.jsonl in {', '.join(map(str, folders))}")
    return results


def table_lines(results: dict[str, dict]) -> list[str]:
    """Markdown: one row per evaluated step, wall-clock s and strict / lenient accuracy per trainer."""
    names = list(results)
    by_step = {name: {p["step"]: p for p in results[name]["points"]} for name in names}
    steps = sorted({step for points in by_step.values() for step in points})
    header = "| step | " + " | ".join(f"{n} wall s | {n} strict | {n} lenient" for n in names) + " |"
    lines = [header, "|" + " --- |" * (1 + 3 * len(names))]
    for step in steps:
        cells = []
        for name in names:
            point = by_step[name].get(step)
            cells += (
                [f"{point['wall_s']:.1f}", f"{point['strict']:.3f}", f"{point['lenient']:.3f}"]
                if point
                else ["", "", ""]
            )
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def time_to_reach(points: list[dict], target: float) -> float | None:
    """Wall-clock s of the first point whose strict accuracy is at least `target`, else None."""
    return next((p["wall_s"] for p in points if p["strict"] >= target), None)


def plot(results: dict[str, dict], path: Path, title: str) -> Path:
    """Strict (solid) and lenient (dashed) held-out accuracy per trainer, against steps and against wall-clock."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(figure)
    panels = figure.subplots(1, 2, sharey=True)
    for color, (name, result) in zip(("tab:blue", "tab:orange", "tab:green"), results.items(), strict=False):
        points = result["points"]
        for axis, x_key in zip(panels, ("step", "wall_s"), strict=True):
            xs = [p[x_key] for p in points]
            axis.plot(xs, [p["strict"] for p in points], "-o", color=color, label=f"{name} strict")
            axis.plot(xs, [p["lenient"] for p in points], "--", color=color, label=f"{name} lenient")
    panels[0].set_xlabel("training step")
    panels[1].set_xlabel("wall-clock s (evaluation excluded)")
    panels[0].set_ylabel("held-out accuracy (greedy)")
    for axis in panels:
        axis.grid(alpha=0.3)
        axis.set_ylim(-0.02, 1.02)
    panels[0].legend(fontsize=8)
    panels[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(title.replace("; ", "\n"), fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="float32", help="compute (and, alone, weights) on both sides")
    parser.add_argument(
        "--master-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="trained weights on both sides (default: --dtype); float32 under --dtype bfloat16 is mixed precision: "
        "TRL's bf16=True on a float32 model, agentrl's actor.fsdp_config.model_dtype=float32",
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=32, help="problems per step (the batch)")
    parser.add_argument("--n", type=int, default=8, help="answers per problem (the GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest training answer")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--temperature", type=float, default=0.7, help="training samples (the recipe's)")
    parser.add_argument("--kl", type=float, default=0.001, help="KL weight (0: no reference model)")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    parser.add_argument("--eval-problems", type=int, default=200, help="held-out problems evaluated (<= 200)")
    parser.add_argument("--eval-max-tokens", type=int, default=256, help="longest held-out answer")
    parser.add_argument("--eval-batch", type=int, default=200, help="held-out problems per generate call")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=64,
        help="rows per forward/backward, at most a step's (both trainers: TRL accumulates its gradient over them)",
    )
    parser.add_argument(
        "--gradient-checkpointing", choices=["on", "off"], default="off", help="both trainers"
    )
    parser.add_argument("--seed", type=int, default=1, help="data order and sampling, both trainers")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument(
        "--out", default="outputs/learning_vs_trl", help="folder for results.json and the PNG"
    )
    parser.add_argument("--extra", nargs="*", default=[], help="more agentrl overrides (key=value)")
    parser.add_argument("--eval-only", action="store_true", help="the starting model's accuracy, no training")
    parser.add_argument("--only", choices=TRAINERS, help="internal: run one trainer, print JSON")
    parser.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="no training: the table and PNG of earlier runs' --out folders (e.g. one trainer per GPU call), "
        "from each trainer's <name>.points.jsonl, written as it went; the other flags must be the runs'",
    )
    args = parser.parse_args(argv)
    args.master_dtype = args.master_dtype or args.dtype
    rows = args.prompts * args.n
    args.micro_batch = min(args.micro_batch, rows)
    if rows % args.micro_batch:
        parser.error(
            f"--micro-batch {args.micro_batch} must divide the step's {rows} answers (--prompts x --n)"
        )
    if not 1 <= args.eval_problems <= 200:
        parser.error(f"--eval-problems must be 1..200 (the held-out set), got {args.eval_problems}")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.eval_only:
        result = run_eval_only(args)
        print(
            f"{args.model} on {args.device}, {result['problems']} held-out problems, greedy, up to "
            f"{args.eval_max_tokens} tokens: strict {result['strict']:.3f}, lenient {result['lenient']:.3f} "
            f"({result['eval_s']} s)"
        )
        return result
    if args.only:
        result = run_agentrl(args) if args.only == "agentrl" else run_trl(args)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    results = combine(args.combine) if args.combine else {}
    for name in [] if args.combine else args.trainers:
        results[name], _ = run_trainer_process(__file__, argv, name, show_log=True)
    settings = (
        f"{args.model} {args.dtype}{'' if args.master_dtype == args.dtype else f' ({args.master_dtype} weights)'} "
        f"on {args.device}: {args.steps} steps of {args.prompts} problems x {args.n} "
        f"answers (<= {args.max_tokens} tokens), lr {args.lr}, T {args.temperature}, KL {args.kl}, seed {args.seed}; "
        f"held-out: {args.eval_problems} problems, greedy, <= {args.eval_max_tokens} tokens"
    )
    print(settings)
    print("\n".join(table_lines(results)))
    if args.device == "cuda":
        print("peak GPU memory GiB: " + ", ".join(f"{n} {r['peak_gib']}" for n, r in results.items()))
    if set(results) == set(TRAINERS):
        # TRL's accuracy at the last step both reached (a run cut short by a time limit ends earlier)
        last = min(results[name]["points"][-1]["step"] for name in TRAINERS)
        target = [p["strict"] for p in results["trl"]["points"] if p["step"] <= last][-1]
        reached = {name: time_to_reach(results[name]["points"], target) for name in TRAINERS}
        print(f"wall-clock s to reach TRL's strict accuracy at step {last}, {target:.3f}: {reached}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"settings": vars(args), "results": results}, indent=1, default=str)
    )
    png = plot(results, out / "learning_vs_trl.png", settings)
    print(f"wrote {out / 'results.json'} and {png}")
    return results


if __name__ == "__main__":
    main()
