"""`benchmarks/decode_beside_update.py` at a small size on CPU: every phase measured, and the GIL's toll shows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "decode_beside_update.py"


def test_the_benchmark_measures_decoding_beside_each_phase():
    args = [
        "--rows-decoding",
        "2",
        "--rows",
        "2",
        "--micro-batch",
        "1",
        "--row-len",
        "32",
        "--phase-s",
        "0.6",
    ]
    args += ["--warmup-s", "0.5", "--prompt-len", "16", "--answer-len", "16"]
    done = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert list(results) == ["alone", "python", "gpu", "update", "update+python", "update, nothing decoding"]
    assert all(results[phase]["decode tok/s"] > 0 for phase in ("alone", "gpu", "update"))
    assert all(
        results[phase]["update s"] > 0 for phase in ("update", "update+python", "update, nothing decoding")
    )
    # A thread running pure Python holds the GIL for whole switch intervals; the engine's thread, which takes it
    # back after every torch call, decodes far slower beside it (8-20x on this host).
    assert results["python"]["decode tok/s"] < 0.8 * results["alone"]["decode tok/s"]
