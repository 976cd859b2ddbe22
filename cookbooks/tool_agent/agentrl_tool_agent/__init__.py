"""agentrl cookbook: a multi-turn agent that calls tools (a calculator and a key-value store).

`ToolAgentFlow` calls tools through OpenAI `tools` / `tool_calls` and reads their results as `tool`
messages until it answers; `ToolAnswerEvaluator` rewards the right final number and reports tool calls
per episode. `cookbooks/tool_agent/train.py` warm-starts the policy on the call format, then trains it
with GRPO and step-wise advantages.
"""

from agentrl_tool_agent.evaluator import ToolAnswerEvaluator, extract_answer
from agentrl_tool_agent.flow import ToolAgentFlow
from agentrl_tool_agent.tools import TOOL_SCHEMAS, KeyValueStore, ToolBox, calculate

__all__ = [
    "TOOL_SCHEMAS",
    "KeyValueStore",
    "ToolAgentFlow",
    "ToolAnswerEvaluator",
    "ToolBox",
    "calculate",
    "extract_answer",
]
