"""PolicyWorker: the actor, its optional reference, and the colocated rollout engine on one device.

The hybrid engine: the worker trains the actor and serves the same policy through `rollout/serving` (the
embedded engine or vLLM servers, `actor_rollout_ref.rollout.name`), syncing weights between phases and
checking that the served weights are the ones it trained (`agentrl.training.parallel.weight_sync`).

The same class runs alone (the local backend: one process, whole modules) and as one rank of a Ray worker
group, where a process group is already up when it is built: then actor and reference are sharded with FSDP2
(`agentrl.training.parallel.fsdp`), each rank trains on its share of the batch and serves the policy from its own
engine (data-parallel rollout), and weights stream from the shards into that engine tensor by tensor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from agentrl.algorithms.kl import compute_kl_penalty
from agentrl.algorithms.losses import aggregate_loss, compute_policy_loss
from agentrl.algorithms.rollout_correction import behaviour_weights
from agentrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from agentrl.models.attention_kernels import skip_cudnn_attention
from agentrl.models.compile_cache import use_compile_cache
from agentrl.models.vision import apply_vision_tower_setting
from agentrl.training.flops import device_peak_flops, mfu
from agentrl.training.lora import (
    adapters_disabled,
    adapters_in_base_dtype,
    apply_lora,
    is_lora_model,
    low_precision_base_dtype,
)
from agentrl.training.optim import build_lr_scheduler, build_optimizer
from agentrl.training.parallel.distributed import all_reduce_sum, world_size
from agentrl.training.parallel.fsdp import compute_device, shard_model
from agentrl.training.parallel.model_state import (
    load_frozen,
    load_model,
    save_frozen,
    save_full_weights,
    save_model,
)
from agentrl.training.update.assembly import TrainBatch
from agentrl.training.update.forward import compute_log_probs
from agentrl.training.update.ppo_update import (
    BEHAVIOUR_WEIGHTS,
    MiniBatchStep,
    finish_update,
    run_ppo_updates,
    split_micros,
)

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Optimizer offload: Adam moments live on the CPU between steps and come to the device for the step."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def _warn_if_steps_round_away(model: torch.nn.Module, lr: float, dtype_name: str) -> None:
    """Say loudly when whole low-precision weights will drop most optimizer steps: an AdamW step of about `lr`
    is lost wherever it is under half the dtype's spacing (bfloat16 keeps 8 significant bits, so weights above
    ~256 x lr in magnitude; float16 11 bits: ~2048 x lr), and the run goes on with most of its updates lost."""
    bits = {torch.bfloat16: 8, torch.float16: 11}.get(next(model.parameters()).dtype)
    if bits is None or lr <= 0:
        return
    threshold = lr * 2**bits
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    lost = sum(int((p.abs() > threshold).sum()) for p in params)
    if lost > total / 10:
        log.warning(
            "actor_rollout_ref.model.dtype=%s trains %s weights on the local backend: AdamW steps of "
            "actor.optim.lr=%g round away for %.0f%% of this model's weights (those above %.1e in magnitude); "
            "actor_rollout_ref.actor.fsdp_config.model_dtype=float32 keeps float32 master weights and computes "
            "in %s (mixed precision)",
            dtype_name,
            dtype_name,
            lr,
            100 * lost / total,
            threshold,
            dtype_name,
        )


def shares_device(config: AgentRLConfig) -> bool:
    """Whether another process trains on this worker's device: the critic's workers on the Ray backend take
    half of each policy device (`ray_cluster`); on the local backend the critic is in this process."""
    return config.trainer.backend == "ray" and config.algorithm.adv_estimator == "gae"


class PolicyWorker:
    """Owns the actor model, optimizer and schedule, the reference policy, and the rollout server."""

    def __init__(self, config: AgentRLConfig, *, total_steps: int, device: str = "cpu") -> None:
        arr = config.actor_rollout_ref
        self.config = config
        self.device = torch.device(device)
        skip_cudnn_attention(self.device)
        self.sharded = dist.is_initialized()
        self.model_path = resolve_model_path(arr.model.path)
        self.tokenizer = load_tokenizer(arr.model.tokenizer_path or self.model_path)
        self.actor = self._load_policy(trainable=True, offload=arr.actor.fsdp_config.param_offload)
        self.autocast_dtype = self._autocast_dtype()
        self.lora_base_dtype = low_precision_base_dtype(self.actor)
        if not self.sharded and not is_lora_model(self.actor):
            _warn_if_steps_round_away(self.actor, arr.actor.optim.lr, arr.model.dtype)
        self.needs_ref = arr.actor.use_kl_loss or config.algorithm.use_kl_in_reward
        self.ref = None
        self.ref_warm_started = False  # then checkpoints carry the reference: it no longer equals model.path
        if self.needs_ref and not is_lora_model(self.actor):
            # Loaded from its path (never a copy of a sharded module); a warm start copies the actor in.
            self.ref = self._load_policy(trainable=False, offload=arr.ref.fsdp_config.param_offload)
        self.optimizer = build_optimizer(self.actor.parameters(), arr.actor.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, arr.actor.optim, total_steps)
        self.optimizer_offload = (
            self.sharded
            and arr.actor.fsdp_config.optimizer_offload
            and not arr.actor.fsdp_config.param_offload
        )
        self.generator = torch.Generator().manual_seed(config.trainer.seed)
        self._streamed: MiniBatchStep | None = None
        """The streamed update in progress (`accumulate_actor`), if any."""
        self.rollout = None
        from agentrl.rollout.serving.embedded import compiles_decode

        if self.device.type == "cuda" and (arr.actor.use_torch_compile or compiles_decode(config)):
            # before anything compiles: Inductor's caches in this model's folder (kept across runs)
            use_compile_cache(self.actor.config, _DTYPES[arr.model.dtype], self.device)

    def _load_policy(self, *, trainable: bool, offload: bool) -> torch.nn.Module:
        """The policy from `model.path`: whole on this device, or FSDP2-sharded over the worker group.

        Sharded on a GPU with a low-precision `model.dtype`, master weights are float32 (or the actor's
        `fsdp_config.model_dtype`) and compute runs in that dtype (FSDP mixed precision); whole, the model trains in
        `model.dtype` itself, or keeps float32 master weights with `fsdp_config.model_dtype=float32` and computes
        in `model.dtype` under autocast (`_autocast_dtype`).
        """
        arr = self.config.actor_rollout_ref
        compute_dtype = _DTYPES[arr.model.dtype]
        mixed = self.sharded and self.device.type == "cuda" and compute_dtype != torch.float32
        master = arr.actor.fsdp_config.model_dtype if trainable else None
        load_device = "cpu" if offload else str(self.device)
        model = load_causal_lm(
            self.model_path,
            dtype=master or ("float32" if mixed else arr.model.dtype),
            device=load_device,
        )
        if trainable:
            apply_vision_tower_setting(model, arr.model)
        if trainable and arr.model.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        if trainable and arr.model.lora_rank > 0:
            model = apply_lora(
                model,
                rank=arr.model.lora_rank,
                alpha=arr.model.lora_alpha,
                target_modules=arr.model.target_modules,
                keep_merged=not self.sharded,
            )
        if not trainable:
            model.eval().requires_grad_(False)
        if self.sharded:
            shard_model(
                model,
                compute_dtype=compute_dtype if mixed else None,
                offload=offload,
                device_type=self.device.type,
                fsdp_size=arr.actor.fsdp_config.fsdp_size,  # the reference shares the actor's mesh
            )
        return model

    def _autocast_dtype(self) -> torch.dtype | None:
        """The dtype a whole actor with wider master weights computes in (autocast), as TRL's `bf16=True` on a
        float32 model and FSDP's mixed precision do: the update keeps every small step that bf16 weights would
        round away, at the cost of float32 weights, gradients and moments. None where the parameters compute in
        their own dtype (FSDP2 casts sharded ones itself)."""
        compute_dtype = _DTYPES[self.config.actor_rollout_ref.model.dtype]
        param = next(self.actor.parameters())
        if self.sharded or param.dtype == compute_dtype or param.dtype != torch.float32:
            return None
        return compute_dtype

    def _in_compute_dtype(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def pid(self) -> int:
        """The process holding this worker (to find a rank's process from the controller)."""
        return os.getpid()

    def vocab_size(self) -> int:
        """Rows of the output layer: the number of tokens a uniform policy spreads over."""
        head = getattr(self.actor, "get_output_embeddings", lambda: None)()
        return int(head.weight.shape[0]) if head is not None else len(self.tokenizer)

    def tokenizer_pad_id(self) -> int:
        return int(
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )

    def warm_start(self, sft: Any, rows: list[dict]) -> dict[str, float]:
        """Supervised warm start of the actor; the reference policy becomes the warm-started model."""
        from agentrl.training.sft import run_sft

        metrics = run_sft(
            self.actor,
            self.tokenizer,
            rows,
            sft,
            seed=self.config.trainer.seed,
            pad_token_id=self.tokenizer_pad_id(),
            prompt_key=self.config.data.prompt_key,
            forward_context=self._in_compute_dtype,
        )
        if self.ref is not None:
            with torch.no_grad():  # same architecture and sharding: copy shard by shard
                for ref_param, param in zip(self.ref.parameters(), self.actor.parameters(), strict=True):
                    ref_param.copy_(param)
            self.ref_warm_started = True
        return metrics

    # ---- rollout side -------------------------------------------------------------------------------
    def start_rollout(self) -> list[str]:
        """Start the rollout engine `rollout.name` names, sync the actor's weights to it; returns its URLs."""
        from agentrl.rollout.serving import start_policy_serving

        self.rollout = start_policy_serving(
            self.model_path,
            self.tokenizer,
            self.config,
            device=str(self.device),
            policy=self._shared_policy(),
            host=_serving_host(self.config.trainer.nnodes),
        )
        self.sync_weights()
        return self.rollout.urls

    def _engine_can_share_actor(self) -> bool:
        """Whether the embedded engine can serve the actor's own weights (no second copy, nothing to copy after
        an update): not while rollouts run ahead of training (asynchronous), and a whole module (not FSDP
        shards, not offloaded) whose weights are in the served dtype on this device."""
        arr = self.config.actor_rollout_ref
        param = next(p for n, p in self.actor.named_parameters() if "lora_" not in n)
        run_ahead = self.config.async_training
        return (
            not (run_ahead.enable and run_ahead.staleness_threshold > 0)  # it serves while the actor trains
            and arr.rollout.name == "embedded"
            and not self.sharded
            and param.dtype == _DTYPES[arr.model.dtype]
            and param.device.type == self.device.type
        )

    def _shared_policy(self) -> torch.nn.Module | None:
        """The module the embedded engine serves in place of a copy of its own: the actor itself, or for LoRA a
        plain model over the actor's base weights and kept merged weights (`shared_serving_model`); None when
        the engine must hold its own copy."""
        if not self._engine_can_share_actor():
            return None
        if not is_lora_model(self.actor):
            return self.actor
        from agentrl.training.parallel.served_weights import shared_serving_model

        return shared_serving_model(self.actor, _DTYPES[self.config.actor_rollout_ref.model.dtype])

    def sync_weights(self) -> dict[str, float]:
        """Push the actor's weights to the engine and verify it serves them (fingerprint or probe)."""
        from agentrl.training.parallel.weight_sync import sync_rollout_weights

        arr = self.config.actor_rollout_ref
        served_dtype = arr.model.dtype
        if arr.rollout.name == "vllm":  # the dtype the servers run in (`auto` resolved at launch)
            served_dtype = getattr(self.rollout, "dtype", None) or arr.rollout.vllm.dtype
        return sync_rollout_weights(
            self.actor,
            self.rollout,
            self.tokenizer,
            dtypes=(arr.model.dtype, served_dtype),
            served_dtype=_DTYPES.get(served_dtype),
        )

    def engine_counters(self) -> dict[str, float]:
        """The embedded engine's cumulative prefill, decode and host seconds, its prefill and decode step counts,
        and its prompt, prefix-cache hit, prefilled and generated tokens (`EmbeddedEngine.stats`), the parts of
        long prompts prefilled between decode steps (chunked prefill), the prefill
        forwards and tokens of each path (extend graphs, packed) beside their seconds; {} for vLLM,
        whose servers keep their own metrics."""
        engine = getattr(self.rollout, "engine", None)
        if engine is None:
            return {}
        stats = engine.stats()
        counters = {k[len("busy_") :]: v for k, v in stats.items() if k.startswith("busy_")}
        counted = (
            "prefills",
            "prefill_parts",
            "prompt_tokens",
            "prefix_cache_hits",
            "prefill_tokens",
            "tokens_generated",
        )
        counters.update(
            {
                k: v
                for k, v in stats.items()
                if k in counted or k.startswith(("decode_steps_", "prefill_extend_", "prefill_packed_"))
            }
        )
        return counters

    def sleep_rollout(self) -> None:
        """Before the update: the sync after it pushes every weight, so a copy the engine owns (LoRA's merged
        weights) is dropped rather than parked on the host and brought back."""
        if self.rollout is not None and self.config.actor_rollout_ref.rollout.free_cache_engine:
            self.rollout.sleep(discard_weights=True, keep_allocator_cache=not shares_device(self.config))

    def wake_rollout(self) -> None:
        if self.rollout is not None and self.config.actor_rollout_ref.rollout.free_cache_engine:
            self.rollout.wake_up()

    # ---- training side ------------------------------------------------------------------------------
    def _log_probs(self, model: torch.nn.Module, batch: TrainBatch, **kwargs) -> tuple[torch.Tensor, ...]:
        """Log-probs under softmax(logits / rollout.temperature): the distribution the episodes were sampled
        from (old, reference and current policy alike, as verl's actor divides by the rollout temperature)."""
        compile_head = self.config.actor_rollout_ref.actor.use_torch_compile and self.device.type == "cuda"
        temperature = self.config.actor_rollout_ref.rollout.temperature
        lora_dtype = self.lora_base_dtype if model is self.actor else None  # the reference is never LoRA
        with adapters_in_base_dtype(model, lora_dtype), self._in_compute_dtype():
            return compute_log_probs(
                model, batch, compile_head=compile_head, temperature=temperature, **kwargs
            )

    @torch.no_grad()
    def compute_log_prob(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Old log-probs of the current actor, for the PPO ratio (entropy is measured in the update)."""
        self.actor.eval()
        return {
            "old_log_probs": self._map_micro_batches(
                batch,
                lambda mb: self._log_probs(self.actor, mb),
                self.config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu,
            )[0]
        }

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs under the reference policy (the initial weights; for LoRA, adapters off)."""
        size = self.config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
        if self.ref is not None:
            return self._map_micro_batches(batch, lambda mb: self._log_probs(self.ref, mb), size)[0]
        with adapters_disabled(self.actor):
            return self._map_micro_batches(batch, lambda mb: self._log_probs(self.actor, mb), size)[0]

    def update_actor(self, batch: TrainBatch) -> dict[str, float]:
        """PPO epochs over mini-batches; one optimizer step per mini-batch; one LR step per call."""
        start = time.perf_counter()
        metrics = run_ppo_updates(
            batch,
            self._actor_loss,
            model=self.actor,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            generator=self.generator,
            section=self.config.actor_rollout_ref.actor,
            train_batch_size=self.config.data.train_batch_size,
            shuffle=self.config.actor_rollout_ref.actor.shuffle,
            remove_padding=self.config.actor_rollout_ref.model.use_remove_padding,
            prefix="actor",
            on_optimizer_step=self._optimizer_state_to_device if self.optimizer_offload else None,
        )
        if self.optimizer_offload:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
        metrics.update(self._mfu(batch, time.perf_counter() - start))
        if self.device.type == "cuda":  # peak since the worker started, on this rank's device (verl's names)
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        return metrics

    def accumulate_actor(self, chunk: TrainBatch) -> None:
        """A streamed update (`async_training.streaming_update`): the gradients of `chunk`, rows of groups that have
        finished while the rest of the step's batch is collected, added to those of the chunks before; the optimizer
        step waits for `finish_actor_update`."""
        cfg = self.config.actor_rollout_ref
        if self._streamed is None:
            self.actor.train()
            self.optimizer.zero_grad(set_to_none=True)
            self._streamed = MiniBatchStep(self._actor_loss, cfg.actor.loss_agg_mode)
        rows = torch.arange(len(chunk))
        self._streamed.add(split_micros(chunk, rows, cfg.actor, cfg.model.use_remove_padding))

    def finish_actor_update(self) -> dict[str, float]:
        """The streamed update's one optimizer step over every chunk accumulated, and its metrics (those of
        `update_actor` for one epoch of one mini-batch)."""
        if self._streamed is None:
            raise RuntimeError("finish_actor_update before any accumulate_actor: nothing to update on")
        step, self._streamed = self._streamed, None
        on_step = self._optimizer_state_to_device if self.optimizer_offload else None
        norm = step.finish(
            self.actor, self.optimizer, self.config.actor_rollout_ref.actor.grad_clip, "actor", on_step
        )
        metrics = finish_update(
            [(step, norm)], optimizer=self.optimizer, scheduler=self.scheduler, prefix="actor"
        )
        if self.optimizer_offload:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
        return metrics

    def _mfu(self, batch: TrainBatch, seconds: float) -> dict[str, float]:
        """`perf/mfu/actor`: model FLOPs of this update over the peak of every rank's device (none on CPU or an
        unknown GPU). The update ends in host reads of its stats, so `seconds` covers the device work."""
        dtype = _DTYPES[self.config.actor_rollout_ref.model.dtype]
        share = mfu(
            self.actor.config,
            batch.attention_mask.sum(dim=1).tolist() * self.config.actor_rollout_ref.actor.ppo_epochs,
            seconds,
            device_peak_flops(self.device, dtype),
        )
        if share is None:
            return {}
        return {"perf/mfu/actor": all_reduce_sum(share) / world_size()}

    def _optimizer_state_to_device(self) -> None:
        _move_optimizer_state(self.optimizer, self.device)

    def _actor_loss(self, micro: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config.actor_rollout_ref.actor
        mask = micro.response_mask.to(self.device)
        log_probs, entropy = self._log_probs(
            self.actor, micro, with_entropy=True, entropy_grad=cfg.entropy_coeff != 0
        )
        if log_probs.device.type != self.device.type:
            raise RuntimeError(
                f"the actor's forward ran on {log_probs.device}, the worker computes its loss on {self.device}: "
                f"parameter {next(self.actor.parameters()).__class__.__name__} on "
                f"{next(self.actor.parameters()).device}, compute device {compute_device(self.actor)}"
            )
        # On-policy (one epoch, one mini-batch) the old policy is the current one: no separate forward. In bypass
        # mode it is the engine's (the ratio pi_theta / pi_rollout is clipped).
        bypass = self.config.algorithm.rollout_correction.bypass_mode
        old = micro.rollout_log_probs if bypass else micro.tensors.get("old_log_probs")
        weights = micro.tensors.get(BEHAVIOUR_WEIGHTS)
        if weights is None and self.config.algorithm.rollout_correction.tis_mode is not None:
            raise RuntimeError(
                "algorithm.rollout_correction.tis_mode is set but the batch has no behaviour_weights"
            )
        result = compute_policy_loss(
            log_probs,
            log_probs.detach() if old is None else old.to(self.device),
            micro["advantages"].to(self.device),
            mask,
            clip_ratio_low=cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio,
            clip_ratio_high=cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode,
            behaviour_weights=None if weights is None else weights.to(self.device),
        )
        entropy_loss = aggregate_loss(entropy, mask, cfg.loss_agg_mode)
        loss = result.loss - cfg.entropy_coeff * entropy_loss
        stats = {
            "actor/pg_loss": result.loss.item(),
            "actor/pg_clipfrac": float(result.clipfrac),
            "actor/pg_clipfrac_lower": float(result.clipfrac_lower),
            "actor/ppo_kl": float(result.ppo_kl),
            "actor/ppo_ratio_mean": float(result.ratio_mean),
            "actor/entropy": entropy_loss.item(),
        }
        if (
            old is None or bypass
        ):  # the gap the skipped old-log-prob pass would have measured (engine vs trainer)
            stats.update(
                _rollout_logprob_gap(log_probs.detach(), micro.rollout_log_probs.to(self.device), mask)
            )
            _, mismatch = behaviour_weights(log_probs, micro.rollout_log_probs.to(self.device), mask, None)
            stats.update({key: float(value) for key, value in mismatch.items()})
        if cfg.use_kl_loss:
            kl = compute_kl_penalty(log_probs, micro["ref_log_probs"].to(self.device), cfg.kl_loss_type)
            kl_loss = aggregate_loss(kl, mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = kl_loss.item()
        stats["actor/loss"] = loss.item()
        return loss, stats

    @staticmethod
    def _map_micro_batches(batch: TrainBatch, fn, size: int) -> tuple[torch.Tensor, ...]:
        """Run `fn` over micro-batches of `size` rows of `batch` and stitch the (B, L) outputs back together."""
        length = batch.input_ids.shape[1]
        parts: list[tuple] = []
        for rows in torch.split(torch.arange(len(batch)), size):
            outs = fn(batch.select(rows))
            parts.append(
                tuple(
                    None if o is None else torch.nn.functional.pad(o.cpu(), (0, length - o.shape[1]))
                    for o in outs
                )
            )
        return tuple(
            None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))
        )

    # ---- checkpoints --------------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        """Model (HF format, or DCP shards under FSDP2) plus optimizer, scheduler and sampler state."""
        folder = Path(folder)
        save_model(self.actor, self.optimizer, folder, "actor")
        rank = dist.get_rank() if self.sharded else 0
        if rank == 0:
            self.tokenizer.save_pretrained(folder / "actor")
        state = {"scheduler": self.scheduler.state_dict(), "generator": self.generator.get_state()}
        if not self.sharded:
            state["optimizer"] = self.optimizer.state_dict()
        if rank == 0:
            torch.save(state, folder / "actor_optim.pt")
        if self.ref is not None and self.ref_warm_started:
            save_frozen(self.ref, folder / self._ref_folder_name())

    def load(self, folder: Path) -> None:
        folder = Path(folder)
        with_optimizer = load_model(self.actor, self.optimizer, folder, "actor")
        state = torch.load(folder / "actor_optim.pt", weights_only=True)
        if not with_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        ref_folder = folder / self._ref_folder_name()
        if self.ref is not None and ref_folder.exists():  # the warm-started reference, not model.path's
            load_frozen(self.ref, ref_folder)
            self.ref_warm_started = True

    def _ref_folder_name(self) -> str:
        return "ref_dcp" if self.sharded else "ref"

    def export(self, folder: Path) -> None:
        if self.sharded:
            save_full_weights(self.actor, self.tokenizer, folder)
            return
        from agentrl.checkpoint import export_hf_model

        export_hf_model(self.actor, self.tokenizer, folder)

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.stop()
            self.rollout = None


def _serving_host(nnodes: int) -> str:
    """Where the rollout server listens: loopback on one node; across nodes, this node's address as Ray knows
    it, since the controller's gateway may run on another node (nnodes > 1 implies the Ray backend)."""
    if nnodes == 1:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def _rollout_logprob_gap(
    log_probs: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """|trainer - engine| log-prob gap on response tokens: the engine served stale or wrong weights if large."""
    gap = (log_probs - rollout).abs()[mask.bool()]
    if gap.numel() == 0:  # a zero-weight padding micro-batch
        return {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0}
    return {"rollout/logprob_diff_mean": gap.mean().item(), "rollout/logprob_diff_max": gap.max().item()}
