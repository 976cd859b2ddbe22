"""The worked examples of docs/algorithms.md, one test per case, each computed by hand in its docstring.

They pin down the semantics users of verl and rLLM expect (issue 9): how a trajectory counts in its
group, step-wise advantages, groups of one, termination reasons, config refusals, rejection
sampling and the REINFORCE++ family.
"""

from __future__ import annotations

import math

import pytest
import torch

from agentrl import EvalOutput, agent_flow, evaluator
from agentrl.algorithms import (
    build_masked_reasons,
    compact_filter_keep,
    compute_advantages,
    rejection_sample_keep,
)
from agentrl.config import ConfigError, validate_config
from agentrl.rollout.collector import CollectorLimits, RolloutCollector, classify_termination
from agentrl.training.controller import Controller
from agentrl.training.metrics import compute_episode_metrics
from agentrl.training.update.assembly import episodes_to_rows, rows_to_batch
from agentrl.training.update.batch_advantages import compute_batch_advantages
from agentrl.types import Episode, Step, TerminationReason, Trace, Trajectory

S2 = 1 / math.sqrt(2)
S3 = 1 / math.sqrt(3)
EPS = 1e-6


def _step(prompt: list[int], response: list[int], **info) -> Step:
    return Step(prompt_ids=prompt, response_ids=response, logprobs=[-0.5] * len(response), info=info)


def _episode(name: str, steps: list[Step], reward: float, task: str = "t0") -> Episode:
    return Episode(
        id=f"{task}:{name}", task_id=task, reward=reward, trajectories=[Trajectory(name="agent", steps=steps)]
    )


def _row_advantages(episodes, *, merge_steps=True, **options) -> list[float]:
    """Assemble the episodes and return the one advantage each row carries on its response tokens."""
    rows, _ = episodes_to_rows(episodes, merge_steps=merge_steps)
    batch = rows_to_batch(rows, pad_token_id=0)
    defaults = dict(estimator="grpo", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True)
    result = compute_batch_advantages(batch, **(defaults | options))
    per_row = [result.advantages[i][batch.response_mask[i]].unique() for i in range(len(batch))]
    assert all(v.numel() == 1 for v in per_row)
    return [float(v) for v in per_row]


def test_case1_a_trajectory_weighs_once_in_its_group_whatever_its_rows():
    """Step-wise off (the default): GRPO compares trajectories, then gives each row its trajectory's advantage.

    One task. Trajectory a (reward 1) has 2 steps; the second prompt does not extend the first, so a
    is split into 2 rows. Trajectory b (reward 0) has 1 step, 1 row.
        per trajectory: scores [1, 0], mean 0.5, unbiased std sqrt(0.5) = 0.7071
                        A_a = 0.5 / 0.7071 = +0.7071 (on both rows of a), A_b = -0.7071
        per row (the old behaviour): scores [1, 1, 0], mean 2/3, std sqrt(1/3) = 0.5774
                        -> a +0.577 per row, b -1.155, so a long trajectory tilted the group
    """
    a = _episode("a", [_step([1, 2], [3]), _step([9, 9], [4])], reward=1.0)
    b = _episode("b", [_step([1, 2], [5])], reward=0.0)
    assert _row_advantages([a, b]) == pytest.approx([S2, S2, -S2], abs=1e-5)
    # rloo and reinforce_plus_plus_baseline count a once as well: rloo 2/1 * (1 - 0.5) = +1 and -1
    assert _row_advantages([a, b], estimator="rloo") == pytest.approx([1.0, 1.0, -1.0])


def test_case2_normalize_by_steps_divides_broadcast_by_the_step_count():
    """`broadcast` + `normalize_by_steps` (rLLM): A_step = A_traj / K, K = the trajectory's steps (not rows).

    One task. Trajectory a (reward 1) has 2 steps; the second prompt extends the first, so both
    steps merge into 1 row. Trajectory b (reward 0) has 1 step.
        A_traj: +0.7071 (a), -0.7071 (b)            (GRPO over [1, 0], as in case 1)
        a: K = 2 steps -> 0.7071 / 2 = +0.3536       (dividing by its 1 row would leave 0.7071)
        b: K = 1       -> -0.7071
    per_step + normalize_by_steps is refused at config time (see test_checks).
    """
    a = _episode("a", [_step([1, 2], [3]), _step([1, 2, 3, 7], [4])], reward=1.0)
    b = _episode("b", [_step([1, 2], [5])], reward=0.0)
    options = dict(stepwise_mode="broadcast", normalize_by_steps=True)
    assert _row_advantages([a, b], **options) == pytest.approx([S2 / 2, -S2], abs=1e-5)


