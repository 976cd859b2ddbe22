"""A seeded multi-turn agent workload through the real trainer, one table row of per-step figures per config.

Each step runs `--tasks` tasks x `--episodes` episodes of a flow that talks to the policy through the real
`openai` client, the gateway and the embedded engine, exactly as a user's AgentFlow does under `AgentTrainer`:

- the task: a system prompt of ~`--system-tokens` tokens (the same for every task, synthetic words) and a
  short user message naming the task;
- `--turns` model calls; call t asks for k tokens, k drawn in [`--min-answer`, `--max-answer`], with
  `max_tokens=k` and `extra_body={"min_tokens": k, "ignore_eos": True}`, so answers have the drawn length
  even from random weights; with `--stream` each call streams (`stream=True`, `logprobs=True`, usage in the
  last chunk) and the flow joins the chunks' text;
- after every call but the last, a tool runs: `--tool-cpu-ms` of Python first (0 by default: an environment
  step that holds the flow's event loop), then it sleeps (`--tool-latency zero`: not at all; `longtail`:
  lognormal with median 0.2 s and sigma 0.5, and 2% of calls 4 s) and its ~`--obs-tokens`-token output is
  appended as a user message; the next call re-sends the whole history, with the assistant's reply content
  exactly as returned;
- the reward is a seeded hash of the episode id and its answer, in [0, 1): GRPO groups have signal.

Answer lengths, tool latencies and tool outputs are drawn from `random.Random(f"{seed}:{session}:{turn}")`,
where the session id is the collector's (`train<round>-<task>.<sample>.a<attempt>`): the same in every run.
No validation, no rollout files, console logging only; the run folder is a temporary folder.

Per config it prints one markdown row, from the run's metrics history, as medians over the steps after the
first (the first step includes warm-up and compilation): step time, its mean, episodes/s (`tasks x episodes`
over the mean step: asynchronous steps come in bursts, a step that waits for a new batch between steps whose
batch was ready, so the median alone would overstate the throughput) and its ratio to the first config's,
generation (`timing/gen`: the step's wait for its batch), the batch's own collection (`collect s`:
`async/batch_collect_s` in an asynchronous run, where a batch is collected partly beside earlier steps; else
`timing/gen`), the actor update (`timing/update_actor`), training rows and merged steps
(`batch/rows`, `batch/merged_steps`); when the run reports them ("n/a" when it does not): the prompt tokens the
engine received and the tokens its prefill computed (`perf/prompt_tokens`, `perf/prefill_tokens`, else
`perf/engine_prompt_tokens`, `perf/engine_prefill_tokens`), `perf/prefix_cache_hit_rate`,
`perf/prefill_tokens_per_s`, `perf/decode_tokens_per_s`, `gateway/continued_turns` and
`gateway/continuation_fallbacks`; then the share of an episode's wall time spent waiting on tools (measured by
the flow, `batch/tool_wait_share`), the mean prompt length of the last call (`last prompt`, what the history
grew to), the share of failed episodes (error, timeout, prompt too long) and, with `--stream`, the tokens a
streamed chunk carried (`tok/chunk`: completion tokens over the chunks with tokens, `batch/tokens_per_chunk`;
1 when the server streams a token at a time, more when it decodes several steps per engine step) and the
share of a streamed call's time until its first tokens arrived (`first tok share`, `batch/first_token_share`:
near 1 when the answer arrives in one piece at its end). A JSON line per row follows the table; `--out FILE`
writes the workload and the rows as JSON.

    # CPU, small (15-20 s on 2 cores):
    python benchmarks/agent_step.py --tasks 2 --episodes 2 --turns 3 --steps 2 \\
        --system-tokens 60 --min-answer 4 --max-answer 16
    # GPU, the default workload (16 x 8 episodes, 8 turns) on the Qwen2.5-0.5B shape:
    python benchmarks/agent_step.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --out /tmp/agent.json
    # Compare settings: each --config NAME:override,override,... runs in its own subprocess, in order; every
    # --set applies to all of them (before the config's own overrides):
    python benchmarks/agent_step.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 \\
        --config baseline: \\
        --config no-prefix-cache:actor_rollout_ref.rollout.enable_prefix_caching=false \\
        --config text-mode:agent.cumulative_token_mode=false
    # One config per invocation works too: --set key=value (repeatable) is a Hydra override of the run.

A config's overrides are split at commas followed by `key=` (so `trainer.logger=[console,mlflow]` stays one).
With random weights and a 151,936-row embedding (the `-shape` presets), most sampled ids lie past the offline
tokenizer's 2,048 and decode to nothing, so the text the flow re-sends is shorter than what was generated: the
`last prompt` column shows how long the history really grew.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from agentrl import AgentFlow, AgentTrainer, Episode, EvalOutput, Evaluator, Trajectory

WORDS = """
the a and of to in on for with from by at about after before then when while because so but or if
result results file files folder search query page pages table row rows column value values number
total sum count list item items name names date time price cost order orders user users record found
returned shows contains missing error status done open closed new old first second last next other
one two three four five six seven eight nine ten hundred thousand step steps answer question check
data report summary line lines text word words city cities weather today warm cold sunny rain wind
book books store sold bought paid left more less many few each every some all none only also
""".split()
OPTIONAL_METRICS = {
    "collect_s": ("async/batch_collect_s", "timing/gen"),
    "prompt_tokens": ("perf/prompt_tokens", "perf/engine_prompt_tokens"),
    "prefill_tokens": ("perf/prefill_tokens", "perf/engine_prefill_tokens"),
    "prefix_cache_hit_rate": ("perf/prefix_cache_hit_rate",),
    "prefill_tokens_per_s": ("perf/prefill_tokens_per_s",),
    "decode_tokens_per_s": ("perf/decode_tokens_per_s",),
    "continued_turns": ("gateway/continued_turns",),
    "continuation_fallbacks": ("gateway/continuation_fallbacks",),
    "staleness_mean": ("async/staleness_mean",),
    "staleness_max": ("async/staleness_max",),
    "streamed_share": ("async/streamed_share",),
    "tokens_per_chunk": ("batch/tokens_per_chunk",),
    "first_token_share": ("batch/first_token_share",),
}
"""Row field -> the metric names it is read from, the first present winning (None when none is)."""
FAILED_REASONS = ("error", "timeout", "max_prompt_length_exceeded")
LONG_TOOL_S, LONG_TOOL_SHARE = 4.0, 0.02


@dataclass(frozen=True)
class Workload:
    """What one episode does (the flow reads it)."""

    turns: int
    min_answer: int
    max_answer: int
    obs_tokens: int
    tool_latency: str
    seed: int
    tool_cpu_ms: float = 0.0
    stream: bool = False


class WordText:
    """Synthetic text of about a given number of tokens, from words whose token counts were measured."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cost = {w: len(tokenizer.encode(" " + w, add_special_tokens=False)) for w in WORDS}

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, rng: random.Random, tokens: int, prefix: str = "") -> str:
        words, used = [], self.count(prefix) if prefix else 0
        while used < tokens:
            word = rng.choice(WORDS)
            words.append(word)
            used += self.cost[word]
        return (prefix + " ".join(words)).strip()


