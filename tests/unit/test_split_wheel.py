"""scripts/split_wheel.py: split into parts, join back byte for byte, refuse a missing or damaged part, install."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "split_wheel.py"
MIB = 1024 * 1024


def _load_script():
    spec = importlib.util.spec_from_file_location("split_wheel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


split_wheel = _load_script()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def _write_wheel(path: Path, payload: bytes) -> None:
    """A minimal valid wheel of distribution `splitdemo` 0.1 whose package holds `payload` (stored, so its
    size is the payload's)."""
    dist = "splitdemo-0.1.dist-info"
    files = {
        "splitdemo/__init__.py": b"VALUE = 1\n",
        "splitdemo/blob.bin": payload,
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: splitdemo\nVersion: 0.1\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist}/RECORD", record)


def test_split_then_join_gives_the_same_bytes(tmp_path):
    wheel = tmp_path / "demo-0.1-py3-none-any.whl"
    wheel.write_bytes(os.urandom(2 * MIB + 12345))
    out = tmp_path / "parts"
    result = _run("split", str(wheel), "--part-mb", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"{wheel.name}.part-00{i}" for i in range(3)] + [f"{wheel.name}.parts.json"]
    assert [(out / n).stat().st_size for n in names[:3]] == [MIB, MIB, 12345]

    carried = tmp_path / "carried"  # the other machine: only the parts and the manifest
    carried.mkdir()
    for name in names:
        (carried / name).write_bytes((out / name).read_bytes())
    result = _run("join", str(carried))
    assert result.returncode == 0, result.stderr
    assert (carried / wheel.name).read_bytes() == wheel.read_bytes()


def test_a_file_that_ends_on_a_part_boundary_has_no_empty_part(tmp_path):
    source = tmp_path / "even.whl"
    source.write_bytes(os.urandom(2 * MIB))
    manifest = split_wheel.split_file(source, tmp_path / "parts", MIB)
    assert [p.name for p in sorted((tmp_path / "parts").glob("*.part-*"))] == [
        "even.whl.part-000",
        "even.whl.part-001",
    ]
    source.rename(tmp_path / "original.whl")
    assert (
        split_wheel.join_parts(manifest, tmp_path / "joined.whl").read_bytes()
        == (tmp_path / "original.whl").read_bytes()
    )


def test_join_names_a_missing_or_damaged_part_and_writes_nothing(tmp_path):
    source = tmp_path / "demo.whl"
    source.write_bytes(os.urandom(3 * MIB))
    manifest = split_wheel.split_file(source, tmp_path / "parts", MIB)
    (tmp_path / "parts" / "demo.whl.part-001").unlink()
    damaged = tmp_path / "parts" / "demo.whl.part-002"
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    with pytest.raises(SystemExit, match=r"part-001 is missing; demo\.whl\.part-002 has the wrong SHA-256"):
        split_wheel.join_parts(manifest)
    assert not (tmp_path / "parts" / "demo.whl").exists()


def test_join_installs_the_joined_wheel_without_deps(tmp_path):
    wheel = tmp_path / "splitdemo-0.1-py3-none-any.whl"
    _write_wheel(wheel, os.urandom(MIB))
    assert _run("split", str(wheel), "--part-mb", "0.5", "--out", str(tmp_path / "parts")).returncode == 0
    wheel.unlink()
    site = tmp_path / "site"
    result = _run("join", str(tmp_path / "parts"), "--install", "--target", str(site))
    assert result.returncode == 0, result.stderr
    [dist] = importlib.metadata.distributions(path=[str(site)])
    assert (dist.metadata["Name"], dist.version) == ("splitdemo", "0.1")
    assert (site / "splitdemo" / "blob.bin").stat().st_size == MIB
