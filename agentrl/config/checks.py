"""Rules that involve several config fields, and the derived defaults filled in after them.

Each `_check_*` function looks at one rule and returns its problems as messages that name the dotted
key, the bad value and the fix. `AgentRLConfig` runs them all and raises one `ConfigError` with
every problem, so a launch reports everything wrong at once. The first docstring line of each
check is listed in docs/configuration.md.

Batch-size units follow verl: `ppo_mini_batch_size` counts tasks (prompts); the rows it stands for
are `ppo_mini_batch_size x rollout.n`, split evenly over the devices of the worker group, and
`ppo_micro_batch_size_per_gpu` counts rows on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agentrl.config.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.config.schema import AgentRLConfig
    from agentrl.config.schema_workers import ActorConfig, CriticConfig

_GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


def _world_size(cfg: AgentRLConfig) -> int:
    return cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_mini_micro(
    cfg: AgentRLConfig, prefix: str, section: ActorConfig | CriticConfig, devices: int
) -> list[str]:
    problems = []
    mini, micro, n = (
        section.ppo_mini_batch_size,
        section.ppo_micro_batch_size_per_gpu,
        cfg.actor_rollout_ref.rollout.n,
    )
    if mini > cfg.data.train_batch_size:
        problems.append(
            f"{prefix}.ppo_mini_batch_size={mini} is larger than data.train_batch_size={cfg.data.train_batch_size} "
            f"(both count tasks); set {prefix}.ppo_mini_batch_size <= {cfg.data.train_batch_size}"
        )
    if section.use_dynamic_bsz:
        return problems
    rows = mini * n
    if rows % devices:
        problems.append(
            f"{prefix}.ppo_mini_batch_size={mini} x actor_rollout_ref.rollout.n={n} = {rows} rows does not split "
            f"evenly over {devices} devices; choose a mini-batch size whose row count is a multiple of {devices}"
        )
    elif (rows // devices) % micro:
        per_device = rows // devices
        problems.append(
            f"{prefix}.ppo_mini_batch_size={mini} ({per_device} rows per device with actor_rollout_ref.rollout.n={n}) "
            f"is not divisible by {prefix}.ppo_micro_batch_size_per_gpu={micro}; use a micro-batch size that divides "
            f"{per_device} (one of {_divisors(per_device)}) or set {prefix}.use_dynamic_bsz=true"
        )
    return problems


def _check_actor_batch_sizes(cfg: AgentRLConfig) -> list[str]:
    """Actor: ppo_mini_batch_size <= data.train_batch_size, and its rows divide into micro-batches on every device."""
    devices = cfg.resource_pool_config.actor_rollout_gpus or _world_size(cfg)
    return _check_mini_micro(cfg, "actor_rollout_ref.actor", cfg.actor_rollout_ref.actor, devices)


def _check_critic_batch_sizes(cfg: AgentRLConfig) -> list[str]:
    """Critic (when adv_estimator=gae uses it): the same mini/micro-batch rules as the actor."""
    if cfg.algorithm.adv_estimator != "gae":
        return []
    devices = (
        cfg.resource_pool_config.critic_gpus
        or cfg.resource_pool_config.actor_rollout_gpus
        or _world_size(cfg)
    )
    return _check_mini_micro(cfg, "critic", cfg.critic, devices)


def _check_group_size(cfg: AgentRLConfig) -> list[str]:
    """grpo, rloo and reinforce_plus_plus_baseline compare samples within a group: actor_rollout_ref.rollout.n >= 2."""
    est, n = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if est in _GROUP_ESTIMATORS and n < 2:
        return [
            f"actor_rollout_ref.rollout.n={n} but algorithm.adv_estimator={est} needs at least 2 samples per task "
            f"to form a group; set actor_rollout_ref.rollout.n>=2 (or use adv_estimator=reinforce_plus_plus)"
        ]
    return []


def _check_rejection_sampling(cfg: AgentRLConfig) -> list[str]:
    """agent.rejection_sample: mode/multiplier need enable=true; either mode compares a task's episodes, so rollout.n >= 2."""
    n, reject = cfg.actor_rollout_ref.rollout.n, cfg.agent.rejection_sample
    if not reject.enable and (reject.mode != "uniform_reward" or reject.multiplier > 1):
        changed = (
            f"mode={reject.mode}" if reject.mode != "uniform_reward" else f"multiplier={reject.multiplier}"
        )
        return [
            f"agent.rejection_sample.{changed} has no effect while agent.rejection_sample.enable=false; "
            f"set agent.rejection_sample.enable=true"
        ]
    if reject.enable and n < 2:
        return [
            f"agent.rejection_sample.enable=true with actor_rollout_ref.rollout.n={n} would drop every task "
            f"(a lone episode's reward is uniform, and it is all solved or none); "
            f"set actor_rollout_ref.rollout.n>=2 or disable it"
        ]
    return []


