"""Exact resume: a CPU run stopped after step 2 (Ctrl-C, or SIGKILL) and resumed with the same command
gives steps 3-4 bit-identical to a run that was never interrupted: metrics and final weights.

The interrupted run's flow waits once checkpoint 2 is complete, so the signal always lands in step 3;
waiting changes no result (sampling seeds come from the session ids, not from time).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from agentrl.tracking import read_metrics_history

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

FLOW = """
import asyncio
import os
from pathlib import Path

from agentrl import SingleTurnChatFlow


class PausingFlow(SingleTurnChatFlow):
    started = 0

    async def run(self, task, ctx):
        PausingFlow.started += 1
        pause, after = os.environ.get("PAUSE_WHEN"), os.environ.get("PAUSE_AFTER_EPISODES")
        if (pause and Path(pause).exists()) or (after and PausingFlow.started > int(after)):
            await asyncio.sleep(600)
        return await super().run(task, ctx)
"""
EPISODES_PER_STEP = 8 * 4  # data.train_batch_size x actor_rollout_ref.rollout.n of `_command`
# Not compared: wall-clock numbers; the engine's own log-probs, which it computes over whichever concurrent
# requests it batched together, so they differ in the last float bits between any two runs (step 1 of two
# uninterrupted runs already differs; training uses the actor's recomputed log-probs, compared through the
# losses), and what is computed from them (`rollout/logprob_diff_*`, and `rollout_corr/*`: the trainer's
# old log-probs against the engine's, e.g. a log-ratio mean of -2.9e-8 against -2.0e-8 in one CI run); and the
# rollout's policy version, a count of weight pushes in this process that restarts on resume (a known gap:
# the rollout backends take no version to start from).
_NOT_COMPARED = (
    "timing/", "perf/", "timing_s/", "rollout/logprob_diff_", "rollout_corr/", "rollout/policy_version",
)  # fmt: skip


def _default_sigint() -> None:
    """Let Ctrl-C reach the run even when the tests run as a shell's background job, which starts every child
    with SIGINT ignored (Python then installs no KeyboardInterrupt handler and the run never sees the signal)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _command(run_dir: Path, *extra: str) -> list[str]:
    return [
        str(Path(sys.executable).parent / "agentrl"), "train", "--config", str(REPO / "configs" / "arithmetic.yaml"),
        f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=4", "trainer.save_freq=2",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[console]",
        "sft.max_steps=10", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "agent.flow=pausing:PausingFlow", *extra,
    ]  # fmt: skip


