"""Training with vLLM: the policy worker's rollout as `rollout.num_servers` vLLM OpenAI servers.

The vLLM side of `agentrl.rollout.serving.PolicyServing`. Servers are launched from the run's config
(`actor_rollout_ref.rollout.*`, `rollout.vllm.*`) with logs under `<run dir>/vllm_logs`. A weight push writes
the full state dict to `<run dir>/vllm_weights/v<N>` and reloads it on every server through the pool's
update route (`POST /collective_rpc reload_weights`, then `/reset_prefix_cache`); the push succeeds only
when every server took it, and earlier weight folders are then deleted (the last one on `stop`). vLLM reports neither a weight
fingerprint nor a policy version, so `served_fingerprint` is None and the worker verifies with `probe`.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.models import resolve_model_path
from agentrl.rollout.engines.vllm import VLLMServerGroup, launch_vllm_servers, save_weights_for_vllm
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.serving.base import ProbeResult, probe_server
from agentrl.rollout.serving.embedded import served_model_name

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig

_ADMIN_TIMEOUT = 300.0


class VLLMServing:
    """vLLM servers plus the admin pool that broadcasts weight reloads and sleep/wake to all of them."""

    def __init__(self, servers: VLLMServerGroup, *, model_name: str, weights_dir: Path) -> None:
        self.servers = servers
        self.model_name = model_name
        self.dtype = getattr(servers, "dtype", None)  # rollout.vllm.dtype resolved (auto: bf16 or fp32)
        self.weights_dir = Path(weights_dir)
        self.policy_version = 0
        self._admin = RolloutPool(
            servers, model_name=model_name, engine="vllm", request_timeout=_ADMIN_TIMEOUT
        )

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def push_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write the weights as `v<N>`, reload them on every server, then delete older folders."""
        version = self.policy_version + 1
        folder = save_weights_for_vllm(dict(weights), self.weights_dir / f"v{version}")
        self._run(self._admin.update_weights(str(folder), version=version))
        behind = [f"{s.url}: {s.last_error}" for s in self._admin.servers if s.policy_version != version]
        if behind:
            raise RuntimeError(f"weight sync failed: vLLM did not reload {folder} on " + "; ".join(behind))
        self.policy_version = version
        remove_old_weight_folders(self.weights_dir, keep=folder.name)
        return version

    def served_fingerprint(self) -> None:
        return None  # vLLM has no route that reports its weights; the worker probes instead

    def probe(self, prompt_ids: Sequence[int], max_tokens: int) -> list[ProbeResult]:
        return [probe_server(url, self.model_name, prompt_ids, max_tokens) for url in self.urls]

    def sleep(self, discard_weights: bool = False, keep_allocator_cache: bool = False) -> None:
        """POST /sleep at the server's own level; `discard_weights` and `keep_allocator_cache` change nothing
        for vLLM."""
        self._run(self._admin.sleep())
        self._raise_if_unhealthy("sleep")

    def wake_up(self) -> None:
        self._run(self._admin.wake_up())
        self._raise_if_unhealthy("wake_up")

    def stop(self) -> None:
        """Stop the servers and delete the weight folders (the run's checkpoints hold the weights)."""
        self.servers.stop()
        shutil.rmtree(self.weights_dir, ignore_errors=True)

    def _raise_if_unhealthy(self, action: str) -> None:
        failed = [f"{s.url}: {s.last_error}" for s in self._admin.servers if not s.healthy]
        if failed:
            raise RuntimeError(f"vLLM {action} failed on " + "; ".join(failed))

    def _run(self, coro: Any) -> Any:
        """Run one admin coroutine on a fresh loop and close that loop's HTTP client."""

        async def run() -> Any:
            try:
                return await coro
            finally:
                await self._admin.aclose()

        return asyncio.run(run())


def remove_old_weight_folders(weights_dir: Path, *, keep: str) -> list[Path]:
    """Delete every `v<N>` folder under `weights_dir` except `keep`; returns what was deleted."""
    removed = []
    for path in sorted(Path(weights_dir).glob("v*")):
        if path.is_dir() and path.name != keep and path.name[1:].isdigit():
            shutil.rmtree(path)
            removed.append(path)
    return removed


def build_vllm_extra_args(config: AgentRLConfig) -> list[str]:
    """`rollout.vllm.extra_args`, plus the flags the model config implies (tokenizer, remote code)."""
    model = config.actor_rollout_ref.model
    extra = list(config.actor_rollout_ref.rollout.vllm.extra_args)
    if model.tokenizer_path:
        extra += ["--tokenizer", resolve_model_path(model.tokenizer_path)]
    if model.trust_remote_code:
        extra.append("--trust-remote-code")
    rollout = config.actor_rollout_ref.rollout
    if rollout.tensor_model_parallel_size > 1:
        extra += ["--tensor-parallel-size", str(rollout.tensor_model_parallel_size)]
    if torch.cuda.is_available():  # the CPU backend sizes its cache from VLLM_CPU_KVCACHE_SPACE instead
        extra += ["--gpu-memory-utilization", str(rollout.gpu_memory_utilization)]
    return extra


def start_vllm_serving(model_path: str, config: AgentRLConfig, *, run_dir: Path) -> VLLMServing:
    """Launch `rollout.num_servers` servers of `model_path` and wait until all are healthy."""
    rollout = config.actor_rollout_ref.rollout
    name = served_model_name(config)
    servers = launch_vllm_servers(
        model_path, rollout.num_servers, python=rollout.vllm.python, served_model_name=name,
        max_model_len=rollout.max_model_len, dtype=rollout.vllm.dtype, enable_lora=False,
        max_num_seqs=rollout.max_num_seqs, extra_args=build_vllm_extra_args(config),
        startup_timeout=rollout.vllm.startup_timeout, log_dir=Path(run_dir) / "vllm_logs",
    )  # fmt: skip
    return VLLMServing(servers, model_name=name, weights_dir=Path(run_dir) / "vllm_weights")