def tool_delay(kind: str, rng: random.Random) -> float:
    """Seconds one tool call takes: 0, or lognormal(median 0.2 s, sigma 0.5) with 2% of calls at 4 s."""
    if kind == "zero":
        return 0.0
    if rng.random() < LONG_TOOL_SHARE:
        return LONG_TOOL_S
    return rng.lognormvariate(math.log(0.2), 0.5)


class ToolLoopFlow(AgentFlow):
    """Model call, tool (sleep + observation), model call, ... `turns` calls; returns the last answer.

    Episode metrics: `tool_wait_s` (measured time in the tools: their Python and their sleeps), `flow_wall_s`
    (the flow's wall time), `last_prompt_tokens` and `prompt_tokens_sent` (from the replies' usage).
    """

    name = "agent_step"

    def __init__(self, workload: Workload, words: WordText) -> None:
        self.workload = workload
        self.words = words

    async def run(self, task, ctx) -> Episode:
        w = self.workload
        started = time.perf_counter()
        messages = [dict(m) for m in task["prompt"]]
        waited, sent, last_prompt, answer = 0.0, 0, 0, ""
        generated = chunks = 0
        first_s = call_s = 0.0
        for turn in range(w.turns):
            rng = random.Random(f"{w.seed}:{ctx.session_id}:{turn}")
            k = rng.randint(w.min_answer, w.max_answer)
            request = {
                "model": ctx.model,
                "messages": messages,
                "max_tokens": k,
                "extra_body": {"min_tokens": k, "ignore_eos": True},
            }
            if w.stream:
                called = time.perf_counter()
                answer, usage, with_tokens, first = await streamed_reply(ctx.client, request)
                chunks += with_tokens
                first_s, call_s = first_s + first, call_s + time.perf_counter() - called
            else:
                reply = await ctx.client.chat.completions.create(**request)
                answer, usage = reply.choices[0].message.content or "", reply.usage
            if usage is not None:
                last_prompt = usage.prompt_tokens
                sent += last_prompt
                generated += usage.completion_tokens
            messages.append({"role": "assistant", "content": answer})
            if turn == w.turns - 1:
                break
            if w.tool_cpu_ms:  # the tool's own Python (an environment step), holding the event loop
                busy = time.perf_counter()
                while time.perf_counter() < busy + w.tool_cpu_ms / 1000:
                    pass
                waited += time.perf_counter() - busy
            delay = tool_delay(w.tool_latency, rng)
            if delay:
                slept = time.perf_counter()
                await asyncio.sleep(delay)
                waited += time.perf_counter() - slept
            observation = self.words.text(rng, w.obs_tokens, prefix=f"Tool output {turn + 1}: ")
            messages.append({"role": "user", "content": observation})
        return Episode(
            trajectories=[Trajectory(name=self.name)],  # no steps: one per traced call, in call order
            answer=answer,
            metrics={
                "tool_wait_s": waited,
                "flow_wall_s": time.perf_counter() - started,
                "last_prompt_tokens": float(last_prompt),
                "prompt_tokens_sent": float(sent),
                **(
                    {"tokens_per_chunk": generated / max(chunks, 1), "first_token_share": first_s / call_s}
                    if w.stream
                    else {}
                ),
            },
        )


