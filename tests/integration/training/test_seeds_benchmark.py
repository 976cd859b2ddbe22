"""benchmarks/seeds.py runs a command once per seed and tabulates the held-out gain: mean, min, max, wall time."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import seeds

FAKE_RUN = """
import json, sys
from pathlib import Path
args = dict(a.split("=", 1) for a in sys.argv[1:])
seed, run = int(args["trainer.seed"]), Path(args["trainer.default_local_dir"])
run.mkdir(parents=True)
before, after = 0.5, 0.5 + 0.1 * seed
with open(run / "metrics.jsonl", "w") as f:
    f.write(json.dumps({"step": 0, "val/accuracy": before, "val/num_episodes": 4.0}) + "\\n")
    f.write(json.dumps({"step": 1, "critic/full-score/mean": 0.3}) + "\\n")
    f.write(json.dumps({"step": 2, "val/accuracy": after, "val/num_episodes": 4.0}) + "\\n")
print(f"held-out accuracy {before:.3f} -> {after:.3f}")
"""


def _write_val(path, correct):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"task_id": f"val-{i}", "is_correct": c}) + "\n" for i, c in enumerate(correct))
    )


def test_accuracies_come_from_metrics_and_the_gain_error_from_the_saved_episodes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "val/accuracy": 0.25, "val/num_episodes": 4.0})
        + "\n"
        + json.dumps({"step": 3, "val/accuracy": 0.75, "val/num_episodes": 4.0})
        + "\n"
    )
    _write_val(tmp_path / "rollouts" / "val_step_000000.jsonl", [True, False, False, False])
    _write_val(tmp_path / "rollouts" / "val_step_000003.jsonl", [True, True, True, False])
    before, after, episodes, se = seeds.read_accuracies(tmp_path, "")
    assert (before, after, episodes) == (0.25, 0.75, 4)
    # per-task changes 0, 1, 1, 0: sample std 0.577, over sqrt(4) -> 28.9 points
    assert se == pytest.approx(100 * (1 / 3) ** 0.5 / 2)


def test_without_metrics_the_printed_line_is_read(tmp_path):
    output = "trained 60 steps; run folder x\nheld-out accuracy 0.575 -> 0.775\n"
    assert seeds.read_accuracies(tmp_path, output) == (0.575, 0.775, None, None)
    assert seeds.read_accuracies(tmp_path, "crashed") == (None, None, None, None)


def test_the_table_quotes_mean_min_and_max_and_flags_a_failed_seed():
    runs = [
        seeds.SeedRun(1, 0.5, 0.7, 200, 3.0, 300.0, 0),
        seeds.SeedRun(2, 0.4, 0.5, 200, None, 330.0, 0),
        seeds.SeedRun(3, None, None, None, None, 12.0, 1),
    ]
    table = seeds.render_table(runs)
    assert "| 1 | 0.500 | 0.700 | +20.0 ± 3.0 | 200 | 5:00 |" in table
    assert "| 3 (failed) | - | - | - | - | 0:12 |" in table
    assert table.endswith(
        "over seeds 1-3: +15.0 on average, min +10.0, max +20.0 (1 of 3 runs failed or reported nothing); "
        "wall 3:34 on average, max 5:30"
    )


def test_main_runs_each_seed_in_its_own_folder_and_prints_the_summary(tmp_path, capsys):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_RUN)
    out = tmp_path / "runs"
    assert seeds.main(["--seeds", "1", "2", "--out", str(out), "--", sys.executable, str(script)]) == 0
    printed = capsys.readouterr().out
    assert "| 2 | 0.500 | 0.700 | +20.0 | 4 |" in printed
    assert "over seeds 1-2: +15.0 on average, min +10.0, max +20.0" in printed
    assert (out / "seed_1" / "metrics.jsonl").is_file() and (out / "seed_2.log").is_file()
    with pytest.raises(SystemExit):  # a second run into the same folder would resume, not start afresh
        seeds.main(["--seeds", "1", "--out", str(out), "--", sys.executable, str(script)])
    with pytest.raises(SystemExit):
        seeds.main(["--out", str(tmp_path / "new"), "--", sys.executable, str(script), "trainer.seed=4"])
