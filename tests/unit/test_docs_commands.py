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


def test_the_rllm_migration_settings_load():
    """Every `key=value` setting docs/migrating_from_rllm.md tells rLLM users to use is a valid override."""
    from agentrl.config import load_config

    text = (REPO / "docs" / "migrating_from_rllm.md").read_text()
    setting = r"(?:algorithm|agent|actor_rollout_ref)\.[\w.]+=[\w.]+"
    spans = [span.split() for span in re.findall(rf"`({setting}(?: {setting})*)`", text)]
    assert ["algorithm.gamma=0"] in spans
    assert ["agent.rejection_sample.enable=true", "agent.rejection_sample.mode=solve_partial"] in spans
    for overrides in spans:
        load_config(overrides)
