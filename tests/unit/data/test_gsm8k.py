import json

import pytest

from agentrl.data import DatasetError, load_dataset_rows, sample_path
from agentrl.data.gsm8k import INSTRUCTION, convert_record, extract_final_answer, main

RECORDS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 more than $800. Price?", "answer": "1200+800=2000\n#### 2,000"},
    {"question": "Half of 9?", "answer": "9/2=4.5\n####  4.5 "},
]


@pytest.mark.parametrize(
    ("answer", "final"),
    [("x\n#### 72", "72"), ("#### 1,234,567", "1234567"), ("a #### 1 #### -3", "-3"), ("no marker", None)],
)
def test_extract_final_answer(answer, final):
    assert extract_final_answer(answer) == final


def test_convert_record():
    row = convert_record(RECORDS[1], 5, "train")
    assert row == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": RECORDS[1]["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2000"},
        "extra_info": {
            "split": "train",
            "index": 5,
            "question": RECORDS[1]["question"],
            "answer": RECORDS[1]["answer"],
        },
    }
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'


def test_convert_record_errors_name_row_and_field():
    with pytest.raises(DatasetError, match=r"f\.jsonl: row 3: field 'answer' has no final answer"):
        convert_record({"question": "q", "answer": "no marker"}, 3, "train", "f.jsonl")
    with pytest.raises(DatasetError, match=r"row 0: field 'question' is missing"):
        convert_record({"answer": "#### 1"}, 0, "test")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_cli_converts_both_splits(tmp_path, fmt, capsys):
    source = tmp_path / "gsm8k"
    source.mkdir()
    for split in ("train", "test"):
        (source / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / "out"
    assert main(["--input", str(source), "--output", str(out), "--limit", "2", "--format", fmt]) == 0
    train = load_dataset_rows(out / f"train.{fmt}")
    test = load_dataset_rows(out / f"test.{fmt}")
    assert [r["reward_model"]["ground_truth"] for r in train] == ["7", "2000"]
    assert [r["extra_info"]["split"] for r in test] == ["test", "test"]
    assert "wrote 2 rows" in capsys.readouterr().out


def test_cli_reports_a_bad_row(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "none"}) + "\n")
    (tmp_path / "test.jsonl").write_text("")
    assert main(["--input", str(tmp_path), "--output", str(tmp_path / "o")]) == 1
    assert "row 0: field 'answer'" in capsys.readouterr().err


def test_shipped_samples_are_valid_and_match_the_converter():
    train, test = load_dataset_rows(sample_path("gsm8k_train")), load_dataset_rows(sample_path("gsm8k_test"))
    assert (len(train), len(test)) == (64, 32)
    assert train[0]["reward_model"]["ground_truth"] == "72"  # Natalia's clips: 48 + 24
    assert all(r["data_source"] == "openai/gsm8k" for r in train + test)
    assert all(r["prompt"][0]["content"].endswith(INSTRUCTION) for r in train + test)
    for row in train[:5]:
        record = {"question": row["extra_info"]["question"], "answer": row["extra_info"]["answer"]}
        assert convert_record(record, row["extra_info"]["index"], "train") == row


def test_sample_path_errors_list_the_samples():
    with pytest.raises(ValueError, match=r"no shipped sample named 'mnist'.*gsm8k_test.*gsm8k_train"):
        sample_path("mnist")