async def streamed_reply(client, request: dict) -> tuple[str, object, int, float]:
    """One streamed chat call: its text, its usage (the last chunk's), how many chunks carried tokens (by
    their logprobs: a token of a random-weight preset often decodes to no text) and the seconds until the
    first of them arrived."""
    started = time.perf_counter()
    stream = await client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}, logprobs=True
    )
    parts, usage, chunks, first = [], None, 0, 0.0
    async for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            choice = chunk.choices[0]
            parts.append(choice.delta.content or "")
            if choice.logprobs and choice.logprobs.content:
                chunks += 1
                first = first or time.perf_counter() - started
    return "".join(parts), usage, chunks, first


class SeededReward(Evaluator):
    """A reward in [0, 1) hashed from the seed, the episode id and its answer; reports the tool-wait share."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def evaluate(self, task, episode) -> EvalOutput:
        reward = zlib.crc32(f"{self.seed}:{episode.id}:{episode.answer}".encode()) / 2**32
        m = episode.metrics
        share = m.get("tool_wait_s", 0.0) / max(m.get("flow_wall_s", 0.0), 1e-9)
        return EvalOutput(
            reward=reward,
            metrics={
                "tool_wait_share": share,
                "last_prompt_tokens": m.get("last_prompt_tokens", 0.0),
                "prompt_tokens_sent": m.get("prompt_tokens_sent", 0.0),
                **{k: m[k] for k in ("tokens_per_chunk", "first_token_share") if k in m},
            },
        )


def build_rows(args: argparse.Namespace, words: WordText) -> tuple[list[dict], int]:
    """`tasks x steps` rows in verl's format, sharing one system prompt; returns them and its token count."""
    system = words.text(random.Random(f"{args.seed}:system"), args.system_tokens, prefix="You are an agent. ")
    rows = []
    for index in range(args.tasks * args.steps):
        user = words.text(random.Random(f"{args.seed}:task:{index}"), 24, prefix=f"Task {index}: ")
        rows.append(
            {
                "data_source": "agent_step",
                "prompt": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "reward_model": {"ground_truth": ""},
                "extra_info": {"index": index},
            }
        )
    return rows, words.count(system)


