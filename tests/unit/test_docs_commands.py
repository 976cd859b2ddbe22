"""The commands the docs show are the commands that run."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_says_what_make_train_runs():
    recipe = re.search(r"^train: .*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    command = recipe.replace("$(VENV)", ".venv").strip()
    said = re.search(r"make train +# the same as: (.+)$", (REPO / "docs" / "quickstart.md").read_text(), re.M)
    assert said is not None and said.group(1).strip() == command
