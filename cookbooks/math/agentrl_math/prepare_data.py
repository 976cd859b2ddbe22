"""Write GSM8K train/test splits in agentrl's row format for the math cookbook.

    python -m agentrl_math.prepare_data --input ../shared/data/gsm8k --output data/gsm8k
    python -m agentrl_math.prepare_data --output data/gsm8k          # the small sample shipped with agentrl

With `--input` (a folder holding GSM8K's original `train.jsonl` and `test.jsonl`) the conversion is
`agentrl.data.gsm8k`'s; without it the sample shipped inside agentrl (64 train, 32 test rows, already
converted) is copied, so the cookbook has data on a machine with no download. Either way the output is
`<output>/train.<format>` and `<output>/test.<format>`, for `data.train_files` / `data.val_files`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentrl.data import gsm8k, load_dataset_rows, sample_path

_SAMPLES = {"train": "gsm8k_train", "test": "gsm8k_test"}


def copy_shipped_sample(output: Path, fmt: str, limit: int | None, test_limit: int | None) -> None:
    """Write agentrl's shipped GSM8K sample (already in row format) as `<output>/{train,test}.<fmt>`."""
    limits = {"train": limit, "test": test_limit if test_limit is not None else limit}
    for split, name in _SAMPLES.items():
        rows = load_dataset_rows(sample_path(name))[: limits[split]]
        target = output / f"{split}.{fmt}"
        gsm8k.write_rows(rows, target)
        print(f"wrote {len(rows)} rows to {target} (shipped sample {name})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentrl_math.prepare_data", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--input",
        default=None,
        help="folder with GSM8K's train.jsonl and test.jsonl; omit it to use the shipped sample",
    )
    parser.add_argument(
        "--output", default="data/gsm8k", help="folder to write train/test into (default: data/gsm8k)"
    )
    parser.add_argument("--limit", type=int, default=None, help="keep the first N rows of each split")
    parser.add_argument("--test-limit", type=int, default=None, help="first N test rows (default: --limit)")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    args = parser.parse_args(argv)
    if args.input is None:
        copy_shipped_sample(Path(args.output), args.format, args.limit, args.test_limit)
        return 0
    if not Path(args.input).is_dir():
        print(
            f"error: --input {args.input} is not a folder; pass GSM8K's folder (train.jsonl, test.jsonl) "
            f"or leave --input out to use the sample shipped with agentrl",
            file=sys.stderr,
        )
        return 1
    forwarded = ["--input", args.input, "--output", args.output, "--format", args.format]
    for flag, value in (("--limit", args.limit), ("--test-limit", args.test_limit)):
        if value is not None:
            forwarded += [flag, str(value)]
    return gsm8k.main(forwarded)


if __name__ == "__main__":
    sys.exit(main())