def test_case3_per_step_lone_positions_keep_their_return():
    """`per_step`: a position only one trajectory reached is a group of one, which verl scores as itself.

    gamma 1, one task. A has 1 step (reward 0), B has 3 steps (reward 1, on its last step).
        returns: A [0]; B [1, 1, 1]
        position 0: [0 (A), 1 (B)] -> -0.7071, +0.7071
        positions 1 and 2: B alone -> mean 0, std 1 -> 1 / (1 + 1e-6)  (it was 0 before: B's
        answering step learned nothing)
    """
    a = _episode("A", [_step([1], [2])], reward=0.0)
    b = _episode("B", [_step([1], [2]), _step([1, 2, 3], [4]), _step([1, 2, 3, 4, 5], [6])], reward=1.0)
    advantages = _row_advantages([a, b], merge_steps=False, stepwise_mode="per_step")
    assert advantages == pytest.approx([-S2, S2, 1 / (1 + EPS), 1 / (1 + EPS)], abs=1e-5)


def test_case3_per_step_positions_do_not_shift_when_a_step_is_excluded():
    """Positions come from the step's index in its trajectory, not from the count of kept rows.

    gamma 1, one task, three trajectories of 3 steps. C (reward 1) lost step 1 (trace mismatch);
    D (reward 0) and E (reward 1) kept all. Returns: C [1, -, 1]; D [0, 0, 0]; E [1, 1, 1].
        position 0: C 1, D 0, E 1: mean 2/3, std sqrt(1/3) -> C +0.5774, D -1.1547, E +0.5774
        position 1: D 0, E 1                 -> D -0.7071, E +0.7071
        position 2: C 1, D 0, E 1            -> C +0.5774, D -1.1547, E +0.5774
    Counting kept rows instead would put C's step 2 at position 1 and give D's step 1 -1.1547.
    """
    steps = [_step([1], [2]), _step([1, 2, 3], [4]), _step([1, 2, 3, 4, 5], [6])]
    c_steps = [steps[0], steps[1].model_copy(update={"info": {"excluded": "trace_mismatch"}}), steps[2]]
    c = _episode("C", c_steps, reward=1.0)
    d = _episode("D", list(steps), reward=0.0)
    e = _episode("E", list(steps), reward=1.0)
    advantages = _row_advantages([c, d, e], merge_steps=False, stepwise_mode="per_step")
    expected = [S3, S3, -2 * S3, -S2, -2 * S3, S3, S2, S3]  # rows: C0 C2 D0 D1 D2 E0 E1 E2
    assert advantages == pytest.approx(expected, abs=1e-5)


def test_case8_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens_over_tokens():
    """reinforce_plus_plus_baseline (verl's formula).

    Rows (scores on the last valid token): group 0 = row 0 (score 1, 2 tokens), row 1 (score 0,
    2 tokens); group 1 = row 2 (score 1, 1 token, a group of one).
        centred scores: group 0 mean 0.5 -> +0.5, -0.5; group 1 alone -> mean 0 -> 1
        on tokens: [0.5, 0.5, -0.5, -0.5, 1]; mean 0.2; deviations [0.3, 0.3, -0.7, -0.7, 0.8]
        unbiased var = (0.09 + 0.09 + 0.49 + 0.49 + 0.64) / 4 = 0.45, std = 0.670820
        A = [0.447214, 0.447214, -1.043498, -1.043498, 1.192570]
    """
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    res = compute_advantages(
        "reinforce_plus_plus_baseline",
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([0, 0, 1]),
    )
    expected = torch.tensor([[0.447214, 0.447214], [-1.043498, -1.043498], [1.192570, 0.0]])
    torch.testing.assert_close(res.advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.returns, res.advantages)


