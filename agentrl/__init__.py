"""agentrl: train language-model agents with reinforcement learning.

Write an `AgentFlow` against the OpenAI API, an `Evaluator` that scores it, and call
`AgentTrainer(...).train()`.
"""

from agentrl.evaluator import Evaluator, MathAnswerMatch, evaluator
from agentrl.flow import AgentFlow, RolloutContext, SingleTurnChatFlow, agent_flow
from agentrl.runs.rollout_files import load_rollouts
from agentrl.types import Episode, EvalOutput, Step, Task, TerminationReason, Trajectory


def __getattr__(name: str):
    # AgentTrainer pulls in torch and the engines; import it only when asked for.
    if name in ("AgentTrainer", "TrainResult"):
        from agentrl import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'agentrl' has no attribute {name!r}")


__all__ = [
    "AgentFlow",
    "AgentTrainer",
    "EvalOutput",
    "Episode",
    "Evaluator",
    "MathAnswerMatch",
    "RolloutContext",
    "SingleTurnChatFlow",
    "Step",
    "Task",
    "TerminationReason",
    "Trajectory",
    "TrainResult",
    "agent_flow",
    "evaluator",
    "load_rollouts",
]
