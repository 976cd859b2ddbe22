"""Turn the original GSM8K jsonl (`question`, `answer` ending in `#### <number>`) into RL rows.

    python -m agentrl.data.gsm8k --input ../shared/data/gsm8k --output data/gsm8k [--limit N] [--format parquet]

writes `train.jsonl` and `test.jsonl` (or `.parquet`) in the row format `load_dataset_rows` reads:
the question plus a step-by-step instruction as the user prompt, the number after `####` (commas
removed) as `reward_model.ground_truth`, and `data_source = "openai/gsm8k"`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agentrl.data.dataset import DatasetError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def extract_final_answer(answer: str) -> str | None:
    """The text after the last `####`, stripped, with thousands separators removed ("1,000" -> "1000")."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def convert_record(record: dict[str, Any], index: int, split: str, source: str = "<input>") -> dict[str, Any]:
    """One GSM8K record -> one RL row; raises DatasetError naming the source, row and field."""
    for field in ("question", "answer"):
        if not isinstance(record.get(field), str):
            raise DatasetError(f"{source}: row {index}: field '{field}' is missing or not a string")
    final = extract_final_answer(record["answer"])
    if not final:
        raise DatasetError(f"{source}: row {index}: field 'answer' has no final answer after '####'")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{record['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final},
        "extra_info": {
            "split": split,
            "index": index,
            "question": record["question"],
            "answer": record["answer"],
        },
    }


def convert_file(path: Path, split: str, limit: int | None = None) -> list[dict[str, Any]]:
    rows = []
    with path.open() as f:
        for index, line in enumerate(f):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: row {index}: invalid JSON: {exc}") from exc
            rows.append(convert_record(record, index, split, str(path)))
    return rows


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentrl.data.gsm8k", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--input", required=True, help="folder with GSM8K train.jsonl and test.jsonl")
    parser.add_argument("--output", required=True, help="folder to write the converted splits into")
    parser.add_argument("--limit", type=int, default=None, help="keep the first N rows of each split")
    parser.add_argument("--test-limit", type=int, default=None, help="first N test rows (default: --limit)")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--prefix", default="", help="prefix for the output names, e.g. 'gsm8k_'")
    args = parser.parse_args(argv)
    limits = {"train": args.limit, "test": args.test_limit if args.test_limit is not None else args.limit}
    for split in SPLITS:
        source = Path(args.input) / f"{split}.jsonl"
        if not source.exists():
            print(f"error: {source} not found (expected GSM8K's {split}.jsonl in --input)", file=sys.stderr)
            return 1
        try:
            rows = convert_file(source, split, limits[split])
        except DatasetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        target = Path(args.output) / f"{args.prefix}{split}.{args.format}"
        write_rows(rows, target)
        print(f"wrote {len(rows)} rows to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
