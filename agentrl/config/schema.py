"""The configuration schema: every key agentrl reads, with its type, bounds, default and meaning.

`configs/agent_ppo_trainer.yaml` sets values; this module declares them. Key names follow verl and
rLLM so their users find what they expect. Each model forbids unknown keys, so a misspelt key is an
error instead of a silent fall-back to its default. The one-line docstring under each field is what
`docs/configuration.md` shows (`python -m agentrl.config.docs`).

Checks that involve several fields live in `checks.py` and run from `AgentRLConfig`'s validator,
which reports every problem at once. Derived defaults (`clip_ratio_low: null` -> `clip_ratio`, ...)
are filled in after those checks, so code reads concrete values.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]

BUILTIN_ADVANTAGE_ESTIMATORS: frozenset[str] = frozenset(
    {"grpo", "gae", "reinforce", "reinforce_plus_plus", "rloo"}
)
"""Names accepted without importing the algorithm registry (which imports torch)."""

KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def package_path(relative: str) -> str:
    """Absolute path of a file shipped inside the agentrl package (the YAML's `${agentrl.pkg:...}`)."""
    return str(_PACKAGE_ROOT / relative)


class _Section(BaseModel):
    """Base of every config model: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


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


# ------------------------------------------------------------------------------- actor_rollout_ref


class ModelConfig(_Section):
    path: str = Field("tiny:qwen2", min_length=1)
    """HF hub id, local folder, or `tiny:<preset>[@seed]` (built offline)."""
    tokenizer_path: str | None = None
    """Tokenizer to load; null uses `path`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the trained parameters."""
    lora_rank: int = Field(0, ge=0)
    """LoRA rank; 0 trains all weights, > 0 trains (and syncs) only the adapters."""
    lora_alpha: int = Field(16, ge=1)
    """LoRA scaling alpha."""
    target_modules: str | list[str] = "all-linear"
    """Modules LoRA adapts: `all-linear` or a list of module names."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    use_remove_padding: bool = True
    """Pack sequences without padding for the forward pass."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint folder / hub."""

    @field_validator("target_modules")
    @classmethod
    def _non_empty_modules(cls, value: str | list[str]) -> str | list[str]:
        if not value:
            raise ValueError("must name at least one module (or be `all-linear`)")
        return value


class OptimConfig(_Section):
    lr: float = Field(1e-6, gt=0.0)
    """Peak learning rate (AdamW)."""
    lr_warmup_steps: int = Field(-1, ge=-1)
    """Linear warm-up steps; -1 uses `lr_warmup_steps_ratio` instead."""
    lr_warmup_steps_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Warm-up as a fraction of the total training steps (when `lr_warmup_steps` is -1)."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Cosine schedule floor, as a fraction of `lr`."""
    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("each beta must be in [0, 1)")
        return value


class ActorFSDPConfig(_Section):
    param_offload: bool = False
    """Keep parameters on CPU between uses (saves device memory, costs time)."""
    optimizer_offload: bool = False
    """Keep optimizer state on CPU between steps."""


class ActorConfig(_Section):
    strategy: Literal["fsdp2"] = "fsdp2"
    """Training backend (FSDP2 `fully_shard`)."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Actor optimizer."""
    ppo_mini_batch_size: int = Field(8, ge=1)
    """Tasks (prompts) per optimizer step, as in verl: rows = this x rollout.n, split over devices."""
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    """Rows per forward/backward on one device (gradient accumulation unit)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token budget instead of row count."""
    ppo_max_token_len_per_gpu: int = Field(4096, ge=1)
    """Token budget per micro-batch when `use_dynamic_bsz` is on."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    clip_ratio: float = Field(0.2, gt=0.0)
    """PPO clip epsilon (both sides unless overridden below)."""
    clip_ratio_low: float | None = Field(None, gt=0.0)
    """Lower clip epsilon; null uses `clip_ratio`."""
    clip_ratio_high: float | None = Field(None, gt=0.0)
    """Upper clip epsilon (clip-higher, DAPO); null uses `clip_ratio`."""
    clip_ratio_c: float = Field(3.0, gt=1.0)
    """Dual-clip bound for negative advantages (must be > 1)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token losses are averaged into the batch loss."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (0 disables)."""
    use_kl_loss: bool = False
    """Add a KL(policy || reference) term to the actor loss (GRPO style)."""
    kl_loss_coef: float = Field(0.001, ge=0.0)
    """Weight of the KL loss."""
    kl_loss_type: KLType = "low_var_kl"
    """KL estimator: kl/k1, abs, mse/k2, low_var_kl/k3."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Max gradient norm."""
    shuffle: bool = True
    """Shuffle rows before splitting into mini-batches."""
    fsdp_config: ActorFSDPConfig = Field(default_factory=ActorFSDPConfig)
    """Actor FSDP memory options."""


class RefFSDPConfig(_Section):
    param_offload: bool = False
    """Keep reference parameters on CPU between uses."""


class RefConfig(_Section):
    log_prob_micro_batch_size_per_gpu: int = Field(4, ge=1)
    """Rows per reference log-prob forward on one device."""
    fsdp_config: RefFSDPConfig = Field(default_factory=RefFSDPConfig)
    """Reference model FSDP memory options."""


class ValKwargsConfig(_Section):
    temperature: float = Field(0.0, ge=0.0)
    """Validation sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Validation nucleus sampling threshold."""
    top_k: int = Field(-1, ge=-1)
    """Validation top-k; -1 disables."""
    n: int = Field(1, ge=1)
    """Samples per validation task."""
    do_sample: bool = False
    """Sample during validation; false decodes greedily."""


class VLLMConfig(_Section):
    python: str = Field(".venv-vllm/bin/python", min_length=1)
    """Python interpreter of the environment that has vLLM (servers run as subprocesses)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for `vllm serve`."""
    startup_timeout: float = Field(300.0, gt=0.0)
    """Seconds to wait for a vLLM server to become healthy."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype vLLM serves the policy in."""


class RolloutConfig(_Section):
    name: Literal["embedded", "vllm"] = "embedded"
    """Inference engine: our transformers-based `embedded` engine or `vllm` servers."""
    mode: Literal["async"] = "async"
    """Rollout mode: server-based asynchronous rollout."""
    n: int = Field(4, ge=1)
    """Samples per task (the GRPO group size)."""
    temperature: float = Field(1.0, ge=0.0)
    """Training sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Training nucleus sampling threshold."""
    top_k: int = Field(-1, ge=-1)
    """Training top-k; -1 disables."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences an engine generates at once."""
    max_model_len: int | None = Field(None, ge=1)
    """Engine context length; null means data.max_prompt_length + data.max_response_length."""
    tensor_model_parallel_size: int = Field(1, ge=1)
    """Devices per vLLM server (tensor parallelism)."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """Fraction of device memory vLLM may use."""
    free_cache_engine: bool = True
    """Free the engine's KV cache while training (hybrid engine sleep/wake)."""
    num_servers: int = Field(1, ge=1)
    """Inference servers behind the rollout pool."""
    max_n_per_request: int = Field(16, ge=1)
    """Largest `n` a single request to the server may ask for."""
    val_kwargs: ValKwargsConfig = Field(default_factory=ValKwargsConfig)
    """Sampling used during validation."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """vLLM server options (used when name is vllm)."""


class ActorRolloutRefConfig(_Section):
    hybrid_engine: bool = True
    """Colocate actor and rollout engine on the same devices, switching each step."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The trained policy."""
    ref: RefConfig = Field(default_factory=RefConfig)
    """The frozen reference policy (used when a KL term is on)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation."""


# -------------------------------------------------------------------------------------------- critic


class CriticModelConfig(_Section):
    path: str | None = None
    """Critic initialisation; null uses actor_rollout_ref.model.path."""
    enable_gradient_checkpointing: bool = False
    """Recompute critic activations in backward to save memory."""


class CriticConfig(_Section):
    model: CriticModelConfig = Field(default_factory=CriticModelConfig)
    """The value model."""
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer."""
    ppo_mini_batch_size: int = Field(8, ge=1)
    """Tasks (prompts) per critic optimizer step (rows = this x rollout.n)."""
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    """Rows per critic forward/backward on one device."""
    use_dynamic_bsz: bool = False
    """Form critic micro-batches by token budget instead of row count."""
    ppo_max_token_len_per_gpu: int = Field(4096, ge=1)
    """Token budget per critic micro-batch when `use_dynamic_bsz` is on."""
    ppo_epochs: int = Field(1, ge=1)
    """Critic passes over each rollout batch."""
    cliprange_value: float = Field(0.5, gt=0.0)
    """Value clipping range around the old values."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token value losses are averaged."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Max critic gradient norm."""
    fsdp_config: ActorFSDPConfig = Field(default_factory=ActorFSDPConfig)
    """Critic FSDP memory options."""


# ----------------------------------------------------------------------------------------- algorithm


class KLControlConfig(_Section):
    kl_coef: float = Field(0.001, ge=0.0)
    """Weight of the KL penalty subtracted from token rewards (use_kl_in_reward)."""


class AlgorithmConfig(_Section):
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, gae, reinforce, reinforce_plus_plus, rloo, or a registered name."""
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
    """Divide per-step advantages by the number of steps (per_step mode)."""


class RejectionSampleConfig(_Section):
    enable: bool = False
    """Drop groups whose rewards are all equal (all solved or none solved)."""
    multiplier: int = Field(1, ge=1)
    """Oversample tasks by this factor so a batch survives rejection."""


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
    max_steps: int = Field(8, ge=1)
    """Most model calls (turns) per episode."""
    n_parallel_tasks: int = Field(64, ge=1)
    """Episodes run concurrently."""
    retry_limit: int = Field(1, ge=1)
    """Attempts per episode when the flow raises (1 = no retry)."""
    timeout: float = Field(120.0, gt=0.0)
    """Seconds an episode may run before it ends as timeout."""
    stepwise_advantage: StepwiseAdvantageConfig = Field(default_factory=StepwiseAdvantageConfig)
    """Step-wise advantages for multi-step agents."""
    rejection_sample: RejectionSampleConfig = Field(default_factory=RejectionSampleConfig)
    """Rejection sampling of groups without learning signal."""
    compact_filtering: CompactFilteringConfig = Field(default_factory=CompactFilteringConfig)
    """Filtering by termination reason."""


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
    """Metric sinks."""
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

    @field_validator("save_freq", "test_freq")
    @classmethod
    def _valid_freq(cls, value: int) -> int:
        return _check_freq(value)


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

    @model_validator(mode="after")
    def _check_and_derive(self) -> AgentRLConfig:
        from agentrl.config.checks import fill_derived_defaults, raise_cross_field_problems

        raise_cross_field_problems(self)
        fill_derived_defaults(self)
        return self
