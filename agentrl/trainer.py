"""AgentTrainer: the user-facing facade. Validates everything, then builds the controller and trains.

    AgentTrainer(flow=Solver(), evaluator=ExactMatch(), config=cfg,
                 train_dataset=train, val_dataset=val).train()

`config` is an `AgentRLConfig`, a list of Hydra overrides (`["trainer.total_training_steps=5"]`) or None for
the defaults. Datasets are lists of rows in the verl format or paths to parquet/jsonl files; None reads
`data.train_files` / `data.val_files`. Bad config or data fail here, before any model loads.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig, ConfigError, load_config, save_resolved_config
from agentrl.data import load_dataset_rows, validate_row
from agentrl.evaluator import Evaluator
from agentrl.flow import AgentFlow

log = logging.getLogger("agentrl")

Dataset = Sequence[dict[str, Any]] | str | Path | Sequence[str] | None


@dataclass
class TrainResult:
    """What a finished run leaves behind."""

    run_dir: Path
    global_step: int
    metrics: dict[str, float] = field(default_factory=dict)
    """The last step's metrics, with the final validation."""
    initial_val_metrics: dict[str, float] = field(default_factory=dict)
    """Validation before the first step (`trainer.val_before_train`)."""
    checkpoint_dir: Path | None = None
    export_dir: Path | None = None

    def summary_lines(self) -> list[str]:
        """What a training script prints at the end: steps and run folder, then held-out accuracy A -> B
        (validation after the warm start, before the first step, and after the last step) when both exist."""
        lines = [f"trained {self.global_step} steps; run folder {self.run_dir}"]
        before = self.initial_val_metrics.get("val/accuracy")
        after = self.metrics.get("val/accuracy")
        if before is not None and after is not None:
            lines.append(f"held-out accuracy {before:.3f} -> {after:.3f}")
        return lines


def resolve_config(config: AgentRLConfig | Sequence[str] | None) -> AgentRLConfig:
    """An AgentRLConfig from an instance, a list of Hydra overrides, or None (the defaults)."""
    if isinstance(config, AgentRLConfig):
        return config
    if config is None:
        return load_config()
    if isinstance(config, str):
        raise TypeError("config must be an AgentRLConfig or a list of overrides such as ['key=value']")
    return load_config(list(config))


def resolve_rows(
    dataset: Dataset, files: str | list[str] | None, name: str, prompt_key: str = "prompt"
) -> list[dict[str, Any]]:
    """Rows from a list of dicts (validated one by one) or from files; errors name the row and field.

    `prompt_key` is `data.prompt_key`: the row field that holds the chat messages.
    """
    if dataset is None:
        return load_dataset_rows(files, prompt_key) if files else []
    if isinstance(dataset, (str, Path)) or (dataset and isinstance(dataset[0], (str, Path))):
        return load_dataset_rows(dataset, prompt_key)
    return [validate_row(row, i, name, prompt_key) for i, row in enumerate(dataset)]


def flow_problem(flow: Any) -> str | None:
    """Why `flow` is not an AgentFlow (saying how to wrap a plain function), or None."""
    if isinstance(flow, AgentFlow):
        return None
    hint = ""
    if isinstance(flow, type) and issubclass(flow, AgentFlow):
        hint = f"; pass an instance, {flow.__name__}(), not the class"
    elif callable(flow):
        hint = "; wrap an `async def fn(task, ctx)` function with @agentrl.agent_flow"
    return f"flow must be an AgentFlow (subclass or @agent_flow function), got {type(flow).__name__}{hint}"


def evaluator_problem(evaluator: Any) -> str | None:
    """Why `evaluator` is not an Evaluator (saying how to wrap a plain function), or None."""
    if isinstance(evaluator, Evaluator):
        return None
    hint = ""
    if isinstance(evaluator, type) and issubclass(evaluator, Evaluator):
        hint = f"; pass an instance, {evaluator.__name__}(), not the class"
    elif callable(evaluator):
        name = getattr(evaluator, "__name__", "fn")
        hint = (
            f"; a plain function needs wrapping: decorate it with @agentrl.evaluator "
            f"(def {name}(task, episode) -> float | bool | EvalOutput) or pass agentrl.evaluator({name})"
        )
    return f"evaluator must be an Evaluator (subclass or @evaluator function), got {type(evaluator).__name__}{hint}"