def _run(run_dir: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    result = subprocess.run(_command(run_dir, *extra), cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _steps(run_dir: Path) -> dict[int, dict]:
    return {
        int(r["step"]): {k: v for k, v in r.items() if not k.startswith(_NOT_COMPARED)}
        for r in read_metrics_history(run_dir)
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run folder of an uninterrupted run with these extra overrides (one run per set, cached)."""
    runs: dict[tuple[str, ...], Path] = {}

    def get(*extra: str) -> Path:
        if extra not in runs:
            folder = tmp_path_factory.mktemp("uninterrupted")
            (folder / "pausing.py").write_text(FLOW)
            _run(folder / "run", folder, *extra)
            runs[extra] = folder / "run"
        return runs[extra]

    return get


KL = ("actor_rollout_ref.actor.use_kl_loss=true",)


@pytest.mark.parametrize(
    ("sig", "extra"),
    [
        (signal.SIGINT, ()),
        (signal.SIGKILL, ()),
        # The reference policy is the warm-started model: checkpoints carry it, so the resumed KL term matches.
        (signal.SIGKILL, KL),
    ],
    ids=["sigint", "sigkill", "sigkill-kl-after-warm-start"],
)
def test_resumed_steps_are_bit_identical(tmp_path, uninterrupted, sig, extra):
    expected_run = uninterrupted(*extra)
    (tmp_path / "pausing.py").write_text(FLOW)
    run_dir = tmp_path / "run"
    complete = run_dir / "checkpoints" / "global_step_2" / "COMPLETE"
    env = {**os.environ, "PAUSE_WHEN": str(complete)}
    first = subprocess.Popen(
        _command(run_dir, *extra),
        preexec_fn=_default_sigint,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not complete.exists():
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.1)
    time.sleep(1.0)  # step 3 is under way (its rollouts wait)
    first.send_signal(sig)
    first.communicate(timeout=120)
    assert not (run_dir / "checkpoints" / "global_step_4").exists()

    resumed = _run(run_dir, tmp_path, *extra)
    assert "resumed from" in resumed.stderr and "global_step_2" in resumed.stderr

    expected, got = _steps(expected_run), _steps(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        diff = {k: (expected[step].get(k), got[step].get(k)) for k in expected[step].keys() | got[step].keys()
                if expected[step].get(k) != got[step].get(k)}  # fmt: skip
        assert not diff, f"step {step} differs after resume: {json.dumps(diff, indent=1)}"
    weights = load_file(expected_run / "hf_model" / "model.safetensors")
    resumed_weights = load_file(run_dir / "hf_model" / "model.safetensors")
    assert weights.keys() == resumed_weights.keys()
    assert all(weights[k].equal(resumed_weights[k]) for k in weights)


def _with(command: list[str], *overrides: str) -> list[str]:
    """`command` with `overrides` in place of its settings of the same keys."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [c for c in command if c.split("=", 1)[0] not in keys] + list(overrides)


@pytest.mark.parametrize(
    "mode",
    [
        [],
        ["async_training.enable=true", "async_training.staleness_threshold=1"],
        [
            "async_training.enable=true",
            "async_training.staleness_threshold=1",
            "async_training.streaming_update=true",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # one optimizer step a batch, as streaming needs
        ],
    ],
    ids=["sync", "async", "async-streamed"],
)
def test_sigkill_after_a_logged_step_leaves_every_step_once(tmp_path, mode):
    """Killed (SIGKILL) in step 4 after step 3 was logged, checkpoint at 2: the rerun redoes step 3, and
    metrics.jsonl, the rollout files and the MLflow run hold each step once (issue 27). Asynchronous, step 4's
    rollouts were already running when the kill came; the checkpoint at 2 had none in flight, so the rerun
    collects steps 3 and 4 again and trains each once (issue 24)."""
    from mlflow.tracking import MlflowClient

    from agentrl.runs.rollout_files import read_rollouts, rollout_steps

    (tmp_path / "pausing.py").write_text(FLOW)
    run_dir = tmp_path / "run"
    command = _with(
        _command(run_dir), "trainer.logger=[console,mlflow]", "trainer.rollout_trace_freq=1", *mode
    )
    # Every episode after those of steps 1-3 waits: step 4's rollouts never finish, also when asynchronous
    # collection started them before step 3's files were written (a wait keyed to those files raced it).
    env = {**os.environ, "PAUSE_AFTER_EPISODES": str(3 * EPISODES_PER_STEP)}
    env.pop("MLFLOW_TRACKING_URI", None)
    first = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 400
    while 3 not in {int(r["step"]) for r in read_metrics_history(run_dir)}:
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "step 3 not logged within 400 s"
        time.sleep(0.2)
    time.sleep(1.0)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=120)
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]
    assert not (run_dir / "checkpoints" / "global_step_4").exists()

    env.pop("PAUSE_AFTER_EPISODES")
    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stderr and "global_step_2" in resumed.stderr

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]  # each step once, not 1, 2, 3, 3, 4
    assert rollout_steps(run_dir) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        records = read_rollouts(run_dir, step)
        assert {r["step"] for r in records} == {step}
        assert len({r["episode_id"] for r in records}) == len(records)

    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(run_id, "training/global_step")] == [1, 2, 3, 4]
    experiment_id = client.get_run(run_id).info.experiment_id
    traces = client.search_traces(
        locations=[experiment_id], run_id=run_id, include_spans=False, max_results=1000
    )
    keys = [(t.info.tags["agentrl.split"], t.info.tags["agentrl.step"], t.info.tags["agentrl.episode_id"])
            for t in traces]  # fmt: skip
    assert len(keys) == len(set(keys))  # step 3's traces from before the kill were removed, not doubled
    assert {k[1] for k in keys} >= {"3", "4"}
