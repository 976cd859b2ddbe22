"""The colocated rollout of a policy worker: an embedded engine over its own copy of the policy, served over
OpenAI-compatible HTTP on a free loopback port. The worker pushes trained weights into it between steps.

`EmbeddedServing` is the embedded side of `agentrl.rollout.serving.PolicyServing`: weights are loaded in
process (no files), and the engine reports a fingerprint of what it serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agentrl.models import load_causal_lm
from agentrl.rollout.app import build_server_app
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.serving.base import ProbeResult, probe_server
from agentrl.rollout.uvicorn_thread import ServerHandle, start_server_in_thread

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig


@dataclass
class EmbeddedServing:
    engine: EmbeddedEngine
    server: ServerHandle
    model_name: str = ""
    shares_weights: bool = False
    """The engine serves the trainer's own module: a push only marks a new version (and the fingerprint check
    still compares what the trainer holds with what the engine serves)."""

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def urls(self) -> list[str]:
        return [self.server.url]

    def push_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.shares_weights:
            for _ in weights:  # consumed for the caller's fingerprint; the engine already holds these tensors
                pass
            return self.engine.mark_weights_updated()
        return self.engine.update_weights(weights)

    def served_fingerprint(self) -> str:
        return self.engine.weights_fingerprint()

    def probe(self, prompt_ids: Sequence[int], max_tokens: int) -> list[ProbeResult]:
        return [probe_server(self.url, self.model_name, prompt_ids, max_tokens)]

    def sleep(self, discard_weights: bool = False, keep_allocator_cache: bool = False) -> None:
        self.engine.sleep(discard_weights=discard_weights, keep_allocator_cache=keep_allocator_cache)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def stop(self) -> None:
        self.server.stop()
        self.engine.close()


def compiles_decode(config: AgentRLConfig) -> bool:
    """Whether the embedded engine compiles its decode step: `rollout.compile_decode`, where `auto` compiles
    16-bit weights only. Measured on an H100: compiling halves a bf16 step of the 0.5B shape (3.3 -> 1.7 ms),
    while SmolLM2-135M in float32 decoded 20 GRPO steps in 11.0 s compiled against 12.5 s plain, for 21 s of
    compiling and 6 s more graph capture (docs/benchmarks.md)."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.enforce_eager:
        return False
    if rollout.compile_decode == "auto":
        return config.actor_rollout_ref.model.dtype in ("bfloat16", "float16")
    return bool(rollout.compile_decode)


SCHEDULER_STEPS_UNDER_GRAPHS = 8


def scheduler_steps(config: AgentRLConfig, device: str) -> int:
    """Decode steps per engine step: `rollout.num_scheduler_steps`, where `auto` is
    `SCHEDULER_STEPS_UNDER_GRAPHS` on a GPU under CUDA graphs (one replay, one read of the tokens and one round
    of the engine thread's Python for all of them, which waited for the GIL between every step) and 1 elsewhere
    (a CPU step is its compute: more steps would only hold new requests back)."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.num_scheduler_steps != "auto":
        return rollout.num_scheduler_steps
    graphs = torch.device(device).type == "cuda" and not rollout.enforce_eager
    return SCHEDULER_STEPS_UNDER_GRAPHS if graphs else 1


def start_embedded_serving(
    model_path: str,
    tokenizer: Any,
    config: AgentRLConfig,
    *,
    device: str,
    policy: torch.nn.Module | None = None,
    host: str = "127.0.0.1",
) -> EmbeddedServing:
    """Start an engine and its server (`actor_rollout_ref.rollout.*`) on `host` over `policy`, the trainer's own
    module (one copy of the weights for both), or over a serving copy loaded from `model_path` when None."""
    rollout = config.actor_rollout_ref.rollout
    model = policy
    if model is None:
        model = load_causal_lm(model_path, dtype=config.actor_rollout_ref.model.dtype, device=device)
    engine = EmbeddedEngine(
        model,
        tokenizer,
        max_num_seqs=rollout.max_num_seqs,
        max_model_len=rollout.max_model_len,
        cuda_graphs=not rollout.enforce_eager,
        compile_decode=compiles_decode(config),
        draw_on_device=rollout.draw_on_device,
        num_scheduler_steps=scheduler_steps(config, device),
        owns_weights=policy is None,
        enable_prefix_caching=rollout.enable_prefix_caching,
        prefill_chunk_tokens=rollout.max_num_batched_tokens,
        chunked_prefill=rollout.enable_chunked_prefill,
        prefix_max_weight_changes=stale_prefix_bound(config),
        sleeps_between_steps=rollout.free_cache_engine,
        fuse_projections=rollout.fuse_projections,
    )
    name = served_model_name(config)
    app = build_server_app(
        engine,
        tokenizer,
        model_name=name,
        max_model_len=rollout.max_model_len,
        max_n=rollout.max_n_per_request,
    )
    try:
        server = start_server_in_thread(app, host=host)
    except Exception:
        engine.close()
        raise
    return EmbeddedServing(engine, server, name, shares_weights=policy is not None)


def stale_prefix_bound(config: AgentRLConfig) -> int:
    """Weight pushes a parked prefix outlives: the staleness bound with `async_training.reuse_stale_prefixes`,
    else 0 (every push forgets them)."""
    run_ahead = config.async_training
    return run_ahead.staleness_threshold if run_ahead.enable and run_ahead.reuse_stale_prefixes else 0


def served_model_name(config: AgentRLConfig) -> str:
    """The model name flows pass as `model=`: the configured path (the gateway routes any name anyway)."""
    return config.actor_rollout_ref.model.path