def _check_single_kl(cfg: AgentRLConfig) -> list[str]:
    """KL is applied once: not both actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward."""
    if cfg.actor_rollout_ref.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        return [
            "actor_rollout_ref.actor.use_kl_loss=true and algorithm.use_kl_in_reward=true would penalise KL twice; "
            "set one of them to false (GRPO usually uses the loss, PPO the reward)"
        ]
    return []


def _check_resume(cfg: AgentRLConfig) -> list[str]:
    """trainer.resume_mode=resume_path needs trainer.resume_from_path, and a path needs that mode."""
    mode, path = cfg.trainer.resume_mode, cfg.trainer.resume_from_path
    if mode == "resume_path" and not path:
        return [
            "trainer.resume_mode=resume_path needs trainer.resume_from_path; "
            "set it to a checkpoint folder (.../checkpoints/global_step_N)"
        ]
    if mode != "resume_path" and path:
        return [
            f"trainer.resume_from_path={path!r} is ignored while trainer.resume_mode={mode}; "
            f"set trainer.resume_mode=resume_path or remove the path"
        ]
    return []


def _check_stepwise(cfg: AgentRLConfig) -> list[str]:
    """agent.stepwise_advantage: mode/normalize_by_steps need enable=true; normalize_by_steps needs mode=broadcast (as in rLLM)."""
    sw = cfg.agent.stepwise_advantage
    problems = []
    if not sw.enable and (sw.mode != "broadcast" or sw.normalize_by_steps):
        changed = "mode=per_step" if sw.mode != "broadcast" else "normalize_by_steps=true"
        problems.append(
            f"agent.stepwise_advantage.{changed} has no effect while agent.stepwise_advantage.enable=false; "
            f"set agent.stepwise_advantage.enable=true"
        )
    elif sw.normalize_by_steps and sw.mode != "broadcast":
        problems.append(
            f"agent.stepwise_advantage.normalize_by_steps=true only applies to mode=broadcast, where it divides a "
            f"trajectory's advantage by its number of steps (got mode={sw.mode}); "
            f"set agent.stepwise_advantage.mode=broadcast or normalize_by_steps=false"
        )
    return problems


def _check_stepwise_estimator(cfg: AgentRLConfig) -> list[str]:
    """agent.stepwise_advantage.enable=true needs an outcome estimator: algorithm.adv_estimator=gae is refused."""
    sw, est = cfg.agent.stepwise_advantage, cfg.algorithm.adv_estimator
    if sw.enable and est == "gae":
        return [
            f"algorithm.adv_estimator=gae cannot be used with agent.stepwise_advantage.enable=true "
            f"(mode={sw.mode}): step-wise advantages give each step one scalar from an outcome estimator, while gae "
            f"needs the critic's token-level values; set algorithm.adv_estimator to grpo, rloo, "
            f"reinforce_plus_plus_baseline, reinforce or reinforce_plus_plus, or agent.stepwise_advantage.enable=false"
        ]
    return []


def _check_model_len(cfg: AgentRLConfig) -> list[str]:
    """actor_rollout_ref.rollout.max_model_len, when set, fits data.max_prompt_length + data.max_response_length."""
    max_len = cfg.actor_rollout_ref.rollout.max_model_len
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    if max_len is not None and max_len < need:
        return [
            f"actor_rollout_ref.rollout.max_model_len={max_len} is shorter than data.max_prompt_length + "
            f"data.max_response_length = {need}; set it >= {need} or null"
        ]
    return []


def _check_tensor_parallel(cfg: AgentRLConfig) -> list[str]:
    """tensor_model_parallel_size > 1 needs rollout.name=vllm and must divide the actor's devices."""
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if tp == 1:
        return []
    if cfg.actor_rollout_ref.rollout.name != "vllm":
        return [
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} needs actor_rollout_ref.rollout.name=vllm "
            f"(the embedded engine runs on one device); set it to 1 or switch to vllm"
        ]
    devices = cfg.resource_pool_config.actor_rollout_gpus or _world_size(cfg)
    if devices % tp:
        return [
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the {devices} actor/rollout "
            f"devices; choose one of {_divisors(devices)}"
        ]
    return []


def _check_backend_devices(cfg: AgentRLConfig) -> list[str]:
    """trainer.backend=local runs in one process on one device; more devices need trainer.backend=ray."""
    world = _world_size(cfg)
    if cfg.trainer.backend == "local" and world > 1:
        return [
            f"trainer.backend=local uses one device but trainer.n_gpus_per_node x trainer.nnodes = {world}; "
            f"set trainer.backend=ray or use 1 device"
        ]
    return []


