"""A fresh clone installs exactly the locked versions, in both environments (requirements/lock*.txt).

`make setup` and `scripts/setup_vllm.sh` install with the locks as pip constraints; these tests read what is
installed and compare. A package of the lock that is missing fails too, so run after `make test`'s setup
(`setup setup-vllm setup-smollm2`); `make lock` rewrites the locks from the environments.
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def _mismatches(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    problems = []
    for name, version in sorted(pins.items()):
        have = installed.get(name)
        if have is None:
            problems.append(f"{name}: locked {version}, not installed")
        elif Version(have).public != Version(version).public:  # torch's +cpu build is torch 2.13.0
            problems.append(f"{name}: locked {version}, installed {have}")
    return problems


@pytest.mark.slow
def test_the_project_environment_holds_the_locked_versions():
    pins = read_lock(REPO / "requirements" / "lock.txt")
    installed = {}
    for (
        name
    ) in pins:  # the first copy on sys.path, the one imports get (setuptools may add its vendored ones)
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    assert not _mismatches(pins, installed)


@pytest.mark.vllm
def test_the_vllm_environment_holds_the_locked_versions():
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip(".venv-vllm is not built (make setup-vllm)")
    pins = read_lock(REPO / "requirements" / "lock-vllm.txt")
    script = (
        "import importlib.metadata as m, json, sys\n"
        "found = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        found[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "print(json.dumps(found))"
    )
    listing = subprocess.run(
        [str(python), "-c", script, json.dumps(sorted(pins))], capture_output=True, text=True, check=True
    )
    assert not _mismatches(pins, json.loads(listing.stdout))


def test_a_lock_is_read_and_compared_by_public_version():
    pins = {"torch": "2.13.0", "transformers": "5.24.0", "gone": "1.0"}
    installed = {"torch": "2.13.0+cpu", "transformers": "5.25.0"}
    assert _mismatches(pins, installed) == [
        "gone: locked 1.0, not installed",
        "transformers: locked 5.24.0, installed 5.25.0",
    ]
    assert all(
        "==" not in line or line.count("==") == 1
        for line in (REPO / "requirements" / "lock.txt").read_text().splitlines()
    )
