"""The training-curves PNG: written, valid, and readable with and without every series."""

import math
import struct
import subprocess
import sys

from agentrl.runs.plotting import plot_training_curves

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _history(steps=40):
    history = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "training/global_step": step,
            "critic/full-score/mean": 0.2 + 0.5 * (1 - math.exp(-step / 12)),
            "actor/kl_loss": 0.001 * step,
            "actor/entropy": 1.5 - 0.02 * step,
            "response_length/mean": 40 + 10 * math.sin(step / 5),
        }
        if step % 10 == 0 or step == 1:
            record["val/test_score/gsm8k"] = 0.1 + 0.01 * step
            record["val/test_score/arith"] = 0.3 + 0.012 * step
        history.append(record)
    history[5]["actor/kl_loss"] = None  # a NaN step as the history stores it
    return history


def test_plot_full_history(tmp_path):
    path = plot_training_curves(_history(), tmp_path / "plots" / "training_curves.png", title="demo run")
    assert path == tmp_path / "plots" / "training_curves.png"
    assert _png_size(path) == (1300, 750)
    assert path.stat().st_size > 30_000


def test_plot_with_missing_series_says_not_logged(tmp_path):
    history = [{"step": s, "critic/full-score/mean": s / 10} for s in range(1, 6)]
    full = plot_training_curves(history, tmp_path / "sparse.png")
    empty = plot_training_curves([], tmp_path / "empty.png")
    assert _png_size(full) == _png_size(empty) == (1300, 750)
    assert full.stat().st_size > empty.stat().st_size > 10_000


def test_plot_does_not_touch_pyplot(tmp_path):
    code = (
        "import sys; from pathlib import Path; from agentrl.runs.plotting import plot_training_curves;"
        f"plot_training_curves([{{'step': 1, 'actor/entropy': 1.0}}], Path({str(tmp_path / 'a.png')!r}));"
        "print('matplotlib.pyplot' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
    assert (tmp_path / "a.png").exists()
