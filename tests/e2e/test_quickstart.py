"""docs/quickstart.md runs as written: its Python blocks are executed in order, in one namespace.

Every fenced ```python block runs unless its first line is `# not run`. The doc's own settings are the test's
(tiny:qwen2-mini, 2 steps, outputs relative to the working directory, which the test points at a tmp folder).
The one change: the doc talks to `agentrl serve` at a fixed example URL; the test starts the doc's own
`agentrl serve` command on a free port and substitutes that server's URL.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "quickstart.md"
DOC_BASE_URL = "http://127.0.0.1:8000"
"""The gateway URL the doc's serve example assumes (`agentrl serve ... --port 8000`)."""
NOT_RUN = "# not run"

_FENCE = re.compile(r"^```(?P<lang>[\w-]*)[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_READY = re.compile(r"behind the gateway at (http://\S+)")


def extract_blocks(markdown: str, lang: str) -> list[str]:
    """The bodies of the fenced code blocks tagged `lang`, in document order."""
    return [m["body"] for m in _FENCE.finditer(markdown) if m["lang"] == lang]


def runnable_python_blocks(markdown: str) -> list[str]:
    """Python blocks the reader is meant to run: all but those whose first line is `# not run`."""
    return [b for b in extract_blocks(markdown, "python") if not b.lstrip().startswith(NOT_RUN)]


def serve_command(markdown: str) -> list[str]:
    """The `agentrl serve ...` command the doc tells the reader to start, as argv after `agentrl`."""
    for block in extract_blocks(markdown, "bash"):
        for line in block.splitlines():
            if line.startswith("agentrl serve"):
                return shlex.split(line.split("#")[0])[1:]
    raise AssertionError(f"{DOC} shows no `agentrl serve` command")


def _with_free_port(argv: list[str]) -> list[str]:
    """The same command on a free port (`--port 0`), so the test never collides with a running server."""
    argv = list(argv)
    if "--port" in argv:
        argv[argv.index("--port") + 1] = "0"
    else:
        argv += ["--port", "0"]
    return argv


@pytest.fixture
def served_policy(tmp_path):
    """The doc's `agentrl serve` command, running until the test ends; yields the gateway URL."""
    argv = _with_free_port(serve_command(DOC.read_text()))
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentrl.cli", *argv],
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 120
        while not (found := _READY.search(log_path.read_text())):
            assert proc.poll() is None, f"agentrl {' '.join(argv)} exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"agentrl serve not ready:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        yield found.group(1)
    finally:
        proc.terminate()  # SIGTERM: serve stops its engines and gateway and exits
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_doc_has_runnable_blocks_a_skipped_block_and_a_serve_command():
    markdown = DOC.read_text()
    python = extract_blocks(markdown, "python")
    runnable = runnable_python_blocks(markdown)
    assert len(runnable) >= 8
    assert len(python) - len(runnable) == 1  # the "Scaling up" example needs real weights
    assert all(DOC_BASE_URL not in b for b in python if b.lstrip().startswith(NOT_RUN))
    assert sum(DOC_BASE_URL in b for b in runnable) == 1
    assert serve_command(markdown)[:3] == ["serve", "--model", "tiny:qwen2"]
    assert _with_free_port(["serve", "--port", "8000"]) == ["serve", "--port", "0"]


@pytest.mark.slow
def test_quickstart_runs_as_written(tmp_path, monkeypatch, served_policy):
    from agentrl import TrainResult

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the doc promises mlflow.db in the run folder
    namespace: dict = {"__name__": "quickstart"}
    port = served_policy.rsplit(":", 1)[1]  # serve names its token file after the port it bound
    for index, code in enumerate(runnable_python_blocks(DOC.read_text())):
        code = code.replace(DOC_BASE_URL, served_policy).replace("admin_token_8000", f"admin_token_{port}")
        exec(compile(code, f"{DOC.name} python block {index}", "exec"), namespace)  # noqa: S102

    # Section 6: the flow ran against the served policy and its one call was traced with tokens.
    [trace] = namespace["traces"]
    assert trace["prompt_ids"] and trace["response_ids"]
    assert len(trace["logprobs"]) == len(trace["response_ids"])
    assert isinstance(namespace["answer"], str)

    # Section 7: two steps trained; validation before and after; every output of section 8 is there.
    result = namespace["result"]
    assert isinstance(result, TrainResult) and result.global_step == 2
    run = tmp_path / "outputs" / "quickstart" / "first-flow"
    assert (tmp_path / result.run_dir).resolve() == run
    assert (run / "checkpoints" / "global_step_2" / "COMPLETE").is_file()
    assert (run / "hf_model" / "model.safetensors").is_file()
    assert (run / "training_curves.png").stat().st_size > 0
    assert (run / "mlflow.db").stat().st_size > 0
    assert result.initial_val_metrics["val/num_episodes"] == 8 == result.metrics["val/num_episodes"]
    assert result.metrics["batch/kept_episodes"] == 16  # 4 tasks x 4 samples, none failed
    assert result.metrics["batch/trace_mismatch"] == 0

    # The two-turn flow: 16 episodes x 2 calls, each call a row of its own or merged into the turn before.
    step = namespace["two_turn"].metrics
    assert namespace["two_turn"].global_step == 1
    assert step["episode/model_calls/min"] == 2 == step["episode/model_calls/max"]
    assert step["batch/trace_mismatch"] == 0 and step["batch/excluded_steps"] == 0
    assert step["batch/rows"] + step["batch/merged_steps"] == 32
    assert not (tmp_path / "outputs" / "quickstart" / "two-turn" / "mlflow.db").exists()  # logger=[console]
