"""Shared pieces of the config schema: the section base class, choice types, package paths."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]

KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
"""KL estimator names (verl's): kl = k1, mse = k2, low_var_kl = k3, and abs."""
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""How a (B, T) loss matrix is reduced to one number."""


def package_path(relative: str) -> str:
    """Absolute path of a file shipped inside the agentrl package (the YAML's `${agentrl.pkg:...}`)."""
    return str(_PACKAGE_ROOT / relative)


class Section(BaseModel):
    """Base of every config model: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def register_resolvers() -> None:
    """Register `${agentrl.pkg:relative/path}` (absolute path of a file shipped in the package)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("agentrl.pkg"):
        OmegaConf.register_new_resolver("agentrl.pkg", package_path)
