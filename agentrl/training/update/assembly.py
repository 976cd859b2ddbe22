"""Assembly: episodes into training rows, and rows into one padded batch of tensors.

Token in, token out: a row is made of exactly the token ids the engine saw and produced. Consecutive steps
of a trajectory whose prompt extends the previous prompt plus completion merge into one row, with loss mask
1 on model tokens and 0 on everything else (observations, tool results, the template). A step that does not
extend starts a new row. Rows carry the rollout engine's logprobs so the trainer can compare policies.

Rows of a vision-language policy carry the pixels behind their image pads (`multi_modal_inputs`), rebuilt
from the resized images the engine saw (`Step.images`, see `agentrl.data.images.build_pixel_inputs`); a
merged row holds the images of its last step, whose prompt extends (and so holds) all earlier ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.types import Episode, logprob_count_problem


@dataclass
class TrainingRow:
    """One training sequence: tokens, which of them the model produced, and what they scored."""

    input_ids: list[int]
    response_mask: list[int]
    rollout_log_probs: list[float]
    reward: float
    group_key: str
    """Rows sharing a key are compared for group advantages: task id and trajectory name."""
    trajectory_key: str
    """Rows of one trajectory share it (step-wise broadcast gives them one advantage)."""
    step_index: int = 0
    """Index, in its trajectory's `steps`, of the row's first step (excluded steps keep their place)."""
    num_steps: int = 1
    """Trainable steps of the row's trajectory (excluded ones not counted)."""
    episode_index: int = 0
    images: list[str] = field(default_factory=list)
    """The resized images behind the row's image pads (PNG data URLs, in order); empty for text rows."""
    multi_modal_inputs: dict[str, torch.Tensor] | None = None
    """`pixel_values` and `image_grid_thw` of `images` (set by `rows_to_batch`); None for text rows."""


@dataclass
class AssemblyStats:
    rows: int = 0
    merged_steps: int = 0
    excluded_steps: int = 0
    truncated_rows: int = 0


@dataclass
class TrainBatch:
    """Padded tensors for one update, all (B, L) unless noted; position t holds token t.

    `response_mask[b, t]` (bool) is True where token t was sampled by the policy; log-prob tensors hold
    log p(token t | tokens < t) at the same position.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    token_rewards: torch.Tensor
    """Each row's reward on its last response token."""
    rewards: torch.Tensor
    """(B,) the row's scalar reward."""
    group_ids: torch.Tensor
    """(B,) long: rows with the same id form one advantage group."""
    trajectory_ids: torch.Tensor
    """(B,) long: rows of one trajectory."""
    step_index: torch.Tensor
    """(B,) long: index of the row's first step in its trajectory (excluded steps keep their place)."""
    num_steps: torch.Tensor
    """(B,) long: trainable steps in the row's trajectory (not rows: merged steps count one each)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Filled by the loop: old_log_probs, ref_log_probs, values, advantages, returns, and behaviour_weights
    (off-policy correction, `ppo_update.attach_behaviour_weights`) when algorithm.rollout_correction.tis_mode is set."""
    multi_modal_inputs: list[dict[str, torch.Tensor] | None] | None = None
    """Per row: `pixel_values` (patches, C*T*P*P) and `image_grid_thw` (images, 3) long, or None for a
    text row; None for a text-only batch."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def select(self, index: torch.Tensor, trim: bool = True) -> TrainBatch:
        """The rows at `index`, trimmed to their longest sequence (or kept at the batch's length)."""
        length = self.input_ids.shape[1]
        if trim and len(index):
            length = int(self.attention_mask[index].sum(dim=1).max().item())

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[index][:, :length] if t.dim() == 2 else t[index]

        images = self.multi_modal_inputs
        return TrainBatch(
            **{name: cut(getattr(self, name)) for name in _FIELDS},
            tensors={k: cut(v) for k, v in self.tensors.items()},
            multi_modal_inputs=None if images is None else [images[i] for i in index.tolist()],
        )


_FIELDS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "rollout_log_probs",
    "token_rewards",
    "rewards",
    "group_ids",
    "trajectory_ids",
    "step_index",
    "num_steps",
)


