"""Book-keeping of requests and their sequences inside the embedded engine (no torch model here).

A request with `n` completions becomes `n` sequences; each sequence owns its tokens, raw
logprobs, stop checking and its own seed (completion i of a seeded request draws with seed + i). Stop handling follows vLLM: a stop string
ends the sequence with finish_reason "stop"; the returned text stops before the stop string,
while `token_ids` (and `logprobs`) keep every sampled token including the ones that spelled the
stop string, because training needs tokens that match their logprobs exactly. An EOS or
`stop_token_ids` token is kept in `token_ids` too (as vLLM does) and left out of the text.
vLLM's `ignore_eos` and `min_tokens` are honoured in the stop check (`Detokenizer.check_finished`).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.chat import decode_completion, find_hidden_token_ids
from agentrl.types import GenerationOutput, SamplingParams


@dataclass
class StreamEvent:
    """New tokens of one completion since the last event; `output` is set when it finished."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    output: GenerationOutput | None = None


@dataclass
class Request:
    """One `generate` call: the prompt, its settings and where its events go (an asyncio queue)."""

    prompt_ids: list[int]
    params: SamplingParams
    top_logprobs: int
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool = False
    """Deliver tokens after every step (else only finished completions)."""
    cancelled: bool = False
    arrived: float = field(default_factory=time.monotonic)
    """When it was enqueued: the scheduler holds prefills back a little to batch arrivals."""
    images: Any = None
    """`vision.ImageInputs` behind the prompt's image pads, or None for a text prompt."""
    constraint: Any = None
    """`constraints.Constraint` the completions must follow (forced tool call, JSON), or None."""
    draws_on_device: bool = False
    """Its rows need nothing from the host to draw (no grammar, blocked tokens or top logprobs)."""
    prompt_hashes: list[int] | None = None
    """The prompt's `block_hashes` (text prompts, with prefix caching), computed as it arrives: the scheduler
    looks the prompt up in the prefix cache to budget a step's prefill, and again to admit it."""
    computed_in_parts: int = 0
    """Prompt tokens computed in earlier engine steps while rows decoded (chunked prefill), not cache hits."""
    admitted_at: float | None = None
    """When its prefill began (its first part's, for a prompt computed in parts); `time.monotonic()`."""
    first_token_at: float | None = None
    """When its first token was recorded."""
    finished_sequences: int = 0
    """Its completions that have finished: at `params.n` its latencies are counted (`_request_metrics.py`)."""
    most_generated: int = 0
    """The most tokens one of its finished completions generated."""


@dataclass
class Sequence:
    """One completion being generated; `pending` is the sampled token not yet fed to the model."""

    request: Request
    index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    last_token_at: float | None = None
    """When its latest token was recorded (`time.monotonic()`): the next one's inter-token latency starts there."""
    stop_text_end: int | None = None
    decoded_len: int = 0
    sent: int = 0
    matcher: Any = None
    """The grammar matcher of a constrained completion (`constraints.py`), advanced token by token."""

    @property
    def pending(self) -> int:
        return self.token_ids[-1]


def build_sequences(request: Request) -> list[Sequence]:
    """`n` sequences; completion i of a seeded request uses seed + i, so each is reproducible."""
    base_seed = request.params.seed if request.params.seed is not None else random.getrandbits(62)
    return [Sequence(request=request, index=i, seed=base_seed + i) for i in range(request.params.n)]


class Detokenizer:
    """Decodes completions and finds stop strings and stop tokens for the engine."""

    def __init__(self, tokenizer, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        # The model's EOS ids too: a converted tokenizer may not mark its chat EOS special (SmolLM2 under some
        # transformers versions), and its text in an answer fails a strict grader.
        self.hidden_ids = find_hidden_token_ids(tokenizer) | set(eos_token_ids)

    def decode(self, token_ids: list[int]) -> str:
        return decode_completion(self.tokenizer, token_ids, self.hidden_ids)

    def check_finished(self, seq: Sequence, max_model_len_reached: bool) -> None:
        """Set `seq.finish_reason` (and where a stop string starts) after a token was appended.

        `ignore_eos` skips the EOS check (explicit `stop_token_ids` still stop, as in vLLM). Below
        `min_tokens` nothing but the length limit ends the sequence: an EOS or stop token sampled
        there is kept and generation goes on (vLLM masks them from sampling instead), and stop
        strings count only in text decoded after the first `min_tokens` tokens.
        """
        if seq.finish_reason is not None:  # its grammar ended it (constraints.advance)
            return
        params = seq.request.params
        if len(seq.token_ids) < params.min_tokens:
            if params.stop:  # text up to here may not end the sequence later
                seq.decoded_len = len(self.decode(seq.token_ids))
        else:
            token = seq.token_ids[-1]
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                seq.finish_reason = "stop"
                return
            if params.stop:
                text, seen = self.decode(seq.token_ids), seq.decoded_len
                seq.decoded_len = len(text)
                # A hit must end in the new text: earlier text was checked, or lies within min_tokens.
                hits = [pos for s in params.stop if (pos := text.find(s, max(0, seen - len(s) + 1))) >= 0]
                if hits:
                    seq.finish_reason = "stop"
                    seq.stop_text_end = min(hits)
                    return
        if len(seq.token_ids) >= seq.request.max_new_tokens or max_model_len_reached:
            seq.finish_reason = "length"

    def build_output(self, seq: Sequence) -> GenerationOutput:
        shown = seq.token_ids
        if seq.finish_reason == "stop" and shown and shown[-1] in seq.request.params.stop_token_ids:
            shown = shown[:-1]  # the stop token that ended it stays out of the text, as in vLLM
        text = self.decode(shown)
        if seq.stop_text_end is not None:
            text = text[: seq.stop_text_end]
        return GenerationOutput(
            token_ids=list(seq.token_ids),
            logprobs=list(seq.logprobs),
            finish_reason=seq.finish_reason or "abort",
            text=text,
            top_logprobs=list(seq.top_logprobs) if seq.request.top_logprobs else None,
        )

    def take_event(self, seq: Sequence) -> StreamEvent:
        """The tokens not yet sent to the request's queue (and the final output if finished)."""
        start, seq.sent = seq.sent, len(seq.token_ids)
        tops = seq.top_logprobs[start:] if seq.request.top_logprobs else None
        output = self.build_output(seq) if seq.finish_reason else None
        return StreamEvent(
            index=seq.index,
            token_ids=seq.token_ids[start:],
            logprobs=seq.logprobs[start:],
            top_logprobs=tops,
            finish_reason=seq.finish_reason,
            output=output,
        )
