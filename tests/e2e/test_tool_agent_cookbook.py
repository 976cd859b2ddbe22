"""The tool-agent cookbook as a user runs it: `python cookbooks/tool_agent/train.py <overrides>` in a subprocess.

Needs `agentrl_tool_agent` installed (`make setup` installs `cookbooks/tool_agent` editable). A short two-stage
warm start (rows without the tool preamble, then with it) teaches the tiny policy to open a tool call; with
`agent.max_steps=1` the gateway then refuses the call that would read the tool's result, so the run hits the
step cap for real and the metrics must say so.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from agentrl_tool_agent.prepare_data import SAMPLES

from agentrl.runs.history import read_metrics_history

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "cookbooks" / "tool_agent" / "train.py"


@pytest.mark.slow
def test_train_py_warm_start_then_grpo_hits_the_step_cap_and_logs_tool_calls(tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("".join((SAMPLES / "test.jsonl").read_text().splitlines(keepends=True)[:4]))
    run_dir = tmp_path / "run"
    overrides = [
        "--short-prompt-steps=60",
        "sft.max_steps=20",
        "sft.batch_size=8",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=1",
        "agent.max_steps=1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        f"data.val_files={val}",
    ]
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert (run_dir / "warm_start" / "short_prompts" / "sft_model" / "config.json").is_file()
    assert (run_dir / "warm_start" / "sft_model" / "config.json").is_file()
    assert "held-out accuracy " in proc.stdout and " -> " in proc.stdout
    history = read_metrics_history(run_dir)
    step = next(r for r in history if r["step"] == 1)
    reasons = {k: v for k, v in step.items() if k.startswith("batch/termination_reason/")}
    assert sum(reasons.values()) == pytest.approx(1.0)
    # The warm-started policy calls a tool first; its second call is beyond agent.max_steps=1.
    assert step["batch/tool_calls"] > 0
    assert reasons.get("batch/termination_reason/max_turns_exceeded", 0.0) > 0
    assert step["batch/answered"] < 1.0
    assert history[-1]["val/num_episodes"] == 4 and "val/tool_calls" in history[-1]
    assert step["batch/trace_mismatch"] == 0