def _check_fsdp_size(cfg: AgentRLConfig) -> list[str]:
    """fsdp_config.fsdp_size is -1 (shard over all ranks) or divides the worker group's devices (HSDP)."""
    actor_devices = cfg.resource_pool_config.actor_rollout_gpus or _world_size(cfg)
    sections = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size, actor_devices)]
    if cfg.algorithm.adv_estimator == "gae":
        critic_devices = cfg.resource_pool_config.critic_gpus or actor_devices
        sections.append(("critic", cfg.critic.fsdp_config.fsdp_size, critic_devices))
    return [
        f"{prefix}.fsdp_config.fsdp_size={size} does not divide the {devices} devices of its worker group; "
        f"choose one of {_divisors(devices)} (HSDP groups) or -1 (shard over all)"
        for prefix, size, devices in sections
        if size == 0 or (size < devices and devices % size)
    ]


def _check_resource_pool(cfg: AgentRLConfig) -> list[str]:
    """resource_pool_config.*_gpus, when set, are at most trainer.n_gpus_per_node x trainer.nnodes."""
    world = _world_size(cfg)
    problems = []
    for name, value in cfg.resource_pool_config.model_dump().items():
        if value is not None and value > world:
            problems.append(
                f"resource_pool_config.{name}={value} is more than the {world} devices of the run "
                f"(trainer.n_gpus_per_node x trainer.nnodes); set it <= {world} or null"
            )
    return problems


def _check_val_sampling(cfg: AgentRLConfig) -> list[str]:
    """rollout.val_kwargs: do_sample=true needs temperature > 0; greedy decoding (do_sample=false) needs n=1."""
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    if vk.do_sample and vk.temperature == 0.0:
        return [
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true with temperature=0.0 is greedy; "
            "set actor_rollout_ref.rollout.val_kwargs.temperature > 0 or do_sample=false"
        ]
    if not vk.do_sample and vk.n > 1:
        return [
            f"actor_rollout_ref.rollout.val_kwargs.n={vk.n} with do_sample=false repeats the same greedy answer; "
            f"set actor_rollout_ref.rollout.val_kwargs.do_sample=true or n=1"
        ]
    return []


def _check_bypass(cfg: AgentRLConfig) -> list[str]:
    """rollout_correction.bypass_mode and tis_mode exclude each other: in bypass mode pi_old is pi_rollout."""
    rc = cfg.algorithm.rollout_correction
    if rc.bypass_mode and rc.tis_mode is not None:
        return [
            f"algorithm.rollout_correction.bypass_mode=true with tis_mode={rc.tis_mode}: in bypass mode the old "
            f"policy is the engine's, so every weight pi_old / pi_rollout would be 1; set tis_mode=null or "
            f"bypass_mode=false"
        ]
    return []


def _check_stale_prefixes(cfg: AgentRLConfig) -> list[str]:
    """async_training.reuse_stale_prefixes needs asynchronous training (its bound) and the embedded engine."""
    run_ahead = cfg.async_training
    if not run_ahead.reuse_stale_prefixes:
        return []
    if not (run_ahead.enable and run_ahead.staleness_threshold > 0):
        return [
            f"async_training.reuse_stale_prefixes=true with enable={str(run_ahead.enable).lower()} and "
            f"staleness_threshold={run_ahead.staleness_threshold}: only asynchronous training (enable=true, "
            f"staleness_threshold > 0) serves older weights' keys and values; set reuse_stale_prefixes=false"
        ]
    if cfg.actor_rollout_ref.rollout.name != "embedded":
        return [
            f"async_training.reuse_stale_prefixes=true with actor_rollout_ref.rollout.name="
            f"{cfg.actor_rollout_ref.rollout.name}: only the embedded engine keeps prefixes across weight pushes; "
            f"set reuse_stale_prefixes=false or rollout.name=embedded"
        ]
    return []


GROUP_WISE_ESTIMATORS = ("grpo", "rloo")
"""Advantage estimators that compare a task's episodes with each other only: a group's advantages are final once it
finishes, which a streamed update needs (the others normalise over the whole batch or need the critic)."""


