"""The controller: builds workers and the rollout stack, then runs the training loop, top to bottom.

    tasks    = next batch                      episodes = collect + evaluate (rollout/, evaluator.py)
    episodes = compact filter, reject          batch    = assemble (exact rollout tokens)
    batch   += old / ref log-probs, values     batch   += advantages
    critic.update, actor.update, sync weights  log, maybe validate, maybe checkpoint

Setup (workers, servers, tracker, resume) happens before step one; `close` stops everything it started.
The loop never names a device or a rank: workers live behind `WorkerGroup`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from agentrl.algorithms.filters import build_masked_reasons, compact_filter_keep, rejection_sample_keep
from agentrl.algorithms.kl import apply_kl_penalty_to_rewards
from agentrl.checkpoint import (
    find_latest_checkpoint,
    load_trainer_state,
    resolve_resume_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from agentrl.data import RLDataLoader
from agentrl.data.images import load_image_processor
from agentrl.evaluator import Evaluator, score_episode
from agentrl.flow import AgentFlow
from agentrl.models.compile_cache import uncached_bytecode_warning
from agentrl.rollout.collector import CollectorLimits, RolloutCollector
from agentrl.rollout.stack import build_rollout_stack
from agentrl.runs.rollout_writer import ROLLOUTS_DIR, RolloutLog, config_hash
from agentrl.runs.truncate import truncate_run_history
from agentrl.tracking import build_tracker, progress_bar, set_progress_postfix
from agentrl.training.heap import setup_objects_frozen
from agentrl.training.metrics import (
    collapse_warning,
    compute_batch_metrics,
    compute_episode_metrics,
    compute_routing_metrics,
    compute_validation_metrics,
    group_ids_of,
)
from agentrl.training.rollout_pipeline import RolloutPipeline, steps_to_request
from agentrl.training.update.assembly import (
    TrainBatch,
    episodes_to_rows,
    rows_to_batch,
    write_step_advantages,
)
from agentrl.training.update.batch_advantages import compute_batch_advantages
from agentrl.training.update.ppo_update import attach_behaviour_weights
from agentrl.training.workers.critic_worker import CriticWorker
from agentrl.training.workers.policy_worker import PolicyWorker
from agentrl.training.workers.worker_group import LocalWorkerGroup, WorkerGroup
from agentrl.types import Episode, Task, TerminationReason

log = logging.getLogger(__name__)


def _engine_timing(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, float]:
    """Where the generation phase went inside the embedded engines (the slowest worker's):
    `timing/engine_prefill`, `timing/engine_decode` (forwards and sampling) and `timing/engine_host` (the
    scheduler's per-row Python work) in seconds, and inside those `timing/engine_cache_alloc` and
    `timing/engine_graph_capture` (the KV cache and CUDA graphs rebuilt after each sleep); `perf/engine_prefills`,
    `perf/engine_prefill_parts` (chunked prefill), `perf/engine_decode_steps_device`
    and `perf/engine_decode_steps_host` as counts, with the token counts (`perf/engine_prompt_tokens`,
    `perf/engine_prefix_cache_hits`, `perf/engine_prefill_tokens`, `perf/engine_tokens_generated`). Over all
    engines: `perf/prefix_cache_hit_rate` (prompt tokens found in the cache), `perf/prefill_tokens_per_s`
    (tokens computed by prefill forwards / their seconds) and `perf/decode_tokens_per_s` (tokens generated /
    decode seconds). Per prefill path (`extend`: short runs replayed from CUDA graphs; `packed`): the device
    seconds `timing/engine_prefill_<path>`, the host's seconds issuing them `timing/engine_prefill_<path>_host`,
    and `perf/engine_prefill_<path>_forwards` and `_tokens`. The rest of `timing/gen` is the agents, the gateway
    and waiting."""
    timing: dict[str, float] = {}
    totals: dict[str, float] = {}
    for start, end in zip(before, after, strict=True):
        for key, value in end.items():
            name = f"timing/engine_{key.removesuffix('_s')}" if key.endswith("_s") else f"perf/engine_{key}"
            timing[name] = max(timing.get(name, 0.0), value - start.get(key, 0.0))
            totals[key] = totals.get(key, 0.0) + value - start.get(key, 0.0)
    if totals.get("prompt_tokens"):
        timing["perf/prefix_cache_hit_rate"] = totals.get("prefix_cache_hits", 0.0) / totals["prompt_tokens"]
    if totals.get("prefill_forward_s"):
        timing["perf/prefill_tokens_per_s"] = totals.get("prefill_tokens", 0.0) / totals["prefill_forward_s"]
    if totals.get("decode_s"):
        timing["perf/decode_tokens_per_s"] = totals.get("tokens_generated", 0.0) / totals["decode_s"]
    return timing


@contextmanager
def _timer(timing: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    timing[f"timing/{name}"] = time.perf_counter() - start


def staleness_metrics(episodes: Sequence[Episode], served_version: int | None) -> dict[str, float]:
    """How many policy versions the trained calls lag the weights they train: `async/staleness_mean` and
    `async/staleness_max` over the kept episodes' calls (each call's version is its trace's: the weights its
    request started with). Before the first update the newest version seen stands for the served one."""
    versions = [
        int(step.info["policy_version"])
        for episode in episodes
        for trajectory in episode.trajectories
        for step in trajectory.steps
        if "policy_version" in step.info
    ]
    if not versions:
        return {}
    current = max(versions) if served_version is None else served_version
    lags = [max(0, current - v) for v in versions]
    return {"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags))}


def rows_to_tasks(rows: Sequence[dict], prefix: str) -> list[Task]:
    """Tasks with stable ids (`extra_info.index` when present, else the row position), unique in the call.

    Ids key the GRPO groups and the task an episode is scored against, so a repeated index (datasets
    concatenated, each indexed from 0) gets the row position appended rather than merging two prompts.
    """
    tasks: list[Task] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        index = (row.get("extra_info") or {}).get("index", i)
        task_id = f"{prefix}-{index}"
        if task_id in seen:
            task_id = f"{prefix}-{index}-row{i}"
        seen.add(task_id)
        tasks.append(Task(id=task_id, data=row))
    return tasks


def build_worker_groups(
    cfg: Any, total_steps: int, device: str
) -> tuple[WorkerGroup, WorkerGroup | None, Any]:
    """Policy and (for GAE) critic worker groups on `trainer.backend`, and the Ray cluster that holds them."""
    gae = cfg.algorithm.adv_estimator == "gae"
    kwargs = {"config": cfg, "total_steps": total_steps}
    if cfg.trainer.backend == "local":
        critic = LocalWorkerGroup(CriticWorker(**kwargs, device=device)) if gae else None
        return LocalWorkerGroup(PolicyWorker(**kwargs, device=device)), critic, None
    from agentrl.training.workers.ray_cluster import RayCluster

    cluster = RayCluster(cfg, device)
    policy = critic = None
    try:
        pools = cfg.resource_pool_config
        policy_devices = pools.actor_rollout_gpus or cluster.world
        critic_devices = pools.critic_gpus or policy_devices
        share = 0.5 if gae else 1.0
        policy = cluster.worker_group(
            PolicyWorker, devices=policy_devices, share=share, name="policy", **kwargs
        )
        if gae:
            critic = cluster.worker_group(
                CriticWorker, devices=critic_devices, share=share, name="critic", **kwargs
            )
    except BaseException:
        if policy is not None:  # a joined cluster outlives the run: leave no worker behind
            policy.shutdown()
        cluster.shutdown()
        raise
    return policy, critic, cluster


def _drop(episodes: list[Episode], keep: Sequence[bool], reason: str) -> list[Episode]:
    """The episodes whose `keep` flag is set; the others get `filter_reason = reason`."""
    for episode, k in zip(episodes, keep, strict=True):
        if not k:
            episode.filter_reason = reason
    return [e for e, k in zip(episodes, keep, strict=True) if k]


class Controller:
    """Runs RL training of `flow` scored by `evaluator` on the configured workers and engines."""

    def __init__(
        self,
        config: Any,
        flow: AgentFlow,
        evaluator: Evaluator,
        train_rows: Sequence[dict],
        val_rows: Sequence[dict] | None,
    ) -> None:
        self.config = config
        self.flow = flow
        self.evaluator = evaluator
        self.run_dir = Path(config.trainer.default_local_dir)
        self.loader = RLDataLoader(
            list(train_rows),
            batch_size=config.data.train_batch_size,
            shuffle=config.data.shuffle,
            seed=config.data.seed,
        )
        self.val_tasks = rows_to_tasks(val_rows or [], "val")
        total = config.trainer.total_training_steps or config.trainer.total_epochs * len(self.loader)
        self.total_steps = int(total)
        self.global_step = 0
        self.initial_val_metrics: dict[str, float] = {}
        self.policy = None
        self.critic = None
        self.cluster = None
        self.stack = None
        self.collector: RolloutCollector | None = None
        self.tracker = None
        self.rollout_log = None
        self.pipeline: RolloutPipeline | None = None
        """Rollouts collected ahead of training (`async_training`); None in the synchronous loop."""
        self.served_version: int | None = None
        self.runner: asyncio.Runner | None = asyncio.Runner()
        """One event loop for every collection of the run, made in `setup` (or at the first collection): a
        Ctrl-C that lands while a step starts its collection then never meets a loop half-built (asyncio.run
        made one per step), and the gateway's HTTP clients live across steps."""

    # ---- setup ------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if (slow_start := uncached_bytecode_warning()) is not None:
            log.warning(slow_start)
        device = (
            cfg.trainer.device
            if cfg.trainer.device != "auto"
            else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        torch.manual_seed(cfg.trainer.seed)
        self.runner.get_loop()
        self.policy, self.critic, self.cluster = build_worker_groups(cfg, self.total_steps, device)
        resume_from = resolve_resume_checkpoint(
            cfg.trainer.resume_mode, self.run_dir / "checkpoints", cfg.trainer.resume_from_path
        )
        if resume_from is not None:
            self._load_checkpoint(resume_from)
        elif cfg.sft.enable:
            sft_metrics = self.policy.call_first("warm_start", cfg.sft, list(self.loader.rows))
            log.info("warm start: %s", sft_metrics)
        urls = [url for worker_urls in self.policy.call("start_rollout") for url in worker_urls]
        self.stack = build_rollout_stack(urls, cfg, self.policy.call_first("tokenizer_pad_id"))
        self.vocab_size = self.policy.call_first("vocab_size")
        arr = cfg.actor_rollout_ref
        self.collector = RolloutCollector(
            self.stack.backend,
            self.stack.model_name,
            CollectorLimits(
                max_steps=cfg.agent.max_steps,
                n_parallel_tasks=cfg.agent.n_parallel_tasks or arr.rollout.max_num_seqs * len(urls),
                retry_limit=cfg.agent.retry_limit,
                timeout=cfg.agent.timeout,
                max_prompt_length=cfg.data.max_prompt_length,
                group_calls=cfg.agent.group_calls,
                max_n=arr.rollout.max_n_per_request,
            ),
            num_workers=cfg.agent.num_workers,
        )
        self.n = arr.rollout.n
        if resume_from is not None:  # steps after the checkpoint are redone: their old history goes
            truncate_run_history(self.run_dir, self.global_step, cfg.trainer.rollout_data_dir)
        # A fresh start (no checkpoint, or resume disabled) must not append to an earlier run's history.
        self.tracker = build_tracker(
            cfg.trainer.logger,
            run_dir=self.run_dir,
            project_name=cfg.trainer.project_name,
            experiment_name=cfg.trainer.experiment_name,
            config=cfg.model_dump(),
            resume=resume_from is not None,
        )
        self.rollout_log = RolloutLog(
            Path(cfg.trainer.rollout_data_dir or self.run_dir / ROLLOUTS_DIR),
            fraction=cfg.trainer.rollout_data_fraction,
            config_digest=config_hash(cfg),
            on_records=self.tracker.log_rollouts,
            trace_freq=cfg.trainer.rollout_trace_freq,
            trace_max_episodes=cfg.trainer.rollout_trace_max_episodes,
            last_step=self.total_steps,
        )
        if resume_from is not None:
            # Last, so nothing built above draws from the restored generators before step one.
            self.collector.load_state_dict(load_trainer_state(resume_from).get("collector", {"rounds": 0}))
            restore_rng_state(resume_from)

    # ---- the loop ---------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Train until `total_steps`; returns the last step's metrics (with the final validation). What setup
        built stays out of the garbage collector's full collections meanwhile (`heap.py`)."""
        with setup_objects_frozen():
            return self._train_steps()

    def _train_steps(self) -> dict[str, float]:
        cfg = self.config.trainer
        metrics: dict[str, float] = {}
        if cfg.val_before_train and self.global_step == 0 and self.val_tasks:
            self.initial_val_metrics = self.validate()
            self.tracker.log(self.initial_val_metrics, step=0)
        bar = progress_bar("train", self.total_steps)
        bar.update(self.global_step)
        self.pipeline = self.start_pipeline()
        busy_before = self.policy.call("engine_counters")
        servers = self.stack.pool.servers
        calls_before = [server.requests for server in servers]
        turns = self.stack.backend.session_turns
        continued, fallbacks = turns.counts("train")
        for step in range(self.global_step + 1, self.total_steps + 1):
            timing: dict[str, float] = {}
            with _timer(timing, "step"):
                with _timer(timing, "gen"):
                    if self.streams_update:
                        episodes, kept, streamed_share = self.stream_training_episodes(step, timing)
                        timing["async/streamed_share"] = streamed_share
                    else:
                        episodes, kept = self.next_training_episodes(step)
                if self.pipeline is not None:
                    timing.update(self.pipeline.last_batch_timing)
                # Asynchronous: the engine and the gateway worked on this batch while earlier steps trained, so
                # their counters are read from one batch's end to the next.
                busy_after = self.policy.call("engine_counters")
                timing.update(_engine_timing(busy_before, busy_after))
                busy_before = busy_after
                calls_after = [server.requests for server in servers]
                healthy = sum(server.healthy for server in servers)
                timing.update(compute_routing_metrics(calls_before, calls_after, healthy))
                calls_before = calls_after
                continued_now, fallbacks_now = turns.counts("train")  # validation's turns are not the step's
                timing["gateway/continued_turns"] = continued_now - continued
                timing["gateway/continuation_fallbacks"] = fallbacks_now - fallbacks
                continued, fallbacks = continued_now, fallbacks_now
                metrics = {
                    "training/global_step": step,
                    "training/epoch": self.loader.epoch,
                    **compute_episode_metrics(episodes),
                    **staleness_metrics(kept, self.served_version),
                }
                batch = self.assemble(kept, metrics)
                if batch is not None:
                    metrics.update(self.update(batch, timing, streamed=self.streams_update))
                    write_step_advantages(kept, batch)
                    if warning := collapse_warning(metrics, self.vocab_size, step):
                        log.warning(warning)
                with _timer(timing, "save_rollouts"):
                    self.rollout_log.write(step, episodes)
            self.global_step = step
            tokens = metrics.get("response_length/mean", 0.0) * metrics.get("batch/rows", 0.0)
            metrics.update(timing, **{"perf/throughput": tokens / max(timing["timing/step"], 1e-9)})
            if (
                cfg.test_freq > 0
                and (step % cfg.test_freq == 0 or step == self.total_steps)
                and self.val_tasks
            ):
                metrics.update(self.validate())
            self.tracker.log(metrics, step=step)
            bar.update(1)
            set_progress_postfix(
                bar,
                step=step,
                reward=metrics.get("critic/full-score/mean"),
                throughput=metrics.get("perf/throughput"),
            )
            if (cfg.save_freq > 0 and step % cfg.save_freq == 0) or step == self.total_steps:
                self.save_checkpoint()
        bar.close()
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        return metrics

    # ---- asynchronous training -------------------------------------------------------------------------
    def start_pipeline(self) -> RolloutPipeline | None:
        """The background collector when `async_training` runs ahead (staleness > 0); None otherwise: staleness
        0 is the synchronous loop, exactly."""
        run_ahead = self.config.async_training
        if not (run_ahead.enable and run_ahead.staleness_threshold > 0):
            return None
        correction = self.config.algorithm.rollout_correction
        if not correction.bypass_mode and correction.tis_mode is None:
            log.warning(
                "async_training.staleness_threshold=%d trains tokens sampled by older weights with nothing to "
                "bound the lag: set algorithm.rollout_correction.bypass_mode=true (PPO clipped against the "
                "engine's log-probs; the tool-agent cookbook collapsed without it and kept learning with it, "
                "docs/async.md)",
                run_ahead.staleness_threshold,
            )
        limit, episodes = self.collector.limits.n_parallel_tasks, self.config.data.train_batch_size * self.n
        if run_ahead.partial_rollout and limit < 2 * episodes:
            log.warning(
                "agent.n_parallel_tasks=%d (by default the engines' max_num_seqs) holds less than two batches of "
                "%d episodes: the next batch's rollouts start only as the last batch's leave, while it waits on "
                "its slowest agents. Room for two (actor_rollout_ref.rollout.max_num_seqs and "
                "agent.n_parallel_tasks=%d) took staleness 1 from 9.6 to 8.2 s a step on an H200 "
                "(docs/async.md)",
                limit,
                episodes,
                2 * episodes,
            )
        self._requested_through = self.global_step

        def collect(on_group: Callable[[list[Episode]], None]):
            return self.collect_training_episodes_async(on_group if run_ahead.streaming_update else None)

        return RolloutPipeline(
            collect,
            self.runner.get_loop(),
            partial_rollout=run_ahead.partial_rollout,
        )

    def _run(self, coroutine):
        """Run `coroutine` on the run's event loop: through the pipeline while its thread drives the loop."""
        if self.pipeline is not None:
            return self.pipeline.run(coroutine)
        return self.runner.run(coroutine)

    def is_boundary(self, step: int) -> bool:
        """A step after which the loop checkpoints or validates: no rollout may be in flight past it."""
        cfg = self.config.trainer
        saves = (cfg.save_freq > 0 and step % cfg.save_freq == 0) or step == self.total_steps
        validates = cfg.test_freq > 0 and step % cfg.test_freq == 0 and bool(self.val_tasks)
        return saves or validates

    def next_training_episodes(self, step: int) -> tuple[list[Episode], list[Episode]]:
        """This step's episodes: collected now, or taken from the pipeline. Before taking, the pipeline is asked
        for the batches of the next steps (up to `staleness_threshold` ahead, not past a checkpoint or
        validation step): the weights this step trains are served already, so they may start at once, while
        this step's last episodes finish and while it trains."""
        if self.pipeline is None:
            return self.collect_training_episodes()
        self._request_through(step)
        return self.pipeline.take()

    def _request_through(self, step: int) -> None:
        """Ask the pipeline for this step's batch and those it may collect ahead (`next_training_episodes`)."""
        if self._requested_through < step:
            self.pipeline.request()
            self._requested_through = step
        staleness = self.config.async_training.staleness_threshold
        for ahead in steps_to_request(step, self.total_steps, staleness, self.is_boundary):
            if ahead > self._requested_through:
                self.pipeline.request()
                self._requested_through = ahead

    @property
    def streams_update(self) -> bool:
        """`async_training.streaming_update` in an asynchronous run (the config checks say when it is allowed)."""
        return self.pipeline is not None and self.config.async_training.streaming_update

    def stream_training_episodes(
        self, step: int, timing: dict[str, float]
    ) -> tuple[list[Episode], list[Episode], float]:
        """This step's episodes as `next_training_episodes` gives them, its actor gradients accumulated meanwhile:
        the kept episodes of each group that finishes go into the update (`accumulate_actor`) a micro-batch of
        rows per rank at a time, while the batch's slowest episodes still run; the last ones once it is complete.
        Also returns the share of the rows accumulated before the batch's last group finished."""
        self._request_through(step)
        size = self.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu * self.policy.size
        chunk: list[Episode] = []
        started: list[tuple[float, int]] = []  # each chunk's start and rows
        last_group = 0.0
        timing["timing/stream_actor"] = 0.0
        for arrived, group in self.pipeline.parts():
            last_group = arrived
            chunk += group
            if len(chunk) >= size:
                started.append((time.perf_counter(), self._accumulate(chunk, timing)))
                chunk = []
        episodes, kept = self.pipeline.take()
        started.append((time.perf_counter(), self._accumulate(chunk, timing)))
        early = sum(rows for start, rows in started if start < last_group)
        return episodes, kept, early / max(sum(rows for _, rows in started), 1)

    def _accumulate(self, episodes: list[Episode], timing: dict[str, float]) -> int:
        """Reference log-probs (KL loss) and advantages of `episodes`' rows, whole groups, then their gradients
        (their seconds added to `timing/stream_actor`); returns the rows."""
        start = time.perf_counter()
        try:
            return self._accumulate_rows(episodes)
        finally:
            timing["timing/stream_actor"] += time.perf_counter() - start

    def _accumulate_rows(self, episodes: list[Episode]) -> int:
        batch, _ = self._to_batch(episodes)
        if batch is None:
            return 0
        balance = self.config.actor_rollout_ref.actor.use_dynamic_bsz
        if self.config.actor_rollout_ref.actor.use_kl_loss:
            batch["ref_log_probs"] = self.policy.dispatch(
                "compute_ref_log_prob", batch, balance_tokens=balance
            )
        batch["advantages"], batch["returns"] = self._advantages(batch)
        self.policy.dispatch("accumulate_actor", batch, balance_tokens=balance)
        return len(batch)

    def update(self, batch: TrainBatch, timing: dict[str, float], streamed: bool = False) -> dict[str, float]:
        """Log-probs, values, advantages, critic and actor updates, weight sync; returns their metrics.
        `streamed`: the actor's gradients were accumulated as the batch came in (`stream_training_episodes`): its
        optimizer step is left, and the advantages are recomputed (group by group, the same) for the metrics."""
        cfg = self.config
        metrics: dict[str, float] = {}
        if self.pipeline is None:  # the engine keeps generating while an asynchronous step trains
            with _timer(timing, "sleep_rollout"):
                self.policy.call("sleep_rollout")
        balance = cfg.actor_rollout_ref.actor.use_dynamic_bsz
        if self.needs_old_log_probs():
            with _timer(timing, "old_log_prob"):
                batch.tensors.update(self.policy.dispatch("compute_log_prob", batch, balance_tokens=balance))
        if "old_log_probs" in batch.tensors:  # rollout_corr/* metrics; behaviour weights when tis_mode is set
            correction = cfg.algorithm.rollout_correction
            metrics.update(attach_behaviour_weights(batch, correction.tis_mode, correction.tis_cap))
        if (cfg.actor_rollout_ref.actor.use_kl_loss and not streamed) or cfg.algorithm.use_kl_in_reward:
            with _timer(timing, "ref"):
                batch["ref_log_probs"] = self.policy.dispatch(
                    "compute_ref_log_prob", batch, balance_tokens=balance
                )
        if cfg.algorithm.use_kl_in_reward:
            shaped = apply_kl_penalty_to_rewards(
                batch.token_rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                batch.response_mask,
                kl_coef=cfg.algorithm.kl_ctrl.kl_coef,
                kl_type=cfg.algorithm.kl_penalty,
            )
            batch.token_rewards = shaped.token_rewards
            metrics["actor/reward_kl_penalty"] = float(shaped.kl_mean)
        if self.critic is not None:
            with _timer(timing, "values"):
                batch["values"] = self.critic.dispatch("compute_values", batch, balance_tokens=balance)
        with _timer(timing, "adv"):
            batch["advantages"], batch["returns"] = self._advantages(batch)
        if self.critic is not None:
            with _timer(timing, "update_critic"):
                metrics.update(self.critic.dispatch("update_critic", batch, balance_tokens=balance))
        with _timer(timing, "update_actor"):
            if streamed:
                metrics.update(self.policy.call_first("finish_actor_update"))
            else:
                metrics.update(self.policy.dispatch("update_actor", batch, balance_tokens=balance))
        if self.pipeline is None:
            with _timer(timing, "wake_rollout"):
                self.policy.call("wake_rollout")
        with _timer(timing, "sync_weights"):
            push = lambda: self.policy.call_first("sync_weights")  # noqa: E731
            synced = self.pipeline.push_weights(push) if self.pipeline is not None else push()
            metrics.update(synced)
            self.served_version = int(synced.get("rollout/policy_version", 0))
        metrics.update(compute_batch_metrics(batch))
        return metrics

    def _advantages(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) of `batch` (`algorithm.*`, `agent.stepwise_advantage`)."""
        cfg = self.config
        stepwise = cfg.agent.stepwise_advantage
        result = compute_batch_advantages(
            batch,
            estimator=cfg.algorithm.adv_estimator,
            gamma=cfg.algorithm.gamma,
            lam=cfg.algorithm.lam,
            norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
            stepwise_mode=stepwise.mode if stepwise.enable else None,
            normalize_by_steps=stepwise.normalize_by_steps,
        )
        return result.advantages, result.returns

    def needs_old_log_probs(self) -> bool:
        """False when the update is on-policy (one epoch, one mini-batch, no KL in the reward): the actor's
        log-probs before its only optimizer step are then the old ones, and the update measures them itself."""
        cfg = self.config
        actor = cfg.actor_rollout_ref.actor
        one_mini = actor.ppo_mini_batch_size >= cfg.data.train_batch_size
        on_policy = actor.ppo_epochs == 1 and one_mini and not cfg.algorithm.use_kl_in_reward
        if (
            cfg.algorithm.rollout_correction.bypass_mode
        ):  # pi_old is the engine's; the in-reward KL still needs ours
            return cfg.algorithm.use_kl_in_reward
        # the behaviour weights of off-policy correction are pi_old / pi_rollout: they need pi_old before the update
        return not on_policy or cfg.algorithm.rollout_correction.tis_mode is not None

    # ---- rollouts ---------------------------------------------------------------------------------
    def next_tasks(self, prefix: str = "train") -> list[Task]:
        return rows_to_tasks(next(self.loader), prefix)

    async def run_episodes(
        self,
        tasks: list[Task],
        n: int,
        mode: str,
        desc: str,
        on_group: Callable[[list[Episode]], None] | None = None,
    ) -> list[Episode]:
        """Collect `n` rollouts per task, each scored as it finishes; failed rollouts are kept, unscored.
        `on_group` gets each task's n episodes once the last of them is scored."""
        bar = progress_bar(desc, len(tasks) * n)
        by_id = {t.id: t for t in tasks}
        finished: dict[str, list[Episode]] = {}

        def score(episode: Episode) -> None:
            bar.update(1)
            if episode.termination_reason != TerminationReason.ERROR:
                score_episode(self.evaluator, by_id[episode.task_id], episode)
            elif episode.error:
                log.warning("rollout %s failed: %s", episode.id, episode.error.strip().splitlines()[-1])
            group = finished.setdefault(episode.task_id, [])
            group.append(episode)
            if on_group is not None and len(group) == n:
                on_group(group)

        episodes = await self.collector.collect(self.flow, tasks, n, mode=mode, on_episode=score)
        bar.close()
        return episodes

    def collect_training_episodes(self) -> tuple[list[Episode], list[Episode]]:
        """All episodes of this step, and those kept for training (`collect_training_episodes_async`)."""
        return self._run(self.collect_training_episodes_async())

    async def collect_training_episodes_async(
        self, on_group: Callable[[list[Episode]], None] | None = None
    ) -> tuple[list[Episode], list[Episode]]:
        """All episodes of this step, and those kept for training.

        With rejection sampling, rounds of new tasks are drawn until data.train_batch_size tasks survive the
        filters (partially solved ones under mode=solve_partial) or agent.rejection_sample.multiplier rounds ran.
        Episodes left out get their `filter_reason` (the tasks beyond the batch of a refill round: batch_full).
        `on_group` (a streamed update; one round only) gets the kept episodes of each task as its group finishes.
        """
        if on_group is not None:
            kept_by_group: list[Episode] = []

            def filtered(group: list[Episode]) -> None:
                group = self.filter_episodes(group)
                kept_by_group.extend(group)
                on_group(group)

            episodes = await self.run_episodes(
                self.next_tasks(), self.n, "train", "rollout", on_group=filtered
            )
            return episodes, kept_by_group
        reject = self.config.agent.rejection_sample
        rounds = reject.multiplier if reject.enable else 1
        all_episodes: list[Episode] = []
        kept: list[Episode] = []
        for round_index in range(max(1, rounds)):
            # Each refill round gets its own id prefix: position-based ids must not merge different prompts.
            prefix = "train" if round_index == 0 else f"train.r{round_index}"
            episodes = await self.run_episodes(self.next_tasks(prefix), self.n, "train", "rollout")
            all_episodes += episodes
            kept += self.filter_episodes(episodes)
            if len({e.task_id for e in kept}) >= self.config.data.train_batch_size:
                break
        task_ids = set(list(dict.fromkeys(e.task_id for e in kept))[: self.config.data.train_batch_size])
        for episode in kept:
            if episode.task_id not in task_ids:
                episode.filter_reason = "batch_full"
        return all_episodes, [e for e in kept if e.task_id in task_ids]

    def filter_episodes(self, episodes: list[Episode]) -> list[Episode]:
        """Drop failed rollouts and bad scores, then compact filtering, then rejection sampling.

        Each dropped episode gets its `filter_reason`, which the saved rollouts show.
        """
        for episode in episodes:
            if episode.termination_reason == TerminationReason.ERROR:
                episode.filter_reason = "error"
            elif episode.metrics.get("evaluator_error"):
                episode.filter_reason = "evaluator_error"
        episodes = [e for e in episodes if e.filter_reason is None]
        compact = self.config.agent.compact_filtering
        if compact.enable and episodes:
            masked = build_masked_reasons(**compact.model_dump(exclude={"enable"}))
            keep = compact_filter_keep([e.termination_reason for e in episodes], masked)
            episodes = _drop(episodes, keep, "compact_filtering")
        reject = self.config.agent.rejection_sample
        if reject.enable and episodes:
            keep = rejection_sample_keep(
                reject.mode,
                rewards=torch.tensor([e.reward for e in episodes]),
                is_correct=torch.tensor([e.is_correct for e in episodes]),
                group_ids=group_ids_of(episodes),
            )
            episodes = _drop(episodes, keep.tolist(), "rejection_sampling")
        return episodes

    def assemble(self, episodes: list[Episode], metrics: dict[str, float]) -> TrainBatch | None:
        batch, stats = self._to_batch(episodes)
        metrics.update(
            {
                "batch/kept_episodes": float(len(episodes)),
                "batch/merged_steps": float(stats.merged_steps),
                "batch/excluded_steps": float(stats.excluded_steps),
            }
        )
        if batch is None:
            log.warning(
                "step %d: no trainable rows (all filtered or failed); skipping the update",
                self.global_step + 1,
            )
        return batch

    def _to_batch(self, episodes: list[Episode]):
        """The training rows of `episodes` as a batch (None when there are none), and how their steps merged."""
        stepwise = self.config.agent.stepwise_advantage
        merge = not (stepwise.enable and stepwise.mode == "per_step")
        max_length = self.config.data.max_prompt_length + self.config.data.max_response_length
        rows, stats = episodes_to_rows(
            episodes, merge_steps=merge, max_length=max_length * self.config.agent.max_steps
        )
        if not rows:
            return None, stats
        vision = self.config.data.return_multi_modal_inputs
        processor = load_image_processor(self.config.actor_rollout_ref.model.path) if vision else None
        return rows_to_batch(rows, pad_token_id=self.stack.pad_token_id, image_processor=processor), stats

    def validate(self) -> dict[str, float]:
        val = self.config.actor_rollout_ref.rollout.val_kwargs
        size = self.config.data.val_batch_size or len(self.val_tasks)
        episodes = []
        for start in range(0, len(self.val_tasks), size):
            tasks = self.val_tasks[start : start + size]
            episodes += self._run(self.run_episodes(tasks, val.n, "val", "validate"))
        if self.rollout_log is not None:
            self.rollout_log.write(self.global_step, episodes, split="val")
        return compute_validation_metrics(episodes)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        def write(folder: Path) -> None:
            self.policy.call("save", folder)
            if self.critic is not None:
                self.critic.call("save", folder)

        return save_checkpoint(
            self.run_dir / "checkpoints",
            self.global_step,
            write,
            {
                "global_step": self.global_step,
                "dataloader": self.loader.state_dict(),
                "collector": self.collector.state_dict(),
            },
            max_to_keep=self.config.trainer.max_actor_ckpt_to_keep,
        )

    def _load_checkpoint(self, folder: Path) -> None:
        state = load_trainer_state(folder)
        self.policy.call("load", folder)
        if self.critic is not None:
            self.critic.call("load", folder)
        self.loader.load_state_dict(state["dataloader"])
        self.global_step = int(state["global_step"])
        log.info("resumed from %s at step %d", folder, self.global_step)

    def latest_checkpoint(self) -> Path | None:
        return find_latest_checkpoint(self.run_dir / "checkpoints")

    def export(self, folder: Path) -> None:
        self.policy.call_first("export", folder)

    def close(self, status: str = "FINISHED") -> None:
        """Stop servers and workers and end the tracked run as `status` (FINISHED, FAILED, KILLED);
        safe to call more than once."""
        if self.pipeline is not None:  # a run that failed mid-step: no rollout outlives it
            self.pipeline.close()
            self.pipeline = None
        if self.collector is not None:
            self.collector.close()
            self.collector = None
        for part in (self.stack, self.policy, self.critic, self.cluster):
            if part is not None:
                part.shutdown()
        self.stack = self.policy = self.critic = self.cluster = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.tracker is not None:
            self.tracker.finish(status=status)
            self.tracker = None
