"""GRPO on tiny:qwen2-vl and tiny:qwen3-vl from image rows: pixels reach the engine and the update, whose log-probs match the engine's.

Rows are verl-format Python rows with PIL images beside `<image>` placeholders; the flow makes two calls (the
second adds a crop of the picture), so merged rows carry several images. With one on-policy mini-batch the
update skips the old-log-prob pass and reports the trainer-vs-engine log-prob gap, which must be tiny: the
training forward used the same pixels and the model's mrope positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from agentrl import AgentTrainer, agent_flow, evaluator
from agentrl.data.images import build_image_messages, encode_data_url

pytestmark = pytest.mark.slow


def _rows(count: int) -> list[dict]:
    rows = []
    for k in range(count):
        image = Image.new("RGB", (84 + 14 * k, 56), "white")
        ImageDraw.Draw(image).rectangle((8, 8, 30 + 5 * k, 40), fill=("red", "blue", "green", "black")[k % 4])
        rows.append(
            {
                "prompt": [{"role": "user", "content": "<image>How many shapes?"}],
                "images": [image],
                "data_source": "shapes",
                "reward_model": {"ground_truth": "1"},
            }
        )
    return rows


@agent_flow
async def look_then_answer(task, ctx):
    messages = build_image_messages(task["prompt"], task.get("images"), f"task {task.id}")
    first = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
    crop = task["images"][0].crop((0, 0, 56, 56))
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": encode_data_url(crop)}},
                {"type": "text", "text": "Zoomed. Answer:"},
            ],
        },
    ]
    second = await ctx.client.chat.completions.create(model=ctx.model, messages=messages)
    return second.choices[0].message.content or ""


@evaluator
def odd_length(task, episode):
    """Any score that varies between samples, so group advantages are not all zero."""
    return float(len(episode.answer or "") % 2)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("model", ["tiny:qwen2-vl", "tiny:qwen3-vl"])
def test_grpo_on_image_rows_runs_two_steps(tmp_path: Path, model: str, lora: bool):
    run_dir = tmp_path / "run"
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        "data.return_multi_modal_inputs=true",
        "data.train_batch_size=2",
        "data.shuffle=false",
        "data.max_prompt_length=512",
        "actor_rollout_ref.rollout.n=2",
        "data.max_response_length=6",
        "trainer.total_training_steps=2",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.val_before_train=false",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        *(["actor_rollout_ref.model.lora_rank=8"] if lora else []),
    ]
    AgentTrainer(
        flow=look_then_answer, evaluator=odd_length, train_dataset=_rows(4), config=overrides
    ).train()
    history = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    steps = {r["step"]: r for r in history if "actor/pg_loss" in r}
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert record["batch/kept_episodes"] == 4.0
        assert record["rollout/logprob_diff_max"] < 1e-3, record["rollout/logprob_diff_max"]
