"""Ctrl-C and reruns as a user meets them: `agentrl train`, stopped with SIGINT, then run again twice.

Ctrl-C must say where a rerun resumes and mark the MLflow run KILLED; the rerun finishes the run; a third
run of the same command (the run already finished) trains nothing and reports the same held-out numbers.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _default_sigint() -> None:
    """Let Ctrl-C reach the run even when the tests run as a shell's background job, which starts every child
    with SIGINT ignored (Python then installs no KeyboardInterrupt handler and the run never sees the signal)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _command(run_dir: Path) -> list[str]:
    script = Path(sys.executable).parent / "agentrl"
    return [
        str(script), "train", "--config", str(REPO / "configs" / "arithmetic.yaml"),
        f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=4", "trainer.save_freq=2",
        "trainer.test_freq=4", "sft.max_steps=10", "data.val_batch_size=64",
    ]  # fmt: skip


def _held_out_line(stdout: str) -> str:
    match = re.search(r"^agentrl: held-out accuracy .*$", stdout, re.M)
    assert match, stdout[-2000:]
    return match.group(0)


def test_ctrl_c_marks_the_run_killed_and_reruns_resume_and_report(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        _command(tmp_path),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    complete = tmp_path / "checkpoints" / "global_step_2" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not complete.exists():
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)  # what Ctrl-C sends
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stderr[-3000:]
    assert "Rerun the same command to resume from the last checkpoint" in stderr
    assert re.search(r"checkpoints/global_step_[24] \(trainer.resume_mode=auto\)", stderr), stderr[-2000:]
    assert "Traceback" not in stderr

    from mlflow.tracking import MlflowClient

    run_id = (tmp_path / "mlflow_run_id.txt").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "KILLED"

    second = subprocess.run(
        _command(tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "agentrl: trained 4 steps" in second.stdout
    assert client.get_run(run_id).info.status == "FINISHED"

    third = subprocess.run(
        _command(tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert "agentrl: trained 4 steps" in third.stdout
    assert _held_out_line(third.stdout) == _held_out_line(second.stdout)
