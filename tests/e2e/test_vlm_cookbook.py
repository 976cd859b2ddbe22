"""The VLM cookbook as a user runs it: `python cookbooks/vlm/train.py <overrides>` in a subprocess.

Needs `agentrl_vlm` installed (`make setup` installs `cookbooks/vlm` editable). A shortened run: pictures are
drawn under the run folder, the warm start teaches the one-digit format, GRPO runs a few steps with the
two-turn ZoomFlow (its answer rows hold two images), and the trainer's log-probs match the engine's. Runs on the
config's model (tiny:qwen2-vl) and on tiny:qwen3-vl (about a minute each on 2 CPU cores).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.runs.history import read_metrics_history

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "cookbooks" / "vlm" / "train.py"


@pytest.mark.slow
@pytest.mark.parametrize("model", [None, "tiny:qwen3-vl"], ids=["config-qwen2-vl", "qwen3-vl"])
def test_train_py_draws_pictures_warm_starts_and_trains(tmp_path, model):
    run_dir = tmp_path / "run"
    overrides = [
        *([f"actor_rollout_ref.model.path={model}"] if model else []),
        "trainer.total_training_steps=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "sft.max_steps=8",
        "agent.flow=agentrl_vlm.flow:ZoomFlow",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert len(list((run_dir / "data" / "images").glob("*.png"))) == 256 + 200
    assert "held-out accuracy " in proc.stdout and " -> " in proc.stdout
    history = read_metrics_history(run_dir)
    before = next(r for r in history if r["step"] == 0 and "val/answered" in r)
    assert before["val/answered"] > 0.5  # the warm start taught the one-digit format
    steps = [r for r in history if r["step"] in (1, 2) and "actor/pg_loss" in r]
    assert len(steps) == 2
    for step in steps:
        # Look and answer rows, with their images.
        assert step["batch/rows"] >= step["batch/kept_episodes"] == 16
        assert step["rollout/logprob_diff_max"] < 1e-3