def environment_problems(config: AgentRLConfig) -> list[str]:
    """Settings this machine cannot run (no CUDA, a model path that names nothing), each naming its key."""
    from agentrl.models.loading import model_path_problem

    problems = []
    if config.trainer.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            problems.append(
                f"trainer.device={config.trainer.device}: this machine has no CUDA device "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                "use trainer.device=auto or trainer.device=cpu"
            )
    model = config.actor_rollout_ref.model
    paths = {
        "actor_rollout_ref.model.path": model.path,
        "actor_rollout_ref.model.tokenizer_path": model.tokenizer_path,
        "critic.model.path": config.critic.model.path if config.algorithm.adv_estimator == "gae" else None,
    }
    problems += [p for key, path in paths.items() if path and (p := model_path_problem(path, key))]
    return problems


def unsupported_settings(config: AgentRLConfig) -> list[str]:
    """Valid settings this version cannot honour: refused up front, never silently ignored."""
    arr = config.actor_rollout_ref
    problems = []
    if config.data.return_multi_modal_inputs and config.algorithm.adv_estimator == "gae":
        problems.append(
            "data.return_multi_modal_inputs=true with algorithm.adv_estimator=gae: the critic reads no pixels; "
            "use grpo, rloo, reinforce or reinforce_plus_plus for vision-language policies"
        )
    if not arr.hybrid_engine:
        problems.append(
            "actor_rollout_ref.hybrid_engine=false: only the colocated actor+rollout is available"
        )
    if config.trainer.backend == "ray":
        pools = config.resource_pool_config
        if pools.ref_gpus is not None and pools.ref_gpus != (pools.actor_rollout_gpus or pools.ref_gpus):
            problems.append(
                f"resource_pool_config.ref_gpus={pools.ref_gpus}: the reference policy lives in the policy "
                f"workers (colocated); leave it null or equal to resource_pool_config.actor_rollout_gpus"
            )
        return problems
    sharded_only = {
        "actor_rollout_ref.actor.fsdp_config.param_offload": arr.actor.fsdp_config.param_offload,
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": arr.actor.fsdp_config.optimizer_offload,
        "actor_rollout_ref.ref.fsdp_config.param_offload": arr.ref.fsdp_config.param_offload,
        "critic.fsdp_config.param_offload": config.critic.fsdp_config.param_offload,
        "critic.fsdp_config.optimizer_offload": config.critic.fsdp_config.optimizer_offload,
    }
    problems += [
        f"{key}=true: offload works on FSDP2-sharded workers; set trainer.backend=ray"
        for key, on in sharded_only.items()
        if on
    ]
    actor_master = arr.actor.fsdp_config.model_dtype
    if actor_master not in (None, "float32", arr.model.dtype):
        problems.append(
            f"actor_rollout_ref.actor.fsdp_config.model_dtype={actor_master}: on the local backend the master "
            f"weights are float32 (computing in actor_rollout_ref.model.dtype={arr.model.dtype} under autocast) "
            f"or actor_rollout_ref.model.dtype itself; FSDP2-sharded workers (trainer.backend=ray) take any dtype"
        )
    if config.critic.fsdp_config.model_dtype is not None:
        problems.append(
            f"critic.fsdp_config.model_dtype={config.critic.fsdp_config.model_dtype}: the critic's master-weight "
            f"dtype is for FSDP2-sharded workers (the local backend trains it in actor_rollout_ref.model.dtype); "
            f"set trainer.backend=ray or leave it null"
        )
    problems += [
        f"resource_pool_config.{name}={value}: placement needs trainer.backend=ray"
        for name, value in config.resource_pool_config.model_dump().items()
        if value is not None
    ]
    return problems


