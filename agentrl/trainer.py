"""AgentTrainer: the user-facing facade. Validates everything, then builds the controller and trains.

    AgentTrainer(flow=Solver(), evaluator=ExactMatch(), config=cfg,
                 train_dataset=train, val_dataset=val).train()

`config` is an `AgentRLConfig`, a list of Hydra overrides (`["trainer.total_training_steps=5"]`) or None for
the defaults. Datasets are lists of rows in the verl format or paths to parquet/jsonl files; None reads
`data.train_files` / `data.val_files`. Bad config or data fail here, before any model loads.
"""

from __future__ import annotations

import logging
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


def resolve_config(config: AgentRLConfig | Sequence[str] | None) -> AgentRLConfig:
    """An AgentRLConfig from an instance, a list of Hydra overrides, or None (the defaults)."""
    if isinstance(config, AgentRLConfig):
        return config
    if config is None:
        return load_config()
    if isinstance(config, str):
        raise TypeError("config must be an AgentRLConfig or a list of overrides such as ['key=value']")
    return load_config(list(config))


def resolve_rows(dataset: Dataset, files: str | list[str] | None, name: str) -> list[dict[str, Any]]:
    """Rows from a list of dicts (validated one by one) or from files; errors name the row and field."""
    if dataset is None:
        return load_dataset_rows(files) if files else []
    if isinstance(dataset, (str, Path)) or (dataset and isinstance(dataset[0], (str, Path))):
        return load_dataset_rows(dataset)
    return [validate_row(row, i, name) for i, row in enumerate(dataset)]


def unsupported_settings(config: AgentRLConfig) -> list[str]:
    """Valid settings this version cannot honour yet: refused up front, never silently ignored."""
    arr, later = config.actor_rollout_ref, "needs the FSDP/Ray worker group, not available in this version"
    problems = []
    if config.trainer.backend != "local":
        problems.append(
            f"trainer.backend={config.trainer.backend}: only the local worker group is available in "
            "this version; use trainer.backend=local (one device)"
        )
    if config.data.return_multi_modal_inputs:
        problems.append(
            "data.return_multi_modal_inputs=true: vision-language training is not available in this "
            "version (the tiny:qwen2-vl preset and its processor are); leave it false"
        )
    if not arr.hybrid_engine:
        problems.append(
            "actor_rollout_ref.hybrid_engine=false: only the colocated actor+rollout is available"
        )
    offloads = {
        "actor_rollout_ref.actor.fsdp_config.param_offload": arr.actor.fsdp_config.param_offload,
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": arr.actor.fsdp_config.optimizer_offload,
        "actor_rollout_ref.ref.fsdp_config.param_offload": arr.ref.fsdp_config.param_offload,
        "critic.fsdp_config.param_offload": config.critic.fsdp_config.param_offload,
        "critic.fsdp_config.optimizer_offload": config.critic.fsdp_config.optimizer_offload,
    }
    problems += [f"{key}=true: offload {later}" for key, on in offloads.items() if on]
    pools = config.resource_pool_config
    problems += [
        f"resource_pool_config.{name}={value}: placement {later}"
        for name, value in pools.model_dump().items()
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
        if not isinstance(flow, AgentFlow):
            raise TypeError(
                f"flow must be an AgentFlow (subclass or @agent_flow function), got {type(flow).__name__}"
            )
        if not isinstance(evaluator, Evaluator):
            raise TypeError(
                f"evaluator must be an Evaluator (subclass or @evaluator function), "
                f"got {type(evaluator).__name__}"
            )
        self.flow = flow
        self.evaluator = evaluator
        self.config = resolve_config(config)
        problems = unsupported_settings(self.config)
        if problems:
            raise ConfigError(problems)
        self.train_rows = resolve_rows(train_dataset, self.config.data.train_files, "train_dataset")
        self.val_rows = resolve_rows(val_dataset, self.config.data.val_files, "val_dataset")
        if not self.train_rows:
            raise ValueError("no training rows: pass train_dataset or set data.train_files")

    def train(self) -> TrainResult:
        """Run the configured training; servers and workers are stopped on return, error or Ctrl-C."""
        from agentrl.engine.controller import Controller

        setup_logging()
        run_dir = Path(self.config.trainer.default_local_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved_config(self.config, run_dir / "config.yaml")
        controller = Controller(self.config, self.flow, self.evaluator, self.train_rows, self.val_rows)
        failed = True
        try:
            controller.setup()
            metrics = controller.train()
            checkpoint = controller.latest_checkpoint()
            export_dir = run_dir / "hf_model"
            controller.export(export_dir)
            failed = False
        finally:
            controller.close(failed=failed)
        _plot(run_dir)
        log.info("run folder: %s (checkpoint %s, HF export %s)", run_dir, checkpoint, export_dir)
        return TrainResult(
            run_dir=run_dir,
            global_step=controller.global_step,
            metrics=metrics,
            initial_val_metrics=controller.initial_val_metrics,
            checkpoint_dir=checkpoint,
            export_dir=export_dir,
        )


def _plot(run_dir: Path) -> None:
    from agentrl.plotting import plot_training_curves
    from agentrl.tracking import read_metrics_history

    history = read_metrics_history(run_dir)
    if history:
        plot_training_curves(history, run_dir / "training_curves.png")
