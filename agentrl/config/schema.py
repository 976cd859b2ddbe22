"""The configuration schema: every key agentrl reads, with its type, bounds, default and meaning.

`configs/agent_ppo_trainer.yaml` sets values; this module declares them. Key names follow verl and
rLLM so their users find what they expect. Each model forbids unknown keys, so a misspelt key is an
error instead of a silent fall-back to its default. The one-line docstring under each field is what
`docs/configuration.md` shows (`python -m agentrl.config.docs`). The worker-group sections
(actor_rollout_ref, critic) live in schema_workers.py.

Checks that involve several fields live in `checks.py` and run from `AgentRLConfig`'s validator,
which reports every problem at once. Derived defaults (`clip_ratio_low: null` -> `clip_ratio`, ...)
are filled in after those checks, so code reads concrete values.
"""

from __future__ import annotations

import difflib
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from agentrl.config._base import KLType, package_path
from agentrl.config._base import Section as _Section
from agentrl.config.schema_workers import ActorRolloutRefConfig, CriticConfig

BUILTIN_ADVANTAGE_ESTIMATORS: frozenset[str] = frozenset(
    {"grpo", "gae", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"}
)
"""Names accepted without importing the algorithm registry (which imports torch)."""


_IMPORT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
"""`package.module:Name`, as console-script entry points write it."""


def _check_freq(value: int) -> int:
    if value == 0 or value < -1:
        raise ValueError("must be -1 (never) or a positive number of steps")
    return value


# ---------------------------------------------------------------------------------------------- data


class DataConfig(_Section):
    train_files: str | list[str] = Field(
        default_factory=lambda: package_path("data/samples/gsm8k_train.jsonl")
    )
    """Training data: a parquet/jsonl file or a list of them (verl row format); default is the shipped GSM8K sample."""
    val_files: str | list[str] = Field(default_factory=lambda: package_path("data/samples/gsm8k_test.jsonl"))
    """Validation data: a parquet/jsonl file or a list of them."""
    train_batch_size: int = Field(8, ge=1)
    """Tasks (prompts) per training step; each is rolled out `actor_rollout_ref.rollout.n` times."""
    val_batch_size: int | None = Field(None, ge=1)
    """Tasks per validation batch; null validates the whole set in one batch."""
    max_prompt_length: int = Field(256, ge=1)
    """Longest prompt in tokens; longer episodes end as max_prompt_length_exceeded."""
    max_response_length: int = Field(64, ge=1)
    """Most tokens generated per model call (and per response row in training)."""
    return_multi_modal_inputs: bool = False
    """Pass images through to the processor (vision-language policies)."""
    shuffle: bool = True
    """Shuffle the training data each epoch."""
    seed: int = 1
    """Seed of the data shuffle."""
    prompt_key: str = Field("prompt", min_length=1)
    """Row field holding the prompt messages."""


# ----------------------------------------------------------------------------------------- algorithm


class KLControlConfig(_Section):
    kl_coef: float = Field(0.001, ge=0.0)
    """Weight of the KL penalty subtracted from token rewards (use_kl_in_reward)."""


class RolloutCorrectionConfig(_Section):
    tis_mode: Literal["token", "sequence"] | None = None
    """Off-policy correction: each token's policy-gradient loss is weighted by min(pi_old / pi_rollout, tis_cap), the engine's log-probs giving pi_rollout; `token` weighs each token, `sequence` each row by its tokens' product; null is off (docs/algorithms.md)."""
    tis_cap: float = Field(2.0, gt=0.0)
    """Truncation of the importance weight (tis_mode): a larger weight counts as tis_cap."""
    bypass_mode: bool = False
    """PPO's old policy is the engine's: the ratio is pi_theta / pi_rollout (the log-probs the engine recorded), clipped as usual, and the old-log-prob pass is skipped (verl's bypass mode). With asynchronous training each update is then clipped against the policy that sampled its tokens."""


class AlgorithmConfig(_Section):
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, gae, reinforce, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo, or a registered name."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount factor."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's reward std (false: Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty from token rewards (PPO style)."""
    kl_penalty: KLType = "kl"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    """In-reward KL coefficient."""
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    """Truncated importance sampling against the rollout engine's log-probs (stale or mismatched tokens)."""

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        known = known_advantage_estimators(include_registry=value not in BUILTIN_ADVANTAGE_ESTIMATORS)
        if value not in known:
            close = difflib.get_close_matches(value, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown advantage estimator; known: {', '.join(sorted(known))}{hint}")
        return value


def known_advantage_estimators(include_registry: bool = True) -> set[str]:
    """Built-in names, plus the registry's when asked (that import pulls in torch, so only when needed)."""
    names = set(BUILTIN_ADVANTAGE_ESTIMATORS)
    if include_registry:
        try:
            from agentrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
        except ImportError:
            return names
        names |= set(ADVANTAGE_ESTIMATORS)
    return names


# --------------------------------------------------------------------------------------------- agent


class StepwiseAdvantageConfig(_Section):
    enable: bool = False
    """Train multi-step trajectories step by step."""
    mode: Literal["broadcast", "per_step"] = "broadcast"
    """`broadcast` gives every step the trajectory's advantage; `per_step` scores each step itself."""
    normalize_by_steps: bool = False
    """Divide a trajectory's advantage by its number of steps (broadcast mode, as in rLLM)."""


class RejectionSampleConfig(_Section):
    enable: bool = False
    """Drop tasks without learning signal before the update (which ones: mode)."""
    mode: Literal["uniform_reward", "solve_partial"] = "uniform_reward"
    """`uniform_reward` drops tasks whose episodes' rewards are all equal; `solve_partial` (rLLM) keeps only tasks some but not all of whose episodes are is_correct."""
    multiplier: int = Field(1, ge=1)
    """Most rollout rounds per step: new tasks are drawn until data.train_batch_size tasks survive or this many rounds ran."""


class CompactFilteringConfig(_Section):
    enable: bool = False
    """Drop episodes from training by termination reason (the mask_* flags below)."""
    mask_max_prompt_length_exceeded: bool = True
    """Drop episodes whose prompt outgrew data.max_prompt_length."""
    mask_max_response_length_exceeded: bool = True
    """Drop episodes cut at data.max_response_length."""
    mask_env_done: bool = False
    """Drop episodes the environment finished normally."""
    mask_max_turns_exceeded: bool = True
    """Drop episodes that hit agent.max_steps."""
    mask_timeout: bool = True
    """Drop episodes that hit agent.timeout."""
    mask_unknown: bool = False
    """Drop episodes that ended for an unknown reason."""
    mask_error: bool = True
    """Drop episodes whose flow raised."""


class AgentConfig(_Section):
    flow: str = "agentrl.flow:SingleTurnChatFlow"
    """`package.module:Name` of the AgentFlow `agentrl train` runs (a class is built with no arguments)."""
    evaluator: str = "agentrl.evaluator:MathAnswerMatch"
    """`package.module:Name` of the Evaluator `agentrl train` scores episodes with."""
    max_steps: int = Field(8, ge=1)
    """Most model calls (turns) per episode."""
    n_parallel_tasks: int | None = Field(None, ge=1)
    """Episodes run concurrently; null: as many as the rollout engines decode at once (max_num_seqs each)."""
    retry_limit: int = Field(1, ge=1)
    """Attempts per episode when the flow raises (1 = no retry)."""
    timeout: float = Field(120.0, gt=0.0)
    """Seconds an episode may run before it ends as timeout."""
    num_workers: int = Field(0, ge=0)
    """Processes that run the flows (verl's agent loop workers, `actor_rollout_ref.rollout.agent.num_workers`): each runs many rollouts on its own event loop and reaches the gateway over loopback TCP, so the agents' Python and their openai clients do not hold the GIL the engine's scheduler needs. 0: the flows run on the trainer's event loop. Each worker runs a pickled copy of the flow (docs/rollout.md). On a GPU host 8 made the 8-turn agent benchmark's step 1.15x faster, 1.49x with flows that stream (docs/benchmarks.md); on 2 CPU cores the loopback hop costs more than it frees."""
    group_calls: bool = True
    """A flow that defines `run_group` (SingleTurnChatFlow does) samples a task's rollout.n episodes in one call with n choices instead of n calls (up to rollout.max_n_per_request); false: n calls, n sessions."""
    cumulative_token_mode: bool = True
    """A chat turn that re-sends its session's history (the same messages, the reply it was given, then new messages) continues from the sampled token ids instead of re-rendering the text, so it merges into the episode's training row (rLLM's name; docs/rollout.md)."""
    stepwise_advantage: StepwiseAdvantageConfig = Field(default_factory=StepwiseAdvantageConfig)
    """Step-wise advantages for multi-step agents."""
    rejection_sample: RejectionSampleConfig = Field(default_factory=RejectionSampleConfig)
    """Rejection sampling of groups without learning signal."""
    compact_filtering: CompactFilteringConfig = Field(default_factory=CompactFilteringConfig)
    """Filtering by termination reason."""

    @field_validator("flow", "evaluator")
    @classmethod
    def _import_spec(cls, value: str) -> str:
        if not _IMPORT_SPEC.fullmatch(value):
            raise ValueError("expected 'package.module:Name', e.g. 'agentrl.flow:SingleTurnChatFlow'")
        return value


# ------------------------------------------------------------------------------------------- trainer


class TrainerConfig(_Section):
    total_epochs: int = Field(1, ge=1)
    """Passes over the training data."""
    total_training_steps: int | None = Field(None, ge=1)
    """Stop after this many steps; null runs total_epochs."""
    save_freq: int = -1
    """Checkpoint every N steps; -1 never (a final checkpoint is still written at the end)."""
    test_freq: int = -1
    """Validate every N steps; -1 never."""
    val_before_train: bool = True
    """Validate once before the first step."""
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    """Run folder: resolved config, logs, MLflow store, checkpoints."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """`auto` resumes from the latest complete checkpoint, `disable` starts fresh, `resume_path` uses resume_from_path."""
    resume_from_path: str | None = None
    """Checkpoint folder (global_step_N) to resume from when resume_mode is resume_path."""
    logger: list[Literal["console", "mlflow"]] = Field(default_factory=lambda: ["console", "mlflow"])
    """Metric sinks; with mlflow, saved episodes are also logged as MLflow traces."""
    rollout_data_dir: str | None = None
    """Folder for every step's episodes as JSONL (docs/rollouts.md); null is `<default_local_dir>/rollouts`."""
    rollout_data_fraction: float = Field(1.0, ge=0.0, le=1.0)
    """Share of each step's episodes saved (picked by episode id, the same on a rerun); 0 saves none."""
    rollout_trace_freq: int = 25
    """With the mlflow logger, log the saved episodes of every N-th step and of the last step as MLflow traces; -1 never."""
    rollout_trace_max_episodes: int = 16
    """Of a traced step, the first N saved episodes of each split become MLflow traces (whole GRPO groups); -1 all."""
    project_name: str = Field("agentrl", min_length=1)
    """Project (MLflow experiment) name."""
    experiment_name: str = Field("default", min_length=1)
    """Run name."""
    n_gpus_per_node: int = Field(1, ge=1)
    """Devices per node (processes per node on CPU)."""
    nnodes: int = Field(1, ge=1)
    """Nodes."""
    max_actor_ckpt_to_keep: int | None = Field(None, ge=1)
    """Keep only the newest N checkpoints; null keeps all."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device type; auto picks cuda when available."""
    seed: int = 1
    """Seed for model init, sampling and dropout."""
    backend: Literal["local", "ray"] = "local"
    """Worker groups: `local` (in-process, one device) or `ray` (one actor per device)."""

    @field_validator("save_freq", "test_freq", "rollout_trace_freq")
    @classmethod
    def _valid_freq(cls, value: int) -> int:
        return _check_freq(value)

    @field_validator("rollout_trace_max_episodes")
    @classmethod
    def _valid_trace_cap(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(
                f"must be a positive number of episodes or -1 (all), got {value}; "
                "trainer.rollout_trace_freq=-1 turns traces off"
            )
        return value


class ResourcePoolConfig(_Section):
    actor_rollout_gpus: int | None = Field(None, ge=1)
    """Devices for actor+rollout; null uses all of them."""
    critic_gpus: int | None = Field(None, ge=1)
    """Devices for the critic; null shares the actor's."""
    ref_gpus: int | None = Field(None, ge=1)
    """Devices for the reference model; null shares the actor's."""


class SFTConfig(_Section):
    enable: bool = False
    """Warm-start the policy with supervised fine-tuning before RL."""
    epochs: int = Field(1, ge=1)
    """SFT passes over the data."""
    lr: float = Field(1e-5, gt=0.0)
    """SFT learning rate."""
    batch_size: int = Field(8, ge=1)
    """SFT rows per optimizer step."""
    max_steps: int | None = Field(None, ge=1)
    """Stop SFT after this many steps; null runs all epochs."""
    val_rows: int = Field(0, ge=0)
    """Hold out the last N rows of the SFT data (not trained on) and check their greedy accuracy every val_freq steps; 0: no check."""
    val_freq: int = Field(25, ge=1)
    """SFT steps between checks of the held-out rows (and one after the last step)."""
    stop_accuracy: float | None = Field(None, gt=0.0, le=1.0)
    """End SFT at the first check where at least this share of the held-out rows' responses is the model's greedy output; null runs max_steps / epochs."""


class AsyncTrainingConfig(_Section):
    enable: bool = False
    """Collect the next steps' rollouts while a step trains (docs/async.md)."""
    staleness_threshold: int = Field(1, ge=0)
    """Most policy versions a trained token may lag the weights it trains; 0 is the synchronous loop, exactly."""
    partial_rollout: bool = True
    """New weights reach the engines at once, between two decode steps, and episodes in flight go on with them; the batches asked for are collected at once, sharing agent.n_parallel_tasks. false collects them one after another, and a push waits for the batch being collected to end."""
    reuse_stale_prefixes: bool = False
    """The embedded engine keeps an agent's parked history (its keys and values) across up to staleness_threshold weight pushes instead of prefilling it again under the new weights."""
    streaming_update: bool = False
    """The update starts on a step's groups as they finish (gradients accumulated a micro-batch at a time, one optimizer step once the last is in) instead of waiting for its slowest episode: the same update, for group-wise advantages (grpo, rloo) with one epoch of one mini-batch and no KL in the reward."""


# ---------------------------------------------------------------------------------------------- root


class AgentRLConfig(_Section):
    """The whole run configuration, as composed from `configs/agent_ppo_trainer.yaml` and overrides."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Datasets and sequence lengths."""
    actor_rollout_ref: ActorRolloutRefConfig = Field(default_factory=ActorRolloutRefConfig)
    """Policy model, actor training, reference model and rollout."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """Value model (used by gae)."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimation and in-reward KL."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Agent loop limits and episode filtering."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Run length, checkpoints, logging, devices."""
    resource_pool_config: ResourcePoolConfig = Field(default_factory=ResourcePoolConfig)
    """Device placement of the worker groups."""
    sft: SFTConfig = Field(default_factory=SFTConfig)
    """Optional supervised warm start."""
    async_training: AsyncTrainingConfig = Field(default_factory=AsyncTrainingConfig)
    """Asynchronous training: rollouts run ahead of training by a bounded number of policy versions."""

    @model_validator(mode="after")
    def _check_and_derive(self) -> AgentRLConfig:
        from agentrl.config.checks import fill_derived_defaults, raise_cross_field_problems

        raise_cross_field_problems(self)
        fill_derived_defaults(self)
        return self
