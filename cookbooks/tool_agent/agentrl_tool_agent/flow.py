"""The tool agent: asks the policy, runs the tool calls it makes, feeds the results back, until it answers.

Every model call goes through `ctx.client` with `tools=TOOL_SCHEMAS`, so the gateway renders the tool
preamble with the policy's chat template and parses `<tool_call>` blocks into OpenAI `tool_calls`. Each
result goes back as a `tool` message (with its `tool_call_id`). What can go wrong becomes an observation
and the episode goes on: a call whose JSON does not parse gets a `user` message saying so (there is no
call id to answer), an unknown tool or a raising tool gets an `error: ...` tool message. When the gateway
refuses a call beyond `agent.max_steps`, the flow stops and the episode ends as `max_turns_exceeded`.
"""

from __future__ import annotations

from typing import Any

import openai

from agentrl import AgentFlow, Episode, RolloutContext, Task, Trajectory
from agentrl_tool_agent.tools import TOOL_SCHEMAS, ToolBox

TURN_LIMIT_CODE = "max_turns_exceeded"
"""The error code of the gateway's 400 for a call beyond `agent.max_steps`."""


def malformed_call_error(message: Any) -> str | None:
    """Why the reply's tool call did not parse, or None.

    The embedded engine says so in the message's `tool_call_error` field; a server that does not (vLLM's
    hermes parser leaves the text as content) is caught by a `<tool_call>` left in the content.
    """
    error = (getattr(message, "model_extra", None) or {}).get("tool_call_error")
    if error:
        return str(error)
    if not message.tool_calls and "<tool_call>" in (message.content or ""):
        return "the <tool_call> block could not be parsed"
    return None


class ToolAgentFlow(AgentFlow):
    """Model call, tool calls, model call, ... until a reply with no tool call: its text is the answer.

    Returns an `Episode` whose metrics count `tool_calls` (calls the policy made, parsed or not),
    `tool_errors` (malformed, unknown or failing calls) and `answered` (0 when it stopped at the step cap,
    with answer ""); the evaluator reports them.
    """

    name = "tool_agent"

    def __init__(self, prompt_key: str = "prompt") -> None:
        self.prompt_key = prompt_key

    async def run(self, task: Task, ctx: RolloutContext) -> Episode:
        tools = ToolBox(store=(task.get("extra_info") or {}).get("store"))
        messages: list[dict[str, Any]] = [dict(m) for m in task[self.prompt_key]]
        calls = errors = 0
        answer = None
        while answer is None:
            try:
                reply = await ctx.client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=TOOL_SCHEMAS
                )
            except openai.BadRequestError as exc:
                if exc.code != TURN_LIMIT_CODE:
                    raise
                break  # the collector counts the refused call: termination reason max_turns_exceeded
            message = reply.choices[0].message
            malformed = malformed_call_error(message)
            if malformed is not None:
                calls, errors = calls + 1, errors + 1
                messages += [
                    {"role": "assistant", "content": message.content or ""},
                    {"role": "user", "content": f"error: {malformed}. Call a tool with valid JSON."},
                ]
            elif message.tool_calls:
                messages.append(
                    {
                        "role": "assistant",
                        "content": message.content or "",
                        "tool_calls": [call.model_dump() for call in message.tool_calls],
                    }
                )
                for call in message.tool_calls:
                    observation, ok = tools.call(call.function.name, call.function.arguments)
                    calls, errors = calls + 1, errors + (not ok)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
            else:
                answer = message.content or ""
        return Episode(
            trajectories=[Trajectory(name=self.name)],  # no steps: one per traced call, in call order
            # "" rather than None: the collector would take the last reply (a tool call) as the answer.
            answer=answer if answer is not None else "",
            metrics={
                "tool_calls": float(calls),
                "tool_errors": float(errors),
                "answered": float(answer is not None),
            },
        )
