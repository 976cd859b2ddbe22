"""agentrl_math.prepare_data: the shipped sample without --input, agentrl's GSM8K conversion with it."""

import json

from agentrl_math.prepare_data import main

from agentrl.data import load_dataset_rows


def _write_gsm8k(folder, n):
    folder.mkdir()
    for split in ("train", "test"):
        with (folder / f"{split}.jsonl").open("w") as f:
            for i in range(n):
                f.write(
                    json.dumps(
                        {"question": f"What is {i} + 1,000?", "answer": f"{i} + 1000\n#### {i + 1000:,}"}
                    )
                    + "\n"
                )


def test_without_input_copies_the_shipped_sample(tmp_path):
    assert main(["--output", str(tmp_path / "out")]) == 0
    train = load_dataset_rows(str(tmp_path / "out" / "train.jsonl"))
    test = load_dataset_rows(str(tmp_path / "out" / "test.jsonl"))
    assert (len(train), len(test)) == (64, 32)
    assert train[0]["reward_model"]["ground_truth"] == "72"


def test_without_input_honours_limits(tmp_path):
    assert main(["--output", str(tmp_path), "--limit", "5", "--test-limit", "3"]) == 0
    assert len(load_dataset_rows(str(tmp_path / "train.jsonl"))) == 5
    assert len(load_dataset_rows(str(tmp_path / "test.jsonl"))) == 3


def test_with_input_converts_gsm8k(tmp_path):
    _write_gsm8k(tmp_path / "gsm8k", 4)
    assert main(["--input", str(tmp_path / "gsm8k"), "--output", str(tmp_path / "out"), "--limit", "2"]) == 0
    rows = load_dataset_rows(str(tmp_path / "out" / "train.jsonl"))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1000", "1001"]
    assert rows[1]["prompt"][0]["content"].startswith("What is 1 + 1,000?")
    assert "####" in rows[1]["prompt"][0]["content"]


def test_missing_input_folder_is_an_error(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "nope"), "--output", str(tmp_path / "out")]) == 1
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