def prompt_budget(args: argparse.Namespace, words: WordText, first_prompt: list[dict]) -> int:
    """A `data.max_prompt_length` the last call's history fits: the first prompt as rendered, then per turn
    twice the longest answer (re-encoding a random model's text can take more tokens than it generated) and
    the observation with its message headers; rounded up to a multiple of 64."""
    rendered = words.tokenizer.apply_chat_template(first_prompt, tokenize=False, add_generation_prompt=True)
    per_turn = 2 * args.max_answer + args.obs_tokens + 32
    need = words.count(rendered) + (args.turns - 1) * per_turn + 16
    return -(-need // 64) * 64


def base_overrides(args: argparse.Namespace, run_dir: str, max_prompt: int) -> list[str]:
    episodes = args.tasks * args.episodes
    # The rows of one optimizer step must split into whole micro-batches: the largest divisor within the flag.
    micro = max(d for d in range(1, min(args.micro_batch, episodes) + 1) if episodes % d == 0)
    return [
        f"actor_rollout_ref.model.path={args.model}",
        f"actor_rollout_ref.model.dtype={args.dtype}",
        f"trainer.device={args.device}",
        f"trainer.seed={args.seed}",
        f"data.seed={args.seed}",
        f"data.train_batch_size={args.tasks}",
        f"actor_rollout_ref.rollout.n={args.episodes}",
        f"data.max_prompt_length={max_prompt}",
        f"data.max_response_length={args.max_answer}",
        f"actor_rollout_ref.rollout.max_model_len={max_prompt + args.max_answer}",
        f"actor_rollout_ref.rollout.max_num_seqs={episodes}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.tasks}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        f"agent.max_steps={args.turns}",
        f"agent.n_parallel_tasks={episodes}",
        f"agent.timeout={args.timeout}",
        "data.shuffle=false",
        "sft.enable=false",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.rollout_data_fraction=0.0",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
    ]


def _median(history: list[dict], key: str) -> float | None:
    values = [r[key] for r in history if r.get(key) is not None]
    return statistics.median(values) if values else None


def _first_median(history: list[dict], keys: tuple[str, ...]) -> float | None:
    return next((m for m in (_median(history, key) for key in keys) if m is not None), None)


def summarise(history: list[dict], args: argparse.Namespace, name: str, overrides: list[str]) -> dict:
    """One row from the run's per-step metrics: medians over the steps after the first (all, if only one)."""
    steps = [r for r in history if "timing/step" in r]
    measured = steps[1:] or steps
    untrained = [r.get("step") for r in measured if "batch/rows" not in r]
    if untrained:
        raise RuntimeError(
            f"{name}: steps {untrained} trained nothing; the 'rollout ... failed' warnings say why"
        )
    mean_step_s = statistics.fmean(r["timing/step"] for r in measured)
    row = {
        "config": name,
        "overrides": overrides,
        "step_s": _median(measured, "timing/step"),
        "mean_step_s": mean_step_s,
        "episodes_per_s": args.tasks * args.episodes / mean_step_s,
        "gen_s": _median(measured, "timing/gen"),
        "update_s": _median(measured, "timing/update_actor"),
        "rows": _median(measured, "batch/rows"),
        "merged_steps": _median(measured, "batch/merged_steps"),
        **{field: _first_median(measured, keys) for field, keys in OPTIONAL_METRICS.items()},
        "tool_wait_share": _median(measured, "batch/tool_wait_share"),
        "last_prompt_tokens": _median(measured, "batch/last_prompt_tokens"),
        "failed_share": statistics.median(
            sum(r.get(f"batch/termination_reason/{reason}", 0.0) for reason in FAILED_REASONS)
            for r in measured
        ),
        "all_step_s": [r["timing/step"] for r in steps],
        "steps_measured": len(measured),
        # Where the step went (JSON only): waiting for the batch, the update, the weight push, the rest.
        "phases": {
            key: _median(measured, key)
            for key in sorted({k for r in measured for k in r})
            if key.startswith("timing/") and not key.startswith("timing/engine_")
        },
        # Where generation went inside the engine (JSON only): prefill/decode/host seconds, prefills, steps.
        "engine": {
            key: _median(measured, key)
            for key in sorted({k for r in measured for k in r})
            if key.startswith(("timing/engine_", "perf/engine_"))
        },
    }
    return row


def run_config(args: argparse.Namespace, name: str = "default", overrides: list[str] | tuple = ()) -> dict:
    """Train `args.steps` steps of the workload under `--set` then `overrides`; return the config's row."""
    from agentrl.models import load_tokenizer
    from agentrl.runs.history import read_metrics_history

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    words = WordText(load_tokenizer(args.model))
    rows, system_tokens = build_rows(args, words)
    max_prompt = prompt_budget(args, words, rows[0]["prompt"])
    workload = Workload(
        args.turns, args.min_answer, args.max_answer, args.obs_tokens, args.tool_latency, args.seed,
        args.tool_cpu_ms, args.stream,
    )  # fmt: skip
    extra = [*args.set, *overrides]
    with tempfile.TemporaryDirectory(prefix="agent_step-") as run_dir:
        result = AgentTrainer(
            flow=ToolLoopFlow(workload, words),
            evaluator=SeededReward(args.seed),
            train_dataset=rows,
            val_dataset=[],
            config=base_overrides(args, run_dir, max_prompt) + extra,
        ).train()
        history = read_metrics_history(result.run_dir)
    row = summarise(history, args, name, extra)
    row.update(system_tokens=system_tokens, max_prompt_length=max_prompt)
    return row


def split_config(spec: str) -> tuple[str, list[str]]:
    """`NAME:key=v,key=v` -> (NAME, overrides); commas split only before `key=` (list values stay whole)."""
    name, _, rest = spec.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"--config {spec!r}: expected NAME:override,override,...")
    return name, [o for o in re.split(r",(?=[\w.+~@/-]+=)", rest) if o]


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.{digits}f}"
    return str(int(value)) if isinstance(value, float) else str(value)


