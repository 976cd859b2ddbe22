"""The math cookbook's agents: a one-shot solver and a two-turn solver that checks its own work.

Both send the task's `prompt` messages (verl row format; GSM8K rows already end with the "think step by
step ... ####" instruction) through `ctx.client`, so every model call goes through the gateway and is
trained on with the exact tokens the engine produced.
"""

from __future__ import annotations

from typing import Any

from agentrl import AgentFlow, RolloutContext, Step, Task, Trajectory

CHECK_PROMPT = (
    "Check your solution step by step once more. If you find a mistake, fix it. "
    'Then output the final answer after "####".'
)
"""The second user turn of `SelfCheckFlow`."""


def build_messages(task: Task, system_prompt: str | None, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """The chat for the first turn: an optional system message, then the row's prompt messages."""
    messages = [dict(m) for m in task[prompt_key]]
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


class MathSolverFlow(AgentFlow):
    """One model call: the prompt in, the reply (reasoning ending in `#### <number>`) out."""

    name = "solver"

    def __init__(self, system_prompt: str | None = None, prompt_key: str = "prompt") -> None:
        self.system_prompt = system_prompt
        self.prompt_key = prompt_key

    async def run(self, task: Task, ctx: RolloutContext) -> str:
        reply = await ctx.client.chat.completions.create(
            model=ctx.model, messages=build_messages(task, self.system_prompt, self.prompt_key)
        )
        return reply.choices[0].message.content or ""

    async def run_group(self, task: Task, ctx: RolloutContext, n: int) -> list[str]:
        """`n` rollouts of `run` in one call with `n` choices (`agent.group_calls`)."""
        reply = await ctx.client.chat.completions.create(
            model=ctx.model, messages=build_messages(task, self.system_prompt, self.prompt_key), n=n
        )
        return [choice.message.content or "" for choice in sorted(reply.choices, key=lambda c: c.index)]


class SelfCheckFlow(AgentFlow):
    """Two model calls: answer, then re-check once and answer again; the second answer is graded.

    Returns a `Trajectory` of two steps, one per call. The second prompt extends the first prompt plus the
    first reply, so training merges both turns into one row and only the model's tokens carry loss; the
    evaluator's reward (on the final answer) is shared by both turns.
    """

    name = "solver"

    def __init__(
        self, system_prompt: str | None = None, prompt_key: str = "prompt", check_prompt: str = CHECK_PROMPT
    ) -> None:
        self.system_prompt = system_prompt
        self.prompt_key = prompt_key
        self.check_prompt = check_prompt

    async def run(self, task: Task, ctx: RolloutContext) -> Trajectory:
        messages = build_messages(task, self.system_prompt, self.prompt_key)
        steps = []
        for turn in range(2):
            if turn == 1:
                messages = [*messages, {"role": "user", "content": self.check_prompt}]
            reply = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
            text = reply.choices[0].message.content or ""
            # model_response lets the collector match this step to its traced call (tokens and logprobs).
            steps.append(Step(messages=messages, model_response=text, done=turn == 1))
            messages = [*messages, {"role": "assistant", "content": text}]
        return Trajectory(name=self.name, steps=steps)
