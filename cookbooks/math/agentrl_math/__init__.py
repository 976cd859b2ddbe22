"""agentrl cookbook: math word problems (GSM8K format).

`MathSolverFlow` answers in one model call, `SelfCheckFlow` answers and then checks itself once, and
`GSM8KEvaluator` rewards the right number after `####`. `cookbooks/math/train.py` trains them with GRPO.
`agentrl_math.arithmetic` is the task `train_sums.py` teaches the real SmolLM2-135M-Instruct: two-digit sums in a
strict one-line format (`make_sum_rows`, `SumEvaluator`).
"""

from agentrl_math.arithmetic import SumEvaluator, make_sum_rows
from agentrl_math.evaluator import GSM8KEvaluator, extract_gsm8k_answer
from agentrl_math.flow import MathSolverFlow, SelfCheckFlow

__all__ = [
    "GSM8KEvaluator",
    "MathSolverFlow",
    "SelfCheckFlow",
    "SumEvaluator",
    "extract_gsm8k_answer",
    "make_sum_rows",
]
