"""agentrl cookbook: math word problems (GSM8K format).

`MathSolverFlow` answers in one model call, `SelfCheckFlow` answers and then checks itself once, and
`GSM8KEvaluator` rewards the right number after `####`. `cookbooks/math/train.py` trains them with GRPO.
"""

from agentrl_math.evaluator import GSM8KEvaluator, extract_gsm8k_answer
from agentrl_math.flow import MathSolverFlow, SelfCheckFlow

__all__ = ["GSM8KEvaluator", "MathSolverFlow", "SelfCheckFlow", "extract_gsm8k_answer"]
