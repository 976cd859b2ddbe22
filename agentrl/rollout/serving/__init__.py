"""Serving the policy: one interface (`PolicyServing`) over the embedded engine and vLLM servers.

A policy worker starts one (`start_policy_serving`, from `actor_rollout_ref.rollout.name`), pushes trained
weights through it, checks what it serves, and frees its memory while training; the controller only sees its
URLs. `base.py` holds the interface, `embedded.py` and `vllm.py` the two implementations, and this module the
factory that picks one (so neither implementation imports the other's module through `base`). The inference
engines themselves live in `rollout/engines/`; `trainer.backend` picks where workers run, local or Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.rollout.serving.base import PolicyServing, ProbeResult, probe_server

if TYPE_CHECKING:
    import torch

    from agentrl.config import AgentRLConfig

__all__ = ["PolicyServing", "ProbeResult", "probe_server", "start_policy_serving"]


def start_policy_serving(
    model_path: str,
    tokenizer: Any,
    config: AgentRLConfig,
    *,
    device: str,
    policy: torch.nn.Module | None = None,
    host: str = "127.0.0.1",
) -> PolicyServing:
    """Start the engine `actor_rollout_ref.rollout.name` names, serving the weights at `model_path`.

    `policy`: the trainer's module, which the embedded engine then serves itself instead of loading a copy.
    `host`: the address the server binds, loopback unless the controller runs on another node.
    """
    name = config.actor_rollout_ref.rollout.name
    if name == "embedded":
        from agentrl.rollout.serving.embedded import start_embedded_serving

        return start_embedded_serving(model_path, tokenizer, config, device=device, policy=policy, host=host)
    if host != "127.0.0.1":
        raise ValueError(
            f"actor_rollout_ref.rollout.name={name}: its servers listen on loopback only, so they cannot serve a "
            f"controller on another node (trainer.nnodes > 1); use rollout.name=embedded across nodes"
        )
    if name == "vllm":
        from agentrl.rollout.serving.vllm import start_vllm_serving

        return start_vllm_serving(model_path, config, run_dir=Path(config.trainer.default_local_dir))
    raise ValueError(f"actor_rollout_ref.rollout.name={name!r} is not an engine; use 'embedded' or 'vllm'")
