"""Data: verl-format RL datasets (parquet/jsonl), a resumable batch loader, GSM8K preparation."""

from pathlib import Path

from agentrl.data.dataloader import RLDataLoader
from agentrl.data.dataset import DatasetError, load_dataset_rows, validate_row

SAMPLES_DIR = Path(__file__).parent / "samples"


def sample_path(name: str) -> str:
    """Path of a dataset shipped with the package, e.g. `sample_path("gsm8k_train")`."""
    candidates = [SAMPLES_DIR / name, SAMPLES_DIR / f"{name}.jsonl"]
    for candidate in candidates:
        if candidate.is_file() and candidate.suffix == ".jsonl":
            return str(candidate)
    available = sorted(p.stem for p in SAMPLES_DIR.glob("*.jsonl"))
    raise ValueError(f"no shipped sample named {name!r}; available: {available}")


__all__ = ["DatasetError", "RLDataLoader", "SAMPLES_DIR", "load_dataset_rows", "sample_path", "validate_row"]