def _check_streaming_update(cfg: AgentRLConfig) -> list[str]:
    """async_training.streaming_update: an asynchronous run whose update is one optimizer step on group-wise
    advantages, with nothing computed over the whole batch before it."""
    run_ahead, actor, algorithm = cfg.async_training, cfg.actor_rollout_ref.actor, cfg.algorithm
    if not run_ahead.streaming_update:
        return []
    needs = [
        (
            run_ahead.enable and run_ahead.staleness_threshold > 0,
            f"async_training.enable=true and staleness_threshold > 0 (got enable={str(run_ahead.enable).lower()}, "
            f"staleness_threshold={run_ahead.staleness_threshold}): it trains while the batch is collected",
        ),
        (
            algorithm.adv_estimator in GROUP_WISE_ESTIMATORS,
            f"algorithm.adv_estimator in {list(GROUP_WISE_ESTIMATORS)} (got {algorithm.adv_estimator}): a "
            f"group's advantages must be final when it finishes",
        ),
        (
            actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= cfg.data.train_batch_size,
            f"one optimizer step an update: actor.ppo_epochs=1 and ppo_mini_batch_size >= data.train_batch_size "
            f"(got {actor.ppo_epochs} and {actor.ppo_mini_batch_size} for {cfg.data.train_batch_size})",
        ),
        (
            not algorithm.use_kl_in_reward and algorithm.rollout_correction.tis_mode is None,
            "algorithm.use_kl_in_reward=false and rollout_correction.tis_mode=null: both need the whole batch's "
            "log-probs before the update",
        ),
        (
            not (cfg.agent.rejection_sample.enable and cfg.agent.rejection_sample.multiplier > 1),
            "agent.rejection_sample.multiplier=1 when it is enabled: refill rounds decide the batch only at its end",
        ),
    ]
    return [f"async_training.streaming_update=true needs {what}" for ok, what in needs if not ok]


def _check_train_temperature(cfg: AgentRLConfig) -> list[str]:
    """rollout.temperature > 0: the trainer divides its logits by it (the policy the engine sampled from)."""
    if cfg.actor_rollout_ref.rollout.temperature > 0.0:
        return []
    return [
        "actor_rollout_ref.rollout.temperature=0.0 samples training episodes greedily: a group's answers would "
        "be identical and the trained policy softmax(logits / temperature) is undefined; set it > 0 "
        "(1.0 samples the model as it is)"
    ]


def _check_sft_stop(cfg: AgentRLConfig) -> list[str]:
    """sft.stop_accuracy needs held-out rows to check: sft.val_rows >= 1."""
    sft = cfg.sft
    if sft.stop_accuracy is not None and sft.val_rows == 0:
        return [
            f"sft.stop_accuracy={sft.stop_accuracy} needs held-out rows to check, but sft.val_rows=0; "
            f"set sft.val_rows to the number of SFT rows to hold out (e.g. 48) or sft.stop_accuracy=null"
        ]
    return []


CROSS_FIELD_CHECKS: tuple[Callable[[AgentRLConfig], list[str]], ...] = (
    _check_actor_batch_sizes,
    _check_critic_batch_sizes,
    _check_group_size,
    _check_rejection_sampling,
    _check_single_kl,
    _check_resume,
    _check_stepwise,
    _check_stepwise_estimator,
    _check_model_len,
    _check_tensor_parallel,
    _check_backend_devices,
    _check_fsdp_size,
    _check_resource_pool,
    _check_val_sampling,
    _check_train_temperature,
    _check_bypass,
    _check_stale_prefixes,
    _check_streaming_update,
    _check_sft_stop,
)
"""Every cross-field rule, in the order problems are reported."""


def raise_cross_field_problems(cfg: AgentRLConfig) -> None:
    """Run every rule; raise one ConfigError listing all problems (nothing when the config is consistent)."""
    problems = [p for check in CROSS_FIELD_CHECKS for p in check(cfg)]
    if problems:
        raise ConfigError(problems)


def fill_derived_defaults(cfg: AgentRLConfig) -> None:
    """Replace `null means X` defaults by X, so code reads concrete values; resolve leftover `${...}`."""
    _resolve_interpolations(cfg)
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    if rollout.max_model_len is None:
        rollout.max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.critic.model.path is None:
        cfg.critic.model.path = cfg.actor_rollout_ref.model.path


def _resolve_interpolations(cfg: AgentRLConfig) -> None:
    """A config built in Python (not through Hydra) may still hold `${trainer.project_name}`-style strings."""
    dumped = cfg.model_dump(mode="json")
    if not _has_interpolation(dumped):
        return
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from agentrl.config._base import register_resolvers

    register_resolvers()
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(dumped), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = str(getattr(exc, "msg", exc)).splitlines()[0]
        raise ConfigError(f"{key}: cannot resolve interpolation: {reason}") from None
    _assign_resolved(cfg, dumped, resolved)


def _has_interpolation(node: Any) -> bool:
    if isinstance(node, dict):
        return any(_has_interpolation(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_interpolation(v) for v in node)
    return isinstance(node, str) and "${" in node


def _assign_resolved(model: Any, before: dict, after: dict) -> None:
    for name, old in before.items():
        if isinstance(old, dict):
            _assign_resolved(getattr(model, name), old, after[name])
        elif _has_interpolation(old):
            setattr(model, name, after[name])
