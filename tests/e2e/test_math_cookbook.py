"""The math cookbook as a user runs it: `python cookbooks/math/train.py <overrides>` in a subprocess.

Needs `agentrl_math` installed (`make setup` installs `cookbooks/math` editable). Small overrides keep each
run to seconds on CPU: the 2-layer tiny preset, 2 questions x 2 samples per step, 4 validation questions.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.data import sample_path
from agentrl.runs.history import read_metrics_history

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "cookbooks" / "math" / "train.py"


def _run_train(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    val = tmp_path / "val.jsonl"
    val.write_text("".join(Path(sample_path("gsm8k_test")).read_text().splitlines(keepends=True)[:4]))
    run_dir = tmp_path / "run"
    overrides = [
        "actor_rollout_ref.model.path=tiny:qwen2-mini",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=24",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        f"data.val_files={val}",
        *extra,
    ]
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, run_dir


@pytest.mark.slow
def test_train_py_two_steps(tmp_path):
    proc, run_dir = _run_train(tmp_path, "trainer.total_training_steps=2")
    assert (run_dir / "checkpoints" / "global_step_2").is_dir()
    assert (run_dir / "hf_model" / "config.json").is_file()
    history = read_metrics_history(run_dir)
    assert [r["step"] for r in history if r["step"] > 0] == [1, 2]
    # Validation ran before training (step 0) and after the last step, on the 4 rows of data.val_files.
    assert history[0]["step"] == 0 and history[0]["val/num_episodes"] == 4
    assert history[-1]["val/num_episodes"] == 4
    assert history[-1]["batch/trace_mismatch"] == 0
    assert "held-out accuracy: before" in proc.stdout


@pytest.mark.slow
def test_train_py_self_check_flow_makes_two_traced_calls(tmp_path):
    _, run_dir = _run_train(
        tmp_path,
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "agent.flow=agentrl_math.flow:SelfCheckFlow",
    )
    (step,) = read_metrics_history(run_dir)
    assert step["episode/model_calls/mean"] == 2.0 and step["episode/model_calls/min"] == 2.0
    assert step["batch/trace_mismatch"] == 0 and step["batch/excluded_steps"] == 0
    # 4 episodes x 2 turns: each turn is a row unless it merged into the row of the turn before.
    assert step["batch/rows"] + step["batch/merged_steps"] == 8


def test_invalid_override_names_the_key(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "trainer.total_trainig_steps=2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "trainer.total_trainig_steps" in proc.stderr
    assert "trained" not in proc.stdout
