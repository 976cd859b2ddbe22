"""Request models and response pieces of the OpenAI API as the embedded server speaks it.

Requests are validated by pydantic, so a wrong type becomes a 400 naming the field. Unknown fields
are ignored (agent frameworks send many: `user`, `parallel_tool_calls`, `frequency_penalty`, ...).
Token ids travel in the fields vLLM 0.32 uses, so one client reads both servers: with
`return_token_ids: true`, a chat response has top-level `prompt_token_ids` and `choices[i].token_ids`;
a completion response has `prompt_token_ids` and `token_ids` on every choice.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from agentrl.types import SamplingParams

MAX_TOP_LOGPROBS = 20
COMPLETIONS_MAX_TOKENS = 16
"""`max_tokens` of a `/v1/completions` request that sets none (OpenAI's and vLLM's default)."""
PROMPT_LIMIT_CODE = "max_prompt_length_exceeded"
"""`error.code` of the 400 for a prompt longer than the limit it was sent under (`data.max_prompt_length`, or
the server's `max_model_len`); the collector ends such an episode as `max_prompt_length_exceeded`."""
PROMPT_LIMIT_FIELD = "agentrl_max_prompt_tokens"
"""agentrl's extension: the longest prompt, in tokens, the server may generate for (the gateway sets it)."""
FINAL_BODY_FIELD = "agentrl_final_body"
"""agentrl's extension: a streamed answer ends, before `[DONE]`, with one event `{"agentrl_final_body": body}`
where body is what the same request would have answered unstreamed (the gateway records its trace from it)."""
LOGPROB_VALUES_FIELD = "agentrl_logprob_values"
"""agentrl's extension: asked (true), every choice of the answer carries `agentrl_logprob_values`, its sampled
tokens' logprobs as plain floats. The gateway records traces from them and asks for `logprobs` entries (token
text and bytes per token, built on the event loop the engine's thread waits on) only when its client did."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_reply_names_its_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not value:
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers")
        return value


class FunctionSpec(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """`response_format`: free text, any JSON object, or JSON under a schema (constrained decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    ignore_eos: bool = False
    """vLLM's extension (`extra_body`): keep generating past EOS."""
    min_tokens: int = Field(0, ge=0)
    """vLLM's extension (`extra_body`): EOS, stop tokens and stop strings end nothing before this many tokens."""
    logit_bias: dict[str, float] | None = None
    """Token id -> bias. Checked as vLLM checks it (ids inside the vocabulary); the embedded engine does not
    apply it."""

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (chat's newer name) or `max_tokens`."""
        return getattr(self, "max_completion_tokens", None) or self.max_tokens

    def min_tokens_error(self, default_max_tokens: int | None = None) -> str | None:
        """Why `min_tokens` cannot be honoured (above the requested maximum; vLLM refuses it too)."""
        asked = self.requested_max_tokens() or default_max_tokens
        if asked is not None and self.min_tokens > asked:
            return f"{self.min_tokens} is above the requested max_tokens of {asked}"
        return None

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's settings; `min_tokens` is clipped to `max_tokens` (what fits the context)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None or self.top_k == 0 else self.top_k,
            max_tokens=max_tokens,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            n=self.n,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens),
        )


class ContinuationIn(BaseModel):
    """agentrl's extension (`continuation.CONTINUATION_FIELD`): the token ids the first `history` messages hold."""

    model_config = ConfigDict(extra="forbid")

    prefix_ids: list[int] = Field(min_length=1)
    history: int = Field(ge=1)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    agentrl_continuation: ContinuationIn | None = None
    agentrl_max_prompt_tokens: int | None = Field(None, ge=1)
    """`PROMPT_LIMIT_FIELD`: a longer prompt is refused with code `PROMPT_LIMIT_CODE` before generating."""
    agentrl_final_body: bool = False
    """`FINAL_BODY_FIELD`: with `stream`, end the stream with the whole unstreamed response body."""
    agentrl_logprob_values: bool = False
    """`LOGPROB_VALUES_FIELD`: every choice carries its sampled tokens' logprobs as floats."""
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    agentrl_max_prompt_tokens: int | None = Field(None, ge=1)
    """`PROMPT_LIMIT_FIELD`: a longer prompt is refused with code `PROMPT_LIMIT_CODE` before generating."""
    agentrl_final_body: bool = False
    """`FINAL_BODY_FIELD`: with `stream`, end the stream with the whole unstreamed response body."""
    agentrl_logprob_values: bool = False
    """`LOGPROB_VALUES_FIELD`: every choice carries its sampled tokens' logprobs as floats."""


def top_logprobs_error(logprobs: bool | None, top_logprobs: int | None) -> str | None:
    """Why a chat request's `top_logprobs` cannot be served (set without `logprobs`; vLLM refuses it too)."""
    if top_logprobs and not logprobs:
        return f"{top_logprobs} was asked without logprobs; set logprobs to true to use top_logprobs"
    return None


def logit_bias_error(logit_bias: dict[str, float] | None, vocab_size: int) -> str | None:
    """Why `logit_bias` cannot be served: a key that is not a token id, an id outside [0, vocab_size), or a bias
    that is not a finite number (Python's JSON reads NaN; it would poison every sampled distribution)."""
    if not logit_bias:
        return None
    bad_keys = []
    for key, bias in logit_bias.items():
        if not math.isfinite(bias):
            return f"the bias of token {key!r} is {bias}; a bias must be a finite number"
        try:
            if not 0 <= int(key) < vocab_size:
                bad_keys.append(key)
        except (TypeError, ValueError):
            return f"key {key!r} is not a token id (an integer)"
    if bad_keys:
        return f"token id(s) {bad_keys[:5]} are outside the vocabulary [0, {vocab_size})"
    return None


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    503: "ServiceUnavailableError",
}
"""`error.type` by HTTP status: vLLM 0.32's names, which the embedded server and the gateway both use."""


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI error body with `param` naming the field (and `code`
    a named reason where one exists, e.g. `PROMPT_LIMIT_CODE`)."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def build_error(
    message: str, param: str | None = None, status: int = 400, code: str | None = None
) -> dict[str, Any]:
    """OpenAI error body `{"error": {"message", "type", "param", "code"}}` as vLLM 0.32 writes it: `type` from
    `ERROR_TYPES` (InternalServerError for other statuses), `code` the status unless a named `code` is given
    (the gateway's refusals: `max_turns_exceeded`, `PROMPT_LIMIT_CODE`)."""
    kind = ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class TokenText:
    """Token id -> its text as OpenAI logprobs show it (`token`, `bytes`), cached per id.

    Every answer's logprobs repeat the same few thousand ids: the `bytes` list of an id is built once and
    shared by every entry that shows it (entries are serialized, never changed in place)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _known(self, token_id: int) -> tuple[str, list[int]]:
        known = self._cache.get(token_id)
        if known is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            known = self._cache[token_id] = (text, list(text.encode("utf-8")))
        return known

    def __call__(self, token_id: int) -> str:
        return self._known(token_id)[0]

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self._known(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}


def build_chat_logprobs(
    token_text: TokenText, token_ids: list[int], logprobs: list[float], tops: list[dict[int, float]] | None
) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat response: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    content = []
    for j, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        entry = token_text.entry(token_id, logprob)
        entry["top_logprobs"] = [token_text.entry(t, lp) for t, lp in tops[j].items()] if tops else []
        content.append(entry)
    return {"content": content}


def build_completion_logprobs(
    token_text: TokenText,
    token_ids: list[int],
    logprobs: list[float],
    tops: list[dict[int, float]] | None,
    text_offset: int = 0,
) -> dict[str, Any]:
    """Legacy completions logprobs: `{tokens, token_logprobs, top_logprobs, text_offset}`."""
    tokens = [token_text(t) for t in token_ids]
    offsets, position = [], text_offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    top_list = (
        [{token_text(t): lp for t, lp in top.items()} for top in tops] if tops else [None] * len(tokens)
    )
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": top_list,
        "text_offset": offsets,
    }


def build_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def format_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic/FastAPI errors -> (message naming each field, first field's dotted path)."""
    parts, first = [], None
    for error in errors:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if error.get("type") == "json_invalid":
            return f"invalid JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        path = ".".join(loc) or "body"
        first = first or path
        parts.append(f"{path}: {error.get('msg')}")
    unique = list(dict.fromkeys(parts))
    return "; ".join(unique[:5]), first
