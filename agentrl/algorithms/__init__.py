"""The RL algorithm library: pure functions over tensors (advantages, losses, KL, filters, step-wise).

Nothing here reads config, touches a model or logs; the controller unpacks its batch into these
functions and writes the results back. Formulas and config keys: docs/algorithms.md.
"""

from agentrl.algorithms._masked import masked_mean, masked_whiten
from agentrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    compute_advantages,
    compute_discounted_returns,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_rloo_advantages,
    register_advantage_estimator,
)
from agentrl.algorithms.filters import (
    REJECTION_MODES,
    SolveCounts,
    build_masked_reasons,
    compact_filter_keep,
    compute_solve_counts,
    count_termination_reasons,
    rejection_keep_groups,
    rejection_sample_keep,
    solve_partial_keep_groups,
)
from agentrl.algorithms.kl import (
    KL_TYPES,
    KLPenaltyResult,
    apply_kl_penalty_to_rewards,
    compute_kl_loss,
    compute_kl_penalty,
)
from agentrl.algorithms.losses import (
    LOSS_AGG_MODES,
    PolicyLossResult,
    ValueLossResult,
    aggregate_loss,
    compute_entropy_from_logits,
    compute_policy_loss,
    compute_token_log_probs,
    compute_value_loss,
)
from agentrl.algorithms.rollout_correction import TIS_MODES, behaviour_weights
from agentrl.algorithms.stepwise import (
    STEPWISE_MODES,
    StepAdvantageResult,
    broadcast_advantages,
    build_per_step_group_ids,
    compute_broadcast_step_advantages,
    compute_per_step_advantages,
    compute_step_counts,
    compute_step_positions,
    compute_step_returns,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "REJECTION_MODES",
    "STEPWISE_MODES",
    "TIS_MODES",
    "AdvantageResult",
    "KLPenaltyResult",
    "PolicyLossResult",
    "SolveCounts",
    "StepAdvantageResult",
    "ValueLossResult",
    "aggregate_loss",
    "apply_kl_penalty_to_rewards",
    "behaviour_weights",
    "broadcast_advantages",
    "build_masked_reasons",
    "build_per_step_group_ids",
    "compact_filter_keep",
    "compute_advantages",
    "compute_broadcast_step_advantages",
    "compute_discounted_returns",
    "compute_entropy_from_logits",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_kl_loss",
    "compute_kl_penalty",
    "compute_per_step_advantages",
    "compute_policy_loss",
    "compute_reinforce_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_rloo_advantages",
    "compute_solve_counts",
    "compute_step_counts",
    "compute_step_positions",
    "compute_step_returns",
    "compute_token_log_probs",
    "compute_value_loss",
    "count_termination_reasons",
    "masked_mean",
    "masked_whiten",
    "rejection_keep_groups",
    "rejection_sample_keep",
    "register_advantage_estimator",
    "solve_partial_keep_groups",
]
