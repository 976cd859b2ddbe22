"""Token-exact continuation of a session (rLLM's cumulative token mode): the next turn extends the sampled ids.

An agent re-sends its whole history each turn. Rendering that history from text again gives other ids than the
model sampled (a reply does not re-tokenize to its own ids, tool calls are re-serialised), so the turn would
not extend the previous prompt + completion: it could not merge into the episode's training row, the model
would see a history it never produced, and no cached prefix would match. Instead, when a request extends its
session's previous turn (the same messages and tools, then the assistant reply the session was given, then
new messages), its prompt is

    previous prompt ids + sampled completion ids + the template's end of that turn + the new messages rendered

Two halves, one per side of the wire:
- the gateway (`SessionTurns`) decides whether a request extends the previous turn, from the messages alone,
  and sends the token ids so far with the request (`CONTINUATION_FIELD`);
- the server (`continue_prompt`) renders the new messages with its chat template, and says in its answer
  whether it continued (`CONTINUED_FIELD`); it renders the whole request instead when its template renders
  the history differently from the prompt it rendered before (a template that drops earlier reasoning).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.chat import normalize_message

CONTINUATION_FIELD = "agentrl_continuation"
"""Request extension: {"prefix_ids": [...], "history": n} where the first n messages (through the assistant
reply) are what `prefix_ids` holds."""
CONTINUED_FIELD = "agentrl_continued"
"""Response extension: true when the server built the prompt from `prefix_ids`; else the reason it did not."""
_SENTINEL = "\ue000agentrl-turn-end\ue000"


@dataclass
class _Reply:
    response_ids: list[int]
    prompt_ids: list[int]
    content: str
    tool_calls: list[tuple[str, str]]


@dataclass
class _Turn:
    messages: list[Any]
    tools: str
    replies: list[_Reply] = field(default_factory=list)


def _calls(tool_calls: Any) -> list[tuple[str, str]]:
    """(name, arguments as canonical JSON) per call: ids and argument formatting may differ on the way back."""
    out = []
    for call in tool_calls or []:
        function = (call or {}).get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        out.append((str(function.get("name")), json.dumps(arguments, sort_keys=True)))
    return out


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # text parts, as the OpenAI client may send an assistant message back
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


class SessionTurns:
    """The gateway's memory of each session's last chat turn, and the counts of continued and rendered turns."""

    def __init__(self) -> None:
        self._turns: dict[str, _Turn] = {}
        self._lock = threading.Lock()
        self.continued = 0
        self.fallbacks: dict[str, int] = {}
        """Reason -> follow-up turns whose prompt was rendered from text instead."""
        self._by_mode: dict[str, list[int]] = {}
        """Session mode (train, validation) -> [continued, fallbacks]: training's step metrics count only its own."""

    @property
    def fallback_count(self) -> int:
        return sum(self.fallbacks.values())

    def counts(self, mode: str) -> tuple[int, int]:
        """(continued turns, fallbacks) of sessions in `mode` so far."""
        continued, fallbacks = self._by_mode.get(mode, (0, 0))
        return continued, fallbacks

    def count_fallback(self, reason: str, mode: str = "train") -> None:
        with self._lock:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            self._by_mode.setdefault(mode, [0, 0])[1] += 1

    def count_continued(self, mode: str = "train") -> None:
        with self._lock:
            self.continued += 1
            self._by_mode.setdefault(mode, [0, 0])[0] += 1

    def plan(
        self, session_id: str, messages: list[Any], tools: Any
    ) -> tuple[dict[str, Any] | None, str | None]:
        """(the `CONTINUATION_FIELD` value, None) when `messages` extend the session's last turn; (None, why
        not) for a follow-up that does not; (None, None) for a session's first turn."""
        turn = self._turns.get(session_id)
        if turn is None:
            return None, None
        held = len(turn.messages)
        if messages[:held] != turn.messages:
            return None, "history_rewritten"
        if json.dumps(tools, sort_keys=True) != turn.tools:
            return None, "tools_changed"
        if len(messages) < held + 2:
            return None, "no_new_message"
        reply = messages[held]
        if not isinstance(reply, dict) or reply.get("role") != "assistant":
            return None, "no_assistant_reply"
        said, calls = _content_text(reply.get("content")), _calls(reply.get("tool_calls"))
        for choice in turn.replies:
            if choice.content == said and choice.tool_calls == calls:
                return {"prefix_ids": choice.prompt_ids + choice.response_ids, "history": held + 1}, None
        return None, "reply_edited"

    def remember(
        self, session_id: str, messages: list[Any], tools: Any, choices: list[dict[str, Any]]
    ) -> None:
        """The turn just answered: its messages and, per choice, the ids and what the client was shown."""
        replies = [
            _Reply(
                response_ids=list(c["response_ids"]),
                prompt_ids=list(c["prompt_ids"]),
                content=_content_text(c.get("content")),
                tool_calls=_calls(c.get("tool_calls")),
            )
            for c in choices
        ]
        with self._lock:
            self._turns[session_id] = _Turn(list(messages), json.dumps(tools, sort_keys=True), replies)

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._turns.pop(session_id, None)


def _render_text(
    tokenizer: Any, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool
) -> str:
    normalized = [normalize_message(m) for m in messages]
    try:
        return tokenizer.apply_chat_template(
            normalized, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as error:  # jinja2 TemplateError, or the template's raise_exception
        raise ValueError(f"messages: the chat template could not render them: {error}") from error


_TURN_ENDS: dict[tuple[int, str], list[int]] = {}


def turn_end_ids(tokenizer: Any, tools: Any) -> list[int]:
    """The ids the chat template writes after an assistant reply's content (Qwen: `<|im_end|>` and a newline),
    read off a one-exchange conversation; kept per tokenizer and tools."""
    key = (id(tokenizer), json.dumps(tools, sort_keys=True))
    if key not in _TURN_ENDS:
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
        text = _render_text(tokenizer, probe, tools, add_generation_prompt=False)
        closing = text[text.index(_SENTINEL) + len(_SENTINEL) :]
        _TURN_ENDS[key] = list(tokenizer.encode(closing, add_special_tokens=False)) if closing else []
    return list(_TURN_ENDS[key])


def continue_prompt(
    tokenizer: Any, prefix_ids: list[int], messages: list[dict[str, Any]], history: int, tools: Any
) -> tuple[list[int] | None, str | None]:
    """(prompt ids, None): `prefix_ids` (previous prompt + sampled completion), the end of that turn unless the
    completion already holds it, then the new messages `messages[history:]` with the generation prompt, as the
    template renders them after the history (text, then only that text tokenized: the cost does not grow with
    the history). (None, why) when the template renders the history as something the whole conversation does
    not start with (a template that drops earlier reasoning, say)."""
    if not 0 < history < len(messages) or messages[history - 1].get("role") != "assistant":
        return None, "bad_history"
    base = _render_text(tokenizer, messages[:history], tools, add_generation_prompt=False)
    full = _render_text(tokenizer, messages, tools, add_generation_prompt=True)
    if not full.startswith(base):
        return None, "template_not_prefix_stable"
    closing = turn_end_ids(tokenizer, tools)
    if closing and prefix_ids and prefix_ids[-1] == closing[0]:
        closing = closing[1:]  # the completion ended with the template's end-of-turn token
    suffix = tokenizer.encode(full[len(base) :], add_special_tokens=False)
    return list(prefix_ids) + closing + list(suffix), None