def setup_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


class AgentTrainer:
    """Train `flow`, scored by `evaluator`, with RL as configured."""

    def __init__(
        self,
        flow: AgentFlow,
        evaluator: Evaluator,
        config: AgentRLConfig | Sequence[str] | None = None,
        train_dataset: Dataset = None,
        val_dataset: Dataset = None,
    ) -> None:
        problem = flow_problem(flow) or evaluator_problem(evaluator)
        if problem:
            raise TypeError(problem)
        self.flow = flow
        self.evaluator = evaluator
        self.config = resolve_config(config)
        problems = unsupported_settings(self.config) + environment_problems(self.config)
        if problems:
            raise ConfigError(problems)
        prompt_key = self.config.data.prompt_key
        self.train_rows = resolve_rows(
            train_dataset, self.config.data.train_files, "train_dataset", prompt_key
        )
        self.val_rows = resolve_rows(val_dataset, self.config.data.val_files, "val_dataset", prompt_key)
        if not self.train_rows:
            raise ValueError("no training rows: train_dataset is empty and data.train_files is not set")

    def train(self) -> TrainResult:
        """Run the configured training; servers and workers are stopped on return, error or Ctrl-C.

        Ctrl-C ends the tracked run as KILLED and says where a rerun resumes; an error ends it as
        FAILED. A run that resumes at its last step trains nothing and reports the metrics it logged.
        """
        from agentrl.training.controller import Controller

        setup_logging()
        run_dir = Path(self.config.trainer.default_local_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved_config(self.config, run_dir / "config.yaml")
        controller = Controller(self.config, self.flow, self.evaluator, self.train_rows, self.val_rows)
        status = "FAILED"
        try:
            controller.setup()
            metrics = controller.train()
            checkpoint = controller.latest_checkpoint()
            export_dir = run_dir / "hf_model"
            controller.export(export_dir)
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            print(_interrupted_message(controller, self.config), file=sys.stderr, flush=True)
            raise
        finally:
            controller.close(status=status)
        _plot(run_dir)
        log.info("run folder: %s (checkpoint %s, HF export %s)", run_dir, checkpoint, export_dir)
        history = _logged_steps(run_dir)
        return TrainResult(
            run_dir=run_dir,
            global_step=controller.global_step,
            metrics=metrics or history.get(controller.global_step, {}),
            initial_val_metrics=controller.initial_val_metrics or history.get(0, {}),
            checkpoint_dir=checkpoint,
            export_dir=export_dir,
        )


def _interrupted_message(controller: Any, config: AgentRLConfig) -> str:
    """What a user needs after Ctrl-C: where a rerun of the same command picks up."""
    stopped = f"agentrl: interrupted during step {controller.global_step + 1}."
    if config.trainer.resume_mode == "disable":
        return f"{stopped} trainer.resume_mode=disable: a rerun starts again from step 0."
    latest = controller.latest_checkpoint()
    if latest is None:
        return f"{stopped} No checkpoint was saved yet, so a rerun starts from step 0."
    return (
        f"{stopped} Rerun the same command to resume from the last checkpoint, {latest} "
        "(trainer.resume_mode=auto)."
    )


def _logged_steps(run_dir: Path) -> dict[int, dict[str, float]]:
    """The run's metrics history by step (non-finite values, stored as null, come back as NaN)."""
    from agentrl.tracking import read_metrics_history

    return {
        int(record["step"]): {
            key: float("nan") if value is None else float(value)
            for key, value in record.items()
            if key != "step"
        }
        for record in read_metrics_history(run_dir)
    }


def _plot(run_dir: Path) -> None:
    from agentrl.runs.plotting import plot_training_curves
    from agentrl.tracking import read_metrics_history

    history = read_metrics_history(run_dir)
    if history:
        plot_training_curves(history, run_dir / "training_curves.png")
