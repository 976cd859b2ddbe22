"""Where agentrl keeps the model folders it builds (tiny presets) or converts (SmolLM2)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_base() -> Path:
    """`$AGENTRL_CACHE` if set, else `~/.cache/agentrl`."""
    return Path(os.environ.get("AGENTRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "agentrl"))
