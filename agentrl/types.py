"""The data model shared by every layer: what a rollout produces and what crosses process boundaries.

Pydantic models, so that anything arriving over HTTP or from a user's AgentFlow is validated where it
enters, and an error names the field that was wrong.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator


class TerminationReason(str, Enum):
    """Why an episode ended. Compact filtering (`agent.compact_filtering.mask_*`) keys on these."""

    ENV_DONE = "env_done"
    MAX_TURNS_EXCEEDED = "max_turns_exceeded"
    MAX_PROMPT_LENGTH_EXCEEDED = "max_prompt_length_exceeded"
    MAX_RESPONSE_LENGTH_EXCEEDED = "max_response_length_exceeded"
    TIMEOUT = "timeout"
    ERROR = "error"
    UNKNOWN = "unknown"


class SamplingParams(BaseModel):
    """Sampling settings for one generation call; a training phase shares one setting."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    """0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    """-1 disables top-k."""
    max_tokens: int = Field(64, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    n: int = Field(1, ge=1)
    seed: int | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past EOS tokens (explicit `stop_token_ids` still stop)."""
    min_tokens: int = Field(0, ge=0)
    """vLLM's extension: no EOS, stop token or stop string ends a completion before this many tokens."""

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self


class GenerationOutput(BaseModel):
    """One completion from an engine: the exact tokens sampled and the logprob of each."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort"]
    text: str = ""
    top_logprobs: list[dict[int, float]] | None = None


def logprob_count_problem(response_ids: list[int], logprobs: list[float]) -> str | None:
    """Why a call's token ids and logprobs cannot train together (one log-prob per sampled token), or None.

    Checked where a server's answer becomes a trace and again where a step becomes a training row (a flow
    may build its steps itself).
    """
    if len(logprobs) == len(response_ids):
        return None
    return f"{len(response_ids)} token ids but {len(logprobs)} logprobs"


class Trace(BaseModel):
    """One model call as the gateway saw it: the ground truth training uses (token in, token out)."""

    session_id: str
    request_id: str
    prompt_ids: list[int]
    response_ids: list[int] = Field(validation_alias=AliasChoices("response_ids", "completion_ids"))
    """The sampled token ids (`completion_ids` before format 2 of the trace JSON; still read)."""
    logprobs: list[float]
    finish_reason: str
    policy_version: int = 0
    latency_s: float = 0.0
    server: str = ""
    messages: list[dict[str, Any]] | None = None
    """The chat request's messages (None for /completions)."""
    completion_text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    choice_index: int = 0
    images: list[str] | None = None
    """The resized images behind the prompt's image pads (PNG data URLs, in prompt order): the reference
    training rebuilds the exact pixel inputs from. None for a text-only prompt."""


class Task(BaseModel):
    """One dataset row as the flow sees it. `data` holds the whole row (prompt, data_source, ...)."""

    id: str
    data: dict[str, Any] = Field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


class Step(BaseModel):
    """One model call inside a trajectory, filled with the gateway's token ids and logprobs."""

    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    images: list[str] = Field(default_factory=list)
    """The prompt's images (PNG data URLs of what the engine saw, in order); empty for text prompts."""
    reward: float = 0.0
    done: bool = False
    messages: list[dict[str, Any]] = Field(default_factory=list)
    model_response: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    """The tool calls of the model's reply, in OpenAI form (None when it called none)."""
    finish_reason: str = ""
    advantage: float | None = None
    info: dict[str, Any] = Field(default_factory=dict)


class Trajectory(BaseModel):
    """A sequence of steps by one role (`name`) of an agent; advantages group by (task, name)."""

    name: str = "agent"
    steps: list[Step] = Field(default_factory=list)
    reward: float | None = None
    """Set by the flow to keep its own reward; None means the evaluator's reward fills it."""


class Episode(BaseModel):
    """Everything one rollout of one task produced, with how it ended and how it scored."""

    id: str = ""
    task_id: str = ""
    task: dict[str, Any] = Field(default_factory=dict)
    trajectories: list[Trajectory] = Field(default_factory=list)
    answer: str | None = None
    """The flow's final answer when it returned a string."""
    termination_reason: TerminationReason = TerminationReason.UNKNOWN
    is_correct: bool = False
    reward: float = 0.0
    error: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    filter_reason: str | None = None
    """Why training left this episode out (error, evaluator_error, compact_filtering, rejection_sampling,
    batch_full); None when it was kept. Set by the controller, saved with the rollouts."""


class EvalOutput(BaseModel):
    """What an Evaluator returns for one episode."""

    reward: float
    is_correct: bool | None = None
    """None means `reward > 0`."""
    metrics: dict[str, float] = Field(default_factory=dict)
