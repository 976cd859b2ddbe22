"""Rollout records: what one episode's line holds, which episodes a fraction keeps, and the file a step writes."""

from __future__ import annotations

import json

from agentrl.runs.rollout_writer import RolloutLog, episode_record, is_sampled, rollout_file_name
from agentrl.types import Episode, Step, TerminationReason, Trajectory

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
SYSTEM = {"role": "system", "content": "Use the tools."}
USER = {"role": "user", "content": "What is 2 + 3?"}


def _tool_episode() -> Episode:
    """Two model calls: the first calls `add`, the second sees the tool result and answers."""
    first = Step(
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        logprobs=[-0.1, -0.2],
        messages=[SYSTEM, USER],
        model_response="",
        tool_calls=[CALL],
        finish_reason="tool_calls",
        advantage=0.5,
        info={"policy_version": 3, "latency_s": 0.25, "row": 0},
    )
    echoed = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    second = Step(
        prompt_ids=[1, 2, 3, 4, 5, 6],
        response_ids=[7],
        logprobs=[-0.3],
        messages=[SYSTEM, USER, echoed, result],
        model_response="5",
        finish_reason="stop",
        advantage=0.5,
        info={"policy_version": 4, "latency_s": 0.5, "row": 0},
    )
    return Episode(
        id="train-7:1",
        task_id="train-7",
        task={"data_source": "calc"},
        trajectories=[Trajectory(name="solver", steps=[first, second], reward=1.0)],
        answer="5",
        termination_reason=TerminationReason.ENV_DONE,
        is_correct=True,
        reward=1.0,
    )


def test_a_multi_turn_tool_episode_keeps_each_message_once():
    record = episode_record(_tool_episode(), step=3, split="train", config_digest="abc")
    assert record["format_version"] == 1 and record["step"] == 3 and record["data_source"] == "calc"
    assert record["advantage"] == 0.5 and record["policy_version"] == 3
    assert record["filtered"] is False and record["filter_reason"] is None
    first, second = record["trajectories"][0]["steps"]
    assert first["messages"] == [SYSTEM, USER] and first["continues_previous"] is False
    assert first["tool_calls"] == [CALL] and first["response_ids"] == [4, 5]
    # The second request repeats the first and its reply: only the tool result is new.
    assert second["continues_previous"] is True
    assert second["messages"] == [{"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    assert second["response"] == "5" and second["policy_version"] == 4 and second["latency_s"] == 0.5
    json.dumps(record)  # JSON-ready as is


def test_filter_reason_and_untrained_steps_are_recorded():
    episode = _tool_episode()
    episode.filter_reason = "rejection_sampling"
    for step in episode.trajectories[0].steps:
        step.advantage = None
    record = episode_record(episode, step=1, split="train", config_digest="abc")
    assert record["filtered"] is True and record["filter_reason"] == "rejection_sampling"
    assert record["advantage"] is None


def test_inline_images_are_cut():
    episode = _tool_episode()
    image = "data:image/png;base64," + "A" * 10_000
    episode.trajectories[0].steps[0].messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}
    ]
    record = episode_record(episode, step=1, split="train", config_digest="abc")
    url = record["trajectories"][0]["steps"][0]["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,AAAA") and url.endswith("(9958 characters not saved)")


def test_a_fraction_keeps_that_share_by_episode_id_and_zero_keeps_none():
    ids = [f"train-{i}:{k}" for i in range(500) for k in range(4)]
    kept = [e for e in ids if is_sampled(e, 5, "train", 0.25)]
    assert 0.22 < len(kept) / len(ids) < 0.28
    assert kept == [e for e in ids if is_sampled(e, 5, "train", 0.25)]  # the same on a rerun
    assert kept != [e for e in ids if is_sampled(e, 6, "train", 0.25)]  # another step, another sample
    assert all(is_sampled(e, 5, "train", 1.0) for e in ids)
    assert not any(is_sampled(e, 5, "train", 0.0) for e in ids)


def test_traces_go_out_every_trace_freq_steps_and_on_the_last_step(tmp_path):
    seen = []
    log = RolloutLog(
        tmp_path,
        fraction=1.0,
        config_digest="abc",
        on_records=lambda r, s: seen.append(s),
        trace_freq=3,
        last_step=7,
    )
    for step in range(8):
        log.write(step, [_tool_episode()])
    assert seen == [0, 3, 6, 7]
    assert len(list(tmp_path.glob("step_*.jsonl"))) == 8  # every step is saved all the same
    never = RolloutLog(
        tmp_path, fraction=1.0, config_digest="abc", on_records=lambda r, s: seen.append(s), trace_freq=-1
    )
    never.write(7, [_tool_episode()])
    assert seen == [0, 3, 6, 7]


def test_a_traced_step_hands_on_its_first_episodes_up_to_the_cap_and_saves_them_all(tmp_path):
    episodes = [_tool_episode().model_copy(update={"id": f"train-7:{i}"}) for i in range(5)]
    ids = [e.id for e in episodes]
    seen = []

    def log_with(cap: int) -> RolloutLog:
        return RolloutLog(
            tmp_path / str(cap),
            fraction=1.0,
            config_digest="abc",
            on_records=lambda records, step: seen.append([r["episode_id"] for r in records]),
            trace_freq=1,
            trace_max_episodes=cap,
        )

    path = log_with(3).write(1, episodes)
    assert seen == [ids[:3]]  # the first three, in the file's order (a task's answers together)
    assert [json.loads(line)["episode_id"] for line in path.read_text().splitlines()] == ids
    log_with(-1).write(1, episodes)
    log_with(8).write(1, episodes)
    assert seen[1:] == [ids, ids]


def test_a_step_file_is_replaced_whole_and_fraction_zero_writes_nothing(tmp_path):
    seen = []
    log = RolloutLog(
        tmp_path / "r", fraction=1.0, config_digest="abc", on_records=lambda r, s: seen.append(s)
    )
    path = log.write(2, [_tool_episode(), _tool_episode()])
    assert path == tmp_path / "r" / rollout_file_name(2, "train") == tmp_path / "r" / "step_000002.jsonl"
    assert len(path.read_text().splitlines()) == 2 and seen == [2]
    log.write(2, [_tool_episode()])  # a resumed run redoing step 2
    assert len(path.read_text().splitlines()) == 1
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["step_000002.jsonl"]  # no temporary left
    assert log.write(0, [_tool_episode()], split="val").name == "val_step_000000.jsonl"
    off = RolloutLog(
        tmp_path / "off", fraction=0.0, config_digest="abc", on_records=lambda r, s: seen.append(s)
    )
    assert off.write(1, [_tool_episode()]) is None and not (tmp_path / "off").exists()
    assert seen == [2, 2, 0]
