"""The colocated rollout of a policy worker: an embedded engine over its own copy of the policy, served over
OpenAI-compatible HTTP on a free loopback port. The worker pushes trained weights into it between steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrl.models import load_causal_lm
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.http_server import ServerHandle, start_server_in_thread
from agentrl.rollout.server import build_server_app


@dataclass
class EmbeddedRollout:
    engine: EmbeddedEngine
    server: ServerHandle

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        self.engine.close()


def start_embedded_rollout(model_path: str, tokenizer: Any, config: Any, *, device: str) -> EmbeddedRollout:
    """Load the serving copy of the policy and start its server (`actor_rollout_ref.rollout.*`)."""
    rollout = config.actor_rollout_ref.rollout
    model = load_causal_lm(model_path, dtype=config.actor_rollout_ref.model.dtype, device=device)
    engine = EmbeddedEngine(model, tokenizer, max_num_seqs=rollout.max_num_seqs, max_model_len=rollout.max_model_len)
    app = build_server_app(engine, tokenizer, model_name=served_model_name(config),
                           max_model_len=rollout.max_model_len, max_n=rollout.max_n_per_request)
    try:
        server = start_server_in_thread(app)
    except Exception:
        engine.close()
        raise
    return EmbeddedRollout(engine, server)


def served_model_name(config: Any) -> str:
    """The model name flows pass as `model=`: the configured path (the gateway routes any name anyway)."""
    return config.actor_rollout_ref.model.path