def test_case8_masked_reinforce_plus_plus_return_resets_at_the_gap():
    """REINFORCE++ returns do not carry across a masked gap (verl multiplies the running return by the mask).

    gamma 1. Row 0: tokens [model, observation, model], reward 1 on the last token.
    Row 1: three model tokens, reward 1 on the last.
        row 0: G_2 = 1; the observation at t=1 resets the running return; G_0 = 0 + 1 * 0 = 0
               (skipping the gap instead would give G_0 = 1)
        row 1: G = [1, 1, 1]
        valid G = [0, 1, 1, 1, 1]: mean 0.8, unbiased var (0.64 + 4 * 0.04) / 4 = 0.2, std 0.447214
        A = [(0 - 0.8) / 0.447214, (1 - 0.8) / 0.447214] = [-1.788854, 0.447214]
    """
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[True, False, True], [True, True, True]])
    res = compute_advantages(
        "reinforce_plus_plus", token_rewards=rewards, response_mask=mask, group_ids=torch.arange(2)
    )
    torch.testing.assert_close(res.returns, torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))
    a, b = -1.788854, 0.447214
    torch.testing.assert_close(res.advantages, torch.tensor([[a, 0.0, b], [b, b, b]]), atol=1e-5, rtol=0)
    # plain `reinforce` keeps skipping the gap: G_0 of row 0 is the reward behind the observation
    plain = compute_advantages(
        "reinforce", token_rewards=rewards, response_mask=mask, group_ids=torch.arange(2)
    )
    assert plain.returns[0].tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_accept_sample_ids_and_reject_a_sample_in_two_groups(estimator):
    """A sample (trajectory) must sit in one group; rows of one sample in two groups are an error."""
    rewards, mask = torch.ones(2, 1), torch.ones(2, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="same sample_ids must have the same group_ids"):
        compute_advantages(
            estimator,
            token_rewards=rewards,
            response_mask=mask,
            group_ids=torch.tensor([0, 1]),
            sample_ids=torch.tensor([3, 3]),
        )


@pytest.mark.parametrize("mode", ["broadcast", "per_step"])
def test_case5_gae_with_stepwise_advantages_is_refused_at_config_time(mode):
    """gae needs token-level critic values; step-wise modes give each step one scalar.

    Before, the run passed validation and failed inside step 1, after rollouts and the value
    pass. Now validate_config names both keys and the way out.
    """
    with pytest.raises(ConfigError) as info:
        validate_config(
            {
                "algorithm": {"adv_estimator": "gae"},
                "agent": {"stepwise_advantage": {"enable": True, "mode": mode}},
            }
        )
    (problem,) = info.value.problems
    assert "algorithm.adv_estimator=gae" in problem and "agent.stepwise_advantage.enable=true" in problem
    assert f"mode={mode}" in problem and "agent.stepwise_advantage.enable=false" in problem
    # the estimators it suggests are accepted
    validate_config(
        {"algorithm": {"adv_estimator": "grpo"}, "agent": {"stepwise_advantage": {"enable": True}}}
    )


def _trace(call: int, finish_reason: str) -> Trace:
    return Trace(
        session_id="s",
        request_id=f"r{call}",
        prompt_ids=[1, 2],
        completion_ids=[3],
        logprobs=[-0.1],
        finish_reason=finish_reason,
    )


def test_case4_a_cut_off_middle_turn_ends_the_episode_as_max_response_length_exceeded():
    """Finish reasons ["length", "stop"]: turn 1 was cut at the limit, turn 2 answered normally.

    The agent acted on a truncated answer, so the episode is max_response_length_exceeded (it was
    env_done, which only looked at the last call), and compact filtering with its default
    mask_max_response_length_exceeded=true drops it; ["stop", "stop"] stays env_done and is kept.
    """
    limits = CollectorLimits(max_steps=8, max_prompt_length=100)
    cut = classify_termination(Episode(), [_trace(0, "length"), _trace(1, "stop")], limits)
    clean = classify_termination(Episode(), [_trace(0, "stop"), _trace(1, "stop")], limits)
    assert cut == TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED
    assert clean == TerminationReason.ENV_DONE
    masked = build_masked_reasons(mask_max_response_length_exceeded=True)
    assert compact_filter_keep([cut, clean], masked) == [False, True]


# Case 6: three kinds of task, two episodes each. The flow answers each task's scripted scores in turn; the
# evaluator takes the score as reward and calls >= 0.5 correct.
SCRIPT = {"all": [1.0, 0.5], "none": [0.0, 0.0], "partial": [1.0, 0.0]}


def _scored_episodes(kinds: list[str]) -> list[Episode]:
    episodes = []
    for kind in kinds:
        for reward in SCRIPT[kind]:
            episodes.append(Episode(task_id=kind, reward=reward, is_correct=reward >= 0.5))
    return episodes