COLUMNS = [
    ("config", "config", 0),
    ("step s", "step_s", 2),
    ("mean step s", "mean_step_s", 2),
    ("episodes/s", "episodes_per_s", 1),
    ("vs first", "episodes_vs_first", 2),
    ("gen s", "gen_s", 2),
    ("collect s", "collect_s", 2),
    ("update s", "update_s", 2),
    ("rows", "rows", 0),
    ("merged steps", "merged_steps", 0),
    ("prompt tok", "prompt_tokens", 0),
    ("prefill tok", "prefill_tokens", 0),
    ("prefix hit", "prefix_cache_hit_rate", 3),
    ("prefill tok/s", "prefill_tokens_per_s", 0),
    ("decode tok/s", "decode_tokens_per_s", 0),
    ("continued", "continued_turns", 0),
    ("fallbacks", "continuation_fallbacks", 0),
    ("tool wait", "tool_wait_share", 3),
    ("last prompt", "last_prompt_tokens", 0),
    ("failed", "failed_share", 3),
    ("staleness mean", "staleness_mean", 2),
    ("staleness max", "staleness_max", 0),
    ("streamed", "streamed_share", 2),
    ("tok/chunk", "tokens_per_chunk", 2),
    ("first tok share", "first_token_share", 2),
]


def measured_steps_text(steps: int) -> str:
    if steps == 1:
        return "one step (warm-up included)"
    return "step 2" if steps == 2 else f"medians of steps 2-{steps}"


