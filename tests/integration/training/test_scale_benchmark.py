"""benchmarks/scale.py: its plan and table, and a CPU smoke run (gloo) at 1 and 2 devices."""

from __future__ import annotations

import json

import pytest

from benchmarks import scale


def test_default_devices_are_powers_of_two_and_the_visible_count():
    assert scale.default_devices(0) == [1] and scale.default_devices(1) == [1]
    assert scale.default_devices(8) == [1, 2, 4, 8] and scale.default_devices(6) == [1, 2, 4, 6]


def test_weak_scaling_grows_the_batch_and_strong_keeps_it():
    assert scale.plan([1, 2, 4], ["weak", "strong"], per_device=8, global_prompts=32) == [
        ("weak", 1, 8), ("weak", 2, 16), ("weak", 4, 32),
        ("strong", 1, 32), ("strong", 2, 32), ("strong", 4, 32),
    ]  # fmt: skip
    assert scale.micro_batch(rows=64, devices=4, largest=64) == 16
    assert scale.micro_batch(rows=24, devices=2, largest=8) == 6  # the largest divisor of 12 within 8


def test_efficiency_is_relative_to_the_fewest_devices():
    rows = [
        {"mode": "weak", "devices": 1, "gen_tokens_per_s_per_device": 100.0, "step_s": 1.0},
        {"mode": "weak", "devices": 2, "gen_tokens_per_s_per_device": 80.0, "step_s": 1.2},
        {"mode": "strong", "devices": 1, "gen_tokens_per_s_per_device": 100.0, "step_s": 4.0},
        {"mode": "strong", "devices": 4, "gen_tokens_per_s_per_device": 90.0, "step_s": 2.0},
    ]
    scale.add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [1.0, 0.8, 1.0, 0.5]  # strong: 2x faster on 4x the devices
    lines = scale.table_lines(rows)
    assert lines[0].startswith("| mode | devices | prompts |") and "| weak | 2 | n/a |" in lines[3]


@pytest.mark.slow
def test_a_cpu_run_at_1_and_2_devices_prints_the_table_with_equal_first_updates(tmp_path, capsys):
    out = tmp_path / "scale.json"
    rows = scale.main(
        ["--device", "cpu", "--model", "tiny:qwen2", "--dtype", "float32", "--devices", "1", "2"]
        + ["--modes", "strong", "--global-prompts", "2", "--n", "4", "--max-tokens", "8", "--steps", "2"]
        + ["--out", str(out)]
    )
    assert [(r["mode"], r["devices"], r["rows"]) for r in rows] == [("strong", 1, 8), ("strong", 2, 8)]
    for row in rows:
        assert row["gen_s"] > 0 and row["update_s"] > 0 and row["gen_tokens_per_s_per_device"] > 0
        assert row["steps_measured"] == 1 and row["peak_gib"] is None  # no GPU memory on CPU
    one, two = rows
    # Same prompts, same per-call seeds: 2 FSDP ranks with 2 engines take the first update 1 rank takes.
    assert two["first_grad_norm"] == pytest.approx(one["first_grad_norm"], rel=1e-4)
    assert two["first_entropy"] == pytest.approx(one["first_entropy"], rel=1e-4)
    assert one["first_grad_norm"] > 0 and one["efficiency"] == 1.0
    printed = capsys.readouterr().out
    assert "| mode | devices | prompts | rows | step s |" in printed and "| strong | 2 | 2 | 8 |" in printed
    assert json.loads(out.read_text())["rows"] == rows
