"""Chat messages to prompt token ids, and model text back to OpenAI tool calls.

Rendering goes through the tokenizer's own chat template (the one shipped with the model folder),
so the embedded server, vLLM and the trainer all see the same prompt tokens for the same messages.
Tool calls use the Qwen2.5 / Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentrl.recent_map import RecentMap

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Special tokens whose text is part of what a model says (tool calls, thinking): they stay in
# completion text even where a tokenizer marks them special (the tiny presets do).
VISIBLE_SPECIAL_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


def find_hidden_token_ids(tokenizer: Any) -> set[int]:
    """Special token ids left out of completion text (eos, pad, im_start, ...), as vLLM's skip_special_tokens."""
    vocab = tokenizer.get_vocab()
    visible = {vocab[t] for t in VISIBLE_SPECIAL_TOKENS if t in vocab}
    return set(tokenizer.all_special_ids) - visible


def decode_completion(tokenizer: Any, token_ids: list[int], hidden_ids: set[int]) -> str:
    """Completion text: control tokens dropped, tool-call markers kept."""
    return tokenizer.decode([t for t in token_ids if t not in hidden_ids], skip_special_tokens=False)


@dataclass
class ParsedToolCalls:
    """`content` is the text outside tool-call blocks (None if empty); `error` says what failed to parse."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI request shape -> what chat templates expect.

    `developer` is OpenAI's newer name for `system`. Tool-call arguments arrive as JSON strings;
    templates (Qwen's `arguments | tojson`) expect a mapping, so they are decoded when they parse,
    as vLLM does.
    """
    out = {k: v for k, v in message.items() if v is not None or k == "content"}
    if out.get("role") == "developer":
        out["role"] = "system"
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    decoded = json.loads(arguments)
                except json.JSONDecodeError:
                    decoded = None
                if isinstance(decoded, dict):
                    function["arguments"] = decoded
            call["function"] = function
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Prompt token ids for `messages` (and `tools`) through the tokenizer's chat template.

    Raises ValueError (naming `messages`) when the template rejects the conversation.
    """
    normalized = [normalize_message(m) for m in messages]
    try:
        rendered = tokenizer.apply_chat_template(
            normalized, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=True
        )
    except Exception as error:  # jinja2 TemplateError, or the template's raise_exception
        raise ValueError(f"messages: the chat template could not render them: {error}") from error
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


class ChatRenderCache:
    """`render_chat` for one tokenizer, remembering the last `size` conversations it rendered.

    A GRPO group sends the same messages `n` times, and rendering (the jinja template, then the tokenizer)
    is the largest per-request cost of the server after the model: ~1.3 ms a call on a 2-core machine. Keys
    are a digest of the messages and tools as JSON, so an image's data URL is not kept. A template that
    reads the clock (a date in the system prompt) keeps the rendering it had when first seen.
    """

    def __init__(self, tokenizer: Any, size: int = 4096) -> None:
        self.tokenizer, self.size = tokenizer, size
        self._entries = RecentMap(size)  # the server's routes and the pool's direct calls may be on two loops

    @property
    def hits(self) -> int:
        return self._entries.hits

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt ids `render_chat(tokenizer, messages, tools=tools)` gives; a new list each call."""
        text = json.dumps([messages, tools], sort_keys=True, ensure_ascii=False, default=str)
        key = hashlib.blake2b(text.encode(), digest_size=16).digest()
        return list(
            self._entries.get_or_make(key, lambda: tuple(render_chat(self.tokenizer, messages, tools=tools)))
        )


def _build_tool_call(payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ValueError('a tool call must be a JSON object with a string "name"')
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": payload["name"], "arguments": arguments},
    }


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Split model output into content and OpenAI-shaped tool calls.

    Every `<tool_call>...</tool_call>` block must hold a JSON object with `name` (and `arguments`).
    If any block fails (bad JSON, missing name, an unclosed `<tool_call>`), nothing is taken as a
    tool call: the whole text stays content and `error` says which block failed and why, so a
    policy's malformed call is visible to the agent and to training rather than silently dropped.
    """
    blocks = list(_TOOL_CALL_RE.finditer(text))
    unclosed = text.count("<tool_call>") > len(blocks)
    if not blocks and not unclosed:
        return ParsedToolCalls(content=text)
    if unclosed:
        return ParsedToolCalls(content=text, error="tool call: <tool_call> without a closing </tool_call>")
    calls = []
    for number, block in enumerate(blocks):
        try:
            calls.append(_build_tool_call(json.loads(block.group(1))))
        except (json.JSONDecodeError, ValueError) as error:
            return ParsedToolCalls(content=text, error=f"tool call {number}: {error}")
    content = _TOOL_CALL_RE.sub("", text).strip()
    return ParsedToolCalls(content=content or None, tool_calls=calls)
