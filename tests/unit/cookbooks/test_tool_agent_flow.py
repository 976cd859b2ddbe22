"""ToolAgentFlow's loop over tool calls (cookbooks/tool_agent): results, error observations, the step cap.

The policy is scripted: each reply is raw model text turned into a chat completion by agentrl's own
`parse_tool_calls`, as the embedded server does it (with its `tool_call_error` field), and a call beyond
the cap is refused with the gateway's error code. So the flow sees exactly what it sees in training,
for model outputs a tiny policy cannot be made to produce on demand.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
from agentrl_tool_agent import TOOL_SCHEMAS, ToolAgentFlow, ToolAnswerEvaluator
from agentrl_tool_agent.flow import TURN_LIMIT_CODE
from openai.types.chat import ChatCompletion

from agentrl import RolloutContext, Task
from agentrl.rollout.chat import parse_tool_calls
from agentrl.rollout.gateway import TURN_LIMIT_CODE as GATEWAY_TURN_LIMIT_CODE


class ScriptedPolicy:
    """`client.chat.completions.create` that answers with the next scripted text; records each request."""

    def __init__(self, replies: list[str], max_calls: int = 8) -> None:
        self.replies, self.max_calls, self.requests = list(replies), max_calls, []
        self.chat = self.completions = self

    async def create(self, *, model: str, messages: list[dict[str, Any]], tools=None) -> ChatCompletion:
        self.requests.append({"messages": [dict(m) for m in messages], "tools": tools})
        if len(self.requests) > self.max_calls:
            request = httpx.Request("POST", "http://gateway/v1/chat/completions")
            raise openai.BadRequestError(
                "session reached its limit of model calls (agent.max_steps)",
                response=httpx.Response(400, request=request),
                body={"code": TURN_LIMIT_CODE, "message": "limit"},
            )
        text = self.replies.pop(0)
        parsed = parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        if parsed.error:
            message["tool_call_error"] = parsed.error
        finish = "tool_calls" if parsed.tool_calls else "stop"
        return ChatCompletion.model_validate(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            }
        )


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


TASK = Task(
    id="t",
    data={
        "prompt": [{"role": "user", "content": "What is 37 * 3? Answer with the number only."}],
        "reward_model": {"ground_truth": "111"},
        "extra_info": {"store": {"plum": "417"}},
    },
)


def _run(replies: list[str], max_calls: int = 8):
    policy = ScriptedPolicy(replies, max_calls)
    ctx = RolloutContext(client=policy, model="m", session_id="s", base_url="", max_steps=max_calls)
    episode = asyncio.run(ToolAgentFlow().run(TASK, ctx))
    return episode, policy.requests


def test_turn_limit_code_is_the_gateways():
    assert TURN_LIMIT_CODE == GATEWAY_TURN_LIMIT_CODE


def test_well_formed_call_result_comes_back_as_a_tool_message_and_the_answer_is_scored():
    episode, requests = _run([_call("calculator", '{"expression": "37 * 3"}'), "111"])
    assert episode.answer == "111"
    assert episode.metrics == {"tool_calls": 1.0, "tool_errors": 0.0, "answered": 1.0}
    assert requests[0]["tools"] == TOOL_SCHEMAS
    assistant, tool = requests[1]["messages"][-2:]
    call = assistant["tool_calls"][0]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "37 * 3"}'}
    assert tool == {"role": "tool", "tool_call_id": call["id"], "content": "111"}
    scored = ToolAnswerEvaluator().evaluate(TASK, episode)
    assert scored.reward == 1.0
    assert scored.metrics == {"tool_calls": 1.0, "tool_errors": 0.0, "answered": 1.0, "correct": 1.0}


def test_store_is_stateful_within_an_episode():
    episode, requests = _run(
        [
            _call("kv_set", '{"key": "fig", "value": "12"}'),
            _call("kv_get", '{"key": "fig"}'),
            _call("kv_get", '{"key": "plum"}'),
            "done",
        ]
    )
    observations = [r["messages"][-1]["content"] for r in requests[1:]]
    assert observations == ["ok", "12", "417"]
    assert episode.metrics["tool_calls"] == 3.0


def test_malformed_call_json_gets_an_error_observation_and_the_episode_goes_on():
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 3"}\n</tool_call>'
    episode, requests = _run([broken, _call("calculator", '{"expression": "37 * 3"}'), "111"])
    assistant, observation = requests[1]["messages"][-2:]
    assert assistant == {"role": "assistant", "content": broken}
    assert observation["role"] == "user" and observation["content"].startswith("error: tool call 0:")
    assert requests[2]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": requests[2]["messages"][-2]["tool_calls"][0]["id"],
        "content": "111",
    }
    assert episode.answer == "111"
    assert episode.metrics == {"tool_calls": 2.0, "tool_errors": 1.0, "answered": 1.0}


def test_a_tool_that_raises_is_an_error_tool_message():
    episode, requests = _run([_call("calculator", '{"expression": "1 / 0"}'), "0"])
    assert (
        requests[1]["messages"][-1]["content"]
        == "error: calculator raised ZeroDivisionError: division by zero"
    )
    assert episode.metrics == {"tool_calls": 1.0, "tool_errors": 1.0, "answered": 1.0}
    assert ToolAnswerEvaluator().evaluate(TASK, episode).reward == 0.0


def test_an_unknown_tool_is_an_error_tool_message():
    episode, requests = _run([_call("search", '{"query": "37 * 3"}'), "111"])
    assert requests[1]["messages"][-1]["content"] == (
        "error: unknown tool 'search'; tools: ['calculator', 'kv_get', 'kv_set']"
    )
    assert episode.metrics == {"tool_calls": 1.0, "tool_errors": 1.0, "answered": 1.0}
    assert episode.answer == "111"


def test_hitting_the_step_cap_ends_the_episode_without_an_answer():
    loop = [_call("kv_get", '{"key": "plum"}')] * 5
    episode, requests = _run(loop, max_calls=2)
    assert len(requests) == 3  # two answered, the third refused by the gateway
    # "" and not None: the collector would otherwise take the last reply, a tool call, as the answer.
    assert episode.answer == ""
    assert episode.metrics == {"tool_calls": 2.0, "tool_errors": 0.0, "answered": 0.0}
    scored = ToolAnswerEvaluator().evaluate(TASK, episode)
    assert scored.reward == 0.0 and scored.metrics["answered"] == 0.0
