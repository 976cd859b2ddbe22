"""The rollout stack the controller talks to: a pool of servers behind a gateway, with its trace store.

Its gateway is the collector's `SessionHost`: sessions open in the trace store (train or validation sampling),
each rollout's OpenAI client points at `{gateway}/sessions/{id}/v1`, and traces are read in-process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.serving.embedded import served_model_name
from agentrl.types import SamplingParams

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig


def build_sampling_params(config: AgentRLConfig) -> tuple[SamplingParams, SamplingParams]:
    """Train and validation sampling from `actor_rollout_ref.rollout` (and its `val_kwargs`)."""
    rollout = config.actor_rollout_ref.rollout
    max_tokens = config.data.max_response_length
    train = SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_tokens=max_tokens,
        seed=config.trainer.seed,
        ignore_eos=rollout.ignore_eos,
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
    """A `Gateway` over a pool of the policy's servers, configured from the run config and started on
    loopback; `backend` (the gateway) is what the collector opens sessions on."""

    def __init__(self, server_urls: Sequence[str], config: AgentRLConfig, pad_token_id: int) -> None:
        self.model_name = served_model_name(config)
        self.pad_token_id = pad_token_id
        self.pool = RolloutPool(
            list(server_urls),
            model_name=self.model_name,
            engine=config.actor_rollout_ref.rollout.name,
            request_timeout=config.agent.timeout,
        )
        train, validation = build_sampling_params(config)
        self.backend = Gateway(
            self.pool,
            sampling_train=train,
            sampling_val=validation,
            max_n=config.actor_rollout_ref.rollout.max_n_per_request,
            cumulative_token_mode=config.agent.cumulative_token_mode,
            max_prompt_tokens=config.data.max_prompt_length,
        ).start()

    @property
    def url(self) -> str:
        return self.backend.url

    def shutdown(self) -> None:
        self.backend.stop()


def build_rollout_stack(server_urls: Sequence[str], config: AgentRLConfig, pad_token_id: int) -> RolloutStack:
    return RolloutStack(server_urls, config, pad_token_id)