def test_case6_rejection_modes_and_solve_fractions():
    """uniform_reward drops tasks with equal rewards; solve_partial drops all-solved and none-solved tasks.

    Tasks: "all" (rewards [1, 0.5], both correct), "none" ([0, 0]), "partial" ([1, 0], one correct).
        uniform_reward: all (1 != 0.5) kept, none dropped, partial kept   -> keep [T, T, F, F, T, T]
        solve_partial:  all dropped (all solved), none dropped, partial kept -> keep [F, F, F, F, T, T]
        solve fractions over the 3 tasks: solve_all 1/3, solve_none 1/3, solve_partial 1/3
    """
    episodes = _scored_episodes(["all", "none", "partial"])
    inputs = dict(
        rewards=torch.tensor([e.reward for e in episodes]),
        is_correct=torch.tensor([e.is_correct for e in episodes]),
        group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
    )
    assert rejection_sample_keep("uniform_reward", **inputs).tolist() == [
        True,
        True,
        False,
        False,
        True,
        True,
    ]
    assert rejection_sample_keep("solve_partial", **inputs).tolist() == [
        False,
        False,
        False,
        False,
        True,
        True,
    ]
    metrics = compute_episode_metrics(episodes)
    fractions = (metrics["batch/solve_all"], metrics["batch/solve_none"], metrics["batch/solve_partial"])
    assert fractions == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert metrics["batch/num_tasks"] == 3


class _NoGateway:
    """A session backend for flows that never call the model: no traces, nothing refused."""

    def open_session(self, session_id: str, mode: str, max_calls: int | None = None) -> str:
        return "http://127.0.0.1:9/v1"

    def refused_calls(self, session_id: str) -> int:
        return 0

    def refused_prompts(self, session_id: str) -> int:
        return 0

    def session_traces(self, session_id: str) -> list:
        return []

    def close_session(self, session_id: str) -> None:
        pass


def _refill_controller(tmp_path, kinds: list[str], mode: str, multiplier: int) -> Controller:
    answered: dict[str, int] = {}

    @agent_flow
    async def scripted(task, ctx):
        count = answered.get(task.id, 0)
        answered[task.id] = count + 1
        return str(SCRIPT[task["kind"]][count % 2])

    @evaluator
    def score(task, episode):
        reward = float(episode.answer)
        return EvalOutput(reward=reward, is_correct=reward >= 0.5)

    config = validate_config(
        {
            "data": {"train_batch_size": 2, "shuffle": False},
            "actor_rollout_ref": {"rollout": {"n": 2}, "actor": {"ppo_mini_batch_size": 2}},
            "agent": {"rejection_sample": {"enable": True, "mode": mode, "multiplier": multiplier}},
            "trainer": {"default_local_dir": str(tmp_path)},
        }
    )
    rows = [{"kind": kind, "extra_info": {"index": i}} for i, kind in enumerate(kinds)]
    controller = Controller(config, scripted, score, rows, None)
    controller.collector = RolloutCollector(_NoGateway(), "policy", CollectorLimits())
    controller.n = 2
    return controller


# Rounds of train_batch_size=2 tasks: [all, partial], [none, none], [partial, all], [partial, partial]
ROUNDS = ["all", "partial", "none", "none", "partial", "all", "partial", "partial"]


def test_case6_controller_refills_until_enough_partially_solved_tasks(tmp_path):
    """solve_partial with multiplier 3: round 1 gives 1 partial task, round 2 none, round 3 one more.

    After round 3 the 2 (= data.train_batch_size) partially solved tasks are there, so it stops: 3 rounds,
    12 episodes collected, 4 kept (tasks 1 and 4). uniform_reward keeps task 0 ("all": rewards 1 and 0.5
    differ) next to task 1 and stops after round 1.
    """
    controller = _refill_controller(tmp_path, ROUNDS, "solve_partial", multiplier=3)
    collected, kept = controller.collect_training_episodes()
    assert len(collected) == 12
    assert sorted({e.task_id for e in kept}) == ["train-1", "train.r2-4"]
    assert len(kept) == 4
    controller = _refill_controller(tmp_path, ROUNDS, "uniform_reward", multiplier=3)
    collected, kept = controller.collect_training_episodes()
    assert len(collected) == 4 and sorted({e.task_id for e in kept}) == ["train-0", "train-1"]


def test_case6_controller_stops_at_multiplier_rounds(tmp_path):
    """solve_partial with multiplier 2: rounds 1 and 2 give one partially solved task; it stops there."""
    controller = _refill_controller(tmp_path, ROUNDS, "solve_partial", multiplier=2)
    collected, kept = controller.collect_training_episodes()
    assert len(collected) == 8
    assert {e.task_id for e in kept} == {"train-1"}
