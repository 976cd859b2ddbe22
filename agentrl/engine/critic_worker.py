"""CriticWorker: a value model for GAE, trained with the clipped value loss. A class of its own (no role flag)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agentrl.algorithms.losses import compute_value_loss
from agentrl.engine.assembly import TrainBatch
from agentrl.engine.forward import compute_values
from agentrl.engine.optim import build_lr_scheduler, build_optimizer
from agentrl.engine.packing import split_micro_batches, split_mini_batches
from agentrl.models import resolve_model_path

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_value_model(path: str, dtype: str, device: str) -> torch.nn.Module:
    """The policy's architecture with a one-output token-classification head (freshly initialised)."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, torch_dtype=_DTYPES[dtype])
    return model.to(device)


class CriticWorker:
    """Computes values for a batch and updates the value model on (values, returns)."""

    def __init__(self, config: Any, *, total_steps: int, device: str = "cpu") -> None:
        self.config = config
        critic_cfg = config.critic
        path = resolve_model_path(critic_cfg.model.path or config.actor_rollout_ref.model.path)
        self.device = torch.device(device)
        self.model = load_value_model(path, config.actor_rollout_ref.model.dtype, device)
        if critic_cfg.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
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
        cfg = self.config.critic
        self.model.train()
        sums: dict[str, float] = {}
        count = 0
        num_minis = max(1, self.config.data.train_batch_size // cfg.ppo_mini_batch_size)
        for _ in range(cfg.ppo_epochs):
            for rows in split_mini_batches(len(batch), num_minis, self.generator, shuffle=True):
                self.optimizer.zero_grad(set_to_none=True)
                for micro in split_micro_batches(
                    batch,
                    rows,
                    micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
                    use_dynamic_bsz=cfg.use_dynamic_bsz,
                    max_token_len=cfg.ppo_max_token_len_per_gpu,
                    remove_padding=self.config.actor_rollout_ref.model.use_remove_padding,
                ):
                    mask = micro.response_mask.to(self.device)
                    values = compute_values(self.model, micro)
                    result = compute_value_loss(
                        values,
                        micro["values"].to(self.device),
                        micro["returns"].to(self.device),
                        mask,
                        cliprange_value=cfg.cliprange_value,
                        loss_agg_mode=cfg.loss_agg_mode,
                    )
                    (result.loss * len(micro) / len(rows)).backward()
                    sums["critic/vf_loss"] = sums.get("critic/vf_loss", 0.0) + result.loss.item()
                    sums["critic/vf_clipfrac"] = sums.get("critic/vf_clipfrac", 0.0) + float(result.clipfrac)
                    count += 1
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                sums["critic/grad_norm"] = sums.get("critic/grad_norm", 0.0) + float(grad_norm)
        self.scheduler.step()
        metrics = {key: value / max(count, 1) for key, value in sums.items()}
        metrics["critic/loss"] = metrics.get("critic/vf_loss", 0.0)
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        self.model.save_pretrained(folder / "critic")
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
            folder / "critic_optim.pt",
        )

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        state_dict = load_file(Path(folder) / "critic" / "model.safetensors")
        self.model.load_state_dict(state_dict, strict=False)
        state = torch.load(Path(folder) / "critic_optim.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
