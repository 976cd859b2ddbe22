"""`benchmarks/grpo_step.py`'s `run_trainer_process`: each trainer of a side-by-side benchmark runs in a fresh
Python; its `RESULT <json>` line comes back as a dict, and with `show_log` the rest of its stdout (the console's
line per training step) reaches this process's stderr instead of vanishing with the captured output."""

import textwrap

import pytest

from benchmarks.grpo_step import run_trainer_process


@pytest.fixture
def child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys
            print("step 1 | reward 0.5 | step 1.2s", flush=True)
            print("RESULT " + json.dumps({"name": sys.argv[-1], "steps": 1}), flush=True)
            sys.exit(int(sys.argv[1]))
            """
        )
    )
    return str(script)


def test_the_result_comes_back_and_the_step_lines_are_shown(child, capfd):
    result, stdout = run_trainer_process(child, ["0"], "agentrl", show_log=True)
    assert result == {"name": "agentrl", "steps": 1}
    assert "step 1 | reward 0.5" in stdout
    err = capfd.readouterr().err
    assert "step 1 | reward 0.5" in err and "RESULT" not in err


def test_without_show_log_nothing_is_echoed_and_a_failure_after_the_result_is_returned(child, capfd):
    result, _ = run_trainer_process(child, ["3"], "trl")
    assert result["name"] == "trl"
    err = capfd.readouterr().err
    assert "step 1" not in err and "trl failed (exit 3) after its measured steps" in err


def test_a_child_without_a_result_stops_the_benchmark(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import sys\nprint('no result')\nsys.exit(2)\n")
    with pytest.raises(SystemExit, match="agentrl failed \\(exit 2\\)"):
        run_trainer_process(str(script), [], "agentrl", show_log=True)