def episodes_to_rows(
    episodes: Sequence[Episode], *, merge_steps: bool = True, max_length: int | None = None
) -> tuple[list[TrainingRow], AssemblyStats]:
    """Rows for every trainable step of every episode (steps marked `excluded` are skipped).

    Each trainable step's `info["row"]` is set to the index of the row that holds it.
    """
    rows: list[TrainingRow] = []
    stats = AssemblyStats()
    for e_index, episode in enumerate(episodes):
        for trajectory in episode.trajectories:
            for step in trajectory.steps:
                if logprob_count_problem(step.response_ids, step.logprobs):
                    step.info["excluded"] = "logprob_count_mismatch"
            # Keep each step's index in the trajectory: an excluded step must not shift the positions
            # that per_step compares across sibling trajectories.
            steps = [
                (i, s) for i, s in enumerate(trajectory.steps) if s.response_ids and "excluded" not in s.info
            ]
            stats.excluded_steps += len(trajectory.steps) - len(steps)
            reward = trajectory.reward if trajectory.reward is not None else episode.reward
            traj_key = f"{episode.id}/{trajectory.name}"
            current: TrainingRow | None = None
            for k, (s_index, step) in enumerate(steps):
                context = current.input_ids if current is not None else None
                if merge_steps and context is not None and step.prompt_ids[: len(context)] == context:
                    step.info["row"] = len(rows) - 1
                    observation = step.prompt_ids[len(context) :]
                    current.input_ids += observation + step.response_ids
                    current.response_mask += [0] * len(observation) + [1] * len(step.response_ids)
                    current.rollout_log_probs += [0.0] * len(observation) + list(step.logprobs)
                    current.images = list(step.images)
                    stats.merged_steps += 1
                    continue
                current = TrainingRow(
                    input_ids=list(step.prompt_ids) + list(step.response_ids),
                    response_mask=[0] * len(step.prompt_ids) + [1] * len(step.response_ids),
                    rollout_log_probs=[0.0] * len(step.prompt_ids) + list(step.logprobs),
                    reward=reward if merge_steps else _step_reward(step.reward, reward, k, len(steps)),
                    group_key=f"{episode.task_id}/{trajectory.name}",
                    trajectory_key=traj_key,
                    step_index=s_index,
                    num_steps=len(steps),
                    episode_index=e_index,
                    images=list(step.images),
                )
                step.info["row"] = len(rows)
                rows.append(current)
    for row in rows:
        if max_length is not None and len(row.input_ids) > max_length:
            del row.input_ids[max_length:], row.response_mask[max_length:], row.rollout_log_probs[max_length:]
            stats.truncated_rows += 1
    stats.rows = len(rows)
    return rows, stats


def write_step_advantages(episodes: Sequence[Episode], batch: TrainBatch) -> None:
    """Give every trained step of `episodes` (those `episodes_to_rows` built `batch` from) its row's advantage.

    A step's advantage is the mean of `batch["advantages"]` (B, L) over its row's response tokens (the
    whole row's, when steps merged into one row); steps that made no row keep None. It is what the saved
    rollouts show (docs/rollouts.md); training never reads it.
    """
    mask = batch.response_mask.float()
    per_row = ((batch["advantages"] * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).tolist()
    for episode in episodes:
        for trajectory in episode.trajectories:
            for step in trajectory.steps:
                row = step.info.get("row")
                if row is not None and "excluded" not in step.info:
                    step.advantage = per_row[row]


def _step_reward(step_reward: float, outcome: float, index: int, num_steps: int) -> float:
    """Per-step rows: the step's own reward, plus the trajectory's outcome on its last step."""
    return step_reward + (outcome if index == num_steps - 1 else 0.0)


def rows_to_batch(rows: Sequence[TrainingRow], pad_token_id: int, image_processor: Any = None) -> TrainBatch:
    """Right-padded (B, L) tensors; group and trajectory keys become dense integer ids.

    Rows with images get their pixel inputs from `image_processor` (the policy's, needed then).
    """
    if not rows:
        raise ValueError("no training rows: every episode was filtered out or failed")
    if any(r.images for r in rows):
        if image_processor is None:
            raise ValueError(
                "rollouts hold images but no image processor was given: set data.return_multi_modal_inputs=true "
                "with a vision-language actor_rollout_ref.model.path"
            )
        from agentrl.data.images import build_pixel_inputs

        for row in rows:
            row.multi_modal_inputs = build_pixel_inputs(image_processor, row.images) if row.images else None
    length = max(len(r.input_ids) for r in rows)
    batch_size = len(rows)
    input_ids = torch.full((batch_size, length), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch_size, length), dtype=torch.long)
    response = torch.zeros((batch_size, length), dtype=torch.bool)
    logprobs = torch.zeros((batch_size, length), dtype=torch.float32)
    token_rewards = torch.zeros((batch_size, length), dtype=torch.float32)
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        input_ids[b, :n] = torch.tensor(row.input_ids)
        attention[b, :n] = 1
        response[b, :n] = torch.tensor(row.response_mask, dtype=torch.bool)
        logprobs[b, :n] = torch.tensor(row.rollout_log_probs)
        last = max((i for i, m in enumerate(row.response_mask) if m), default=None)
        if last is not None:
            token_rewards[b, last] = row.reward
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response,
        rollout_log_probs=logprobs,
        token_rewards=token_rewards,
        rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
        group_ids=dense_ids([r.group_key for r in rows]),
        trajectory_ids=dense_ids([r.trajectory_key for r in rows]),
        step_index=torch.tensor([r.step_index for r in rows], dtype=torch.long),
        num_steps=torch.tensor([r.num_steps for r in rows], dtype=torch.long),
        multi_modal_inputs=[r.multi_modal_inputs for r in rows] if any(r.images for r in rows) else None,
    )


def dense_ids(keys: Iterable[str]) -> torch.Tensor:
    """(N,) long: equal keys share an id, numbered in order of first appearance."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)
