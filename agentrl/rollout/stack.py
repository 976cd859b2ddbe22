"""The rollout stack the controller talks to: a pool of servers behind a gateway, with its trace store.

It is the collector's `SessionBackend`: sessions open in the trace store (train or validation sampling),
each rollout's OpenAI client points at `{gateway}/sessions/{id}/v1`, and traces are read in-process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrl.rollout.embedded_rollout import served_model_name
from agentrl.rollout.gateway import build_gateway_app
from agentrl.rollout.http_server import ServerHandle, start_server_in_thread
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.traces import TraceStore
from agentrl.types import SamplingParams, Trace


def build_sampling_params(config: Any) -> tuple[SamplingParams, SamplingParams]:
    """Train and validation sampling from `actor_rollout_ref.rollout` (and its `val_kwargs`)."""
    rollout = config.actor_rollout_ref.rollout
    max_tokens = config.data.max_response_length
    train = SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_tokens=max_tokens,
        seed=config.trainer.seed,
    )
    val = rollout.val_kwargs
    validation = SamplingParams(
        temperature=val.temperature if val.do_sample else 0.0,
        top_p=val.top_p,
        top_k=val.top_k,
        max_tokens=max_tokens,
        seed=config.trainer.seed,
    )
    return train, validation


class RolloutStack:
    """Gateway + pool + trace store, started on loopback; `shutdown` stops the gateway."""

    def __init__(self, server_urls: Sequence[str], config: Any, pad_token_id: int) -> None:
        self.model_name = served_model_name(config)
        self.pad_token_id = pad_token_id
        self.traces = TraceStore()
        self.pool = RolloutPool(
            list(server_urls),
            model_name=self.model_name,
            engine=config.actor_rollout_ref.rollout.name,
            request_timeout=config.agent.timeout,
        )
        train, validation = build_sampling_params(config)
        app = build_gateway_app(
            self.pool,
            self.traces,
            sampling_train=train,
            sampling_val=validation,
            max_n=config.actor_rollout_ref.rollout.max_n_per_request,
        )
        self.gateway: ServerHandle | None = start_server_in_thread(app)
        self.backend = self

    @property
    def url(self) -> str:
        return self.gateway.url

    def open_session(self, session_id: str, mode: str, max_calls: int | None = None) -> str:
        self.traces.open_session(session_id, mode, max_calls=max_calls)
        return f"{self.gateway.url}/sessions/{session_id}/v1"

    def refused_calls(self, session_id: str) -> int:
        return self.traces.refused_calls(session_id)

    def session_traces(self, session_id: str) -> list[Trace]:
        return self.traces.traces(session_id)

    def close_session(self, session_id: str) -> None:
        self.traces.close_session(session_id)
        self.pool.forget_session(session_id)

    def shutdown(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None


def build_rollout_stack(server_urls: Sequence[str], config: Any, pad_token_id: int) -> RolloutStack:
    return RolloutStack(server_urls, config, pad_token_id)