def table_lines(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(title for title, _, _ in COLUMNS) + " |"]
    lines.append("| --- | " + " | ".join("---:" for _ in COLUMNS[1:]) + " |")
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(key), d) for _, key, d in COLUMNS) + " |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny:qwen2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto", help="trainer.device: auto, cpu or cuda")
    p.add_argument("--tasks", type=int, default=16, help="tasks per step (data.train_batch_size)")
    p.add_argument("--episodes", type=int, default=8, help="episodes per task (actor_rollout_ref.rollout.n)")
    p.add_argument(
        "--steps", type=int, default=3, help="training steps; the first is left out of the medians"
    )
    p.add_argument("--turns", type=int, default=8, help="model calls per episode")
    p.add_argument("--system-tokens", type=int, default=250)
    p.add_argument("--min-answer", type=int, default=16, help="fewest tokens of one answer")
    p.add_argument("--max-answer", type=int, default=96, help="most tokens of one answer")
    p.add_argument("--obs-tokens", type=int, default=40, help="tokens of one tool observation")
    p.add_argument("--tool-latency", choices=["zero", "longtail"], default="longtail")
    p.add_argument(
        "--tool-cpu-ms",
        type=float,
        default=0.0,
        help="milliseconds of Python each tool call runs before its latency (blocking the flow's event loop)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=16,
        help="most rows per actor forward/backward (the largest divisor of tasks x episodes within it)",
    )
    p.add_argument(
        "--stream", action="store_true", help="the flows stream every call (stream=True), joining the chunks"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="agent.timeout in seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a Hydra override for every config"
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        type=split_config,
        metavar="NAME:OVERRIDES",
        help="a named config, `NAME:key=v,key=v` (each runs in its own subprocess)",
    )
    p.add_argument("--out", type=Path, help="write the workload and the rows as JSON here")
    p.add_argument("--only-config", type=int, help=argparse.SUPPRESS)  # internal: run config i, print RESULT
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 1 <= args.min_answer <= args.max_answer:
        p.error(f"need 1 <= --min-answer <= --max-answer, got {args.min_answer} and {args.max_answer}")
    for flag in ("tasks", "episodes", "steps", "turns", "micro_batch"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")


def run_in_subprocess(argv: list[str], index: int, name: str) -> dict:
    """Run config `index` in a fresh interpreter (its own engine, compile and memory); its log goes to stderr."""
    command = [sys.executable, __file__, *argv, "--only-config", str(index)]
    done = subprocess.run(command, text=True, stdout=subprocess.PIPE)
    sys.stdout.write(
        "".join(f"{line}\n" for line in done.stdout.splitlines() if not line.startswith("RESULT "))
    )
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        sys.exit(f"config {name} failed (exit {done.returncode}); its log is above")
    return json.loads(results[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.only_config is not None:
        name, overrides = args.config[args.only_config]
        print("RESULT " + json.dumps(run_config(args, name, overrides)), flush=True)
        return []
    if args.config:
        rows = []
        for i, (name, _) in enumerate(args.config):
            rows.append(with_ratio(run_in_subprocess(argv, i, name), rows[0] if rows else None))
            # Each row as soon as its config ends: a later config that fails or runs out of time keeps it.
            print(f"{name} done: {table_lines(rows[-1:])[-1]}", flush=True)
            write_out(args, rows)
    else:
        rows = [with_ratio(run_config(args), None)]
    print(
        f"\n{args.model} {args.dtype}: {args.tasks} tasks x {args.episodes} episodes x {args.turns} turns, "
        f"answers {args.min_answer}-{args.max_answer} tokens, system ~{rows[0]['system_tokens']} tokens, "
        f"observations ~{args.obs_tokens} tokens, tools {args.tool_latency}"
        + (f" + {args.tool_cpu_ms:g} ms of Python" if args.tool_cpu_ms else "")
        + (", every call streamed" if args.stream else "")
        + "; "
        + measured_steps_text(args.steps)
    )
    for line in table_lines(rows):
        print(line)
    for row in rows:
        print(json.dumps(row))
    write_out(args, rows)
    return rows


def with_ratio(row: dict, first: dict | None) -> dict:
    """`row` with its episodes/s over the first config's (1 for the first): the speedup a comparison asks for."""
    return {**row, "episodes_vs_first": row["episodes_per_s"] / (first or row)["episodes_per_s"]}


def write_out(args: argparse.Namespace, rows: list[dict]) -> None:
    """The workload and the rows so far as JSON at `--out`, if given."""
    if args.out:
        workload = {k: v for k, v in vars(args).items() if k not in ("config", "out", "only_config")}
        args.out.write_text(json.dumps({"workload": workload, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
