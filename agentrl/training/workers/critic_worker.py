"""CriticWorker: a value model for GAE, trained with the clipped value loss. A class of its own (no role flag).

Like the policy worker it runs whole in one process, or FSDP2-sharded as one rank of a Ray worker group.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from agentrl.algorithms.losses import compute_value_loss
from agentrl.models import resolve_model_path
from agentrl.models.attention_kernels import skip_cudnn_attention
from agentrl.training.optim import build_lr_scheduler, build_optimizer
from agentrl.training.parallel.fsdp import shard_model
from agentrl.training.parallel.model_state import load_model, save_model
from agentrl.training.update.assembly import TrainBatch
from agentrl.training.update.forward import compute_values
from agentrl.training.update.ppo_update import run_ppo_updates

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_value_model(path: str, dtype: str, device: str) -> torch.nn.Module:
    """The policy's architecture with a one-output token-classification head (freshly initialised)."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, torch_dtype=_DTYPES[dtype])
    return model.to(device)


class CriticWorker:
    """Computes values for a batch and updates the value model on (values, returns)."""

    def __init__(self, config: AgentRLConfig, *, total_steps: int, device: str = "cpu") -> None:
        self.config = config
        critic_cfg = config.critic
        path = resolve_model_path(critic_cfg.model.path or config.actor_rollout_ref.model.path)
        self.device = torch.device(device)
        skip_cudnn_attention(self.device)
        self.sharded = dist.is_initialized()
        offload = critic_cfg.fsdp_config.param_offload
        dtype = config.actor_rollout_ref.model.dtype
        mixed = self.sharded and self.device.type == "cuda" and dtype != "float32"
        master = critic_cfg.fsdp_config.model_dtype if self.sharded else None
        self.model = load_value_model(
            path, master or ("float32" if mixed else dtype), "cpu" if offload else device
        )
        if critic_cfg.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.sharded:
            shard_model(
                self.model,
                compute_dtype=_DTYPES[dtype] if mixed else None,
                offload=offload,
                device_type=self.device.type,
                fsdp_size=critic_cfg.fsdp_config.fsdp_size,
            )
        self.optimizer = build_optimizer(self.model.parameters(), critic_cfg.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, critic_cfg.optim, total_steps)
        self.generator = torch.Generator().manual_seed(config.trainer.seed + 1)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        self.model.eval()
        length = batch.input_ids.shape[1]
        size = self.config.critic.ppo_micro_batch_size_per_gpu
        parts = []
        for rows in torch.split(torch.arange(len(batch)), size):
            values = compute_values(self.model, batch.select(rows)).cpu()
            parts.append(torch.nn.functional.pad(values, (0, length - values.shape[1])))
        return torch.cat(parts) * batch.attention_mask

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        """Clipped value-loss epochs over mini-batches, like the actor's (`critic.ppo_*`)."""
        metrics = run_ppo_updates(
            batch,
            self._value_loss,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            generator=self.generator,
            section=self.config.critic,
            train_batch_size=self.config.data.train_batch_size,
            shuffle=True,
            remove_padding=self.config.actor_rollout_ref.model.use_remove_padding,
            prefix="critic",
        )
        metrics["critic/loss"] = metrics["critic/vf_loss"]
        return metrics

    def _value_loss(self, micro: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config.critic
        values = compute_values(self.model, micro)
        result = compute_value_loss(
            values,
            micro["values"].to(self.device),
            micro["returns"].to(self.device),
            micro.response_mask.to(self.device),
            cliprange_value=cfg.cliprange_value,
            loss_agg_mode=cfg.loss_agg_mode,
        )
        return result.loss, {
            "critic/vf_loss": result.loss.item(),
            "critic/vf_clipfrac": float(result.clipfrac),
        }

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        save_model(self.model, self.optimizer, folder, "critic")
        state = {"scheduler": self.scheduler.state_dict(), "generator": self.generator.get_state()}
        if not self.sharded:
            state["optimizer"] = self.optimizer.state_dict()
        if not self.sharded or dist.get_rank() == 0:
            torch.save(state, folder / "critic_optim.pt")

    def load(self, folder: Path) -> None:
        folder = Path(folder)
        with_optimizer = load_model(self.model, self.optimizer, folder, "critic")
        state = torch.load(folder / "critic_optim.pt", weights_only=True)
        if not with_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "generator" in state:
            self.generator.set_state(state["generator"])
