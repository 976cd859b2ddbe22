import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.data import DatasetError, load_dataset_rows


def make_row(i=0, **overrides):
    row = {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {i}+1?"},
        ],
        "data_source": "arith",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i},
    }
    row.update(overrides)
    return row


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_json_and_parquet_read_the_same_rows(tmp_path):
    rows = [make_row(i) for i in range(3)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    for name in ("a.jsonl", "b.json", "c.parquet"):
        assert load_dataset_rows(str(tmp_path / name)) == rows
    assert load_dataset_rows([jsonl, str(tmp_path / "c.parquet")]) == rows + rows


def test_extra_info_defaults_to_empty_dict_and_blank_lines_are_skipped(tmp_path):
    row = make_row()
    del row["extra_info"]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n\n")
    assert load_dataset_rows(path) == [{**row, "extra_info": {}}]


@pytest.mark.parametrize(
    ("bad_row", "field", "problem"),
    [
        (make_row(prompt=None), "prompt", "is missing"),
        (make_row(prompt=[]), "prompt", "non-empty list"),
        (make_row(prompt="hi"), "prompt", "non-empty list"),
        (
            make_row(prompt=[{"role": "user", "content": "a"}, {"content": "b"}]),
            r"prompt\[1\].role",
            "one of",
        ),
        (make_row(prompt=[{"role": "user", "content": 3}]), r"prompt\[0\].content", "string or a list"),
        (
            make_row(prompt=[{"role": "user", "content": [{"text": "x"}]}]),
            r"prompt\[0\].content\[0\]",
            "'type'",
        ),
        (make_row(data_source=""), "data_source", "non-empty string"),
        (make_row(reward_model="7"), "reward_model", "object"),
        (make_row(reward_model={"style": "rule"}), "reward_model.ground_truth", "is missing"),
        (make_row(extra_info=[1]), "extra_info", "must be an object"),
        (make_row(images="x.png"), "images", "must be a list"),
        (make_row(images=[3]), r"images\[0\]", "path, URL"),
        (make_row(prompt="What is 1+1?"), "prompt", r"str 'What.*\[\{'role': 'user'"),
        (make_row(tools={"name": "add"}), "tools", "must be a list of tool schemas"),
        (make_row(tools=[{"type": "function", "function": {}}]), r"tools\[0\]", "'name'"),
    ],
)
def test_malformed_row_names_file_row_and_field(tmp_path, bad_row, field, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [make_row(0), make_row(1), bad_row])
    with pytest.raises(DatasetError, match=rf"bad\.jsonl: row 2: field '{field}' .*{problem}"):
        load_dataset_rows(path)


def test_row_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "list.jsonl", [make_row(), [1, 2]])
    with pytest.raises(DatasetError, match=r"list\.jsonl: row 1: expected an object, got list"):
        load_dataset_rows(path)


def test_invalid_json_line_names_row_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(make_row()) + "\n\n{not json\n")
    with pytest.raises(DatasetError, match=r"broken\.jsonl: row 1 \(line 3\): invalid JSON"):
        load_dataset_rows(path)


def test_parquet_error_names_row(tmp_path):
    rows = [make_row(0), make_row(1, data_source=None)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    with pytest.raises(DatasetError, match=r"p\.parquet: row 1: field 'data_source'"):
        load_dataset_rows(tmp_path / "p.parquet")


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(DatasetError, match=r"nope\.jsonl: dataset file not found"):
        load_dataset_rows(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"x\.csv: unsupported dataset format '\.csv'"):
        load_dataset_rows(tmp_path / "x.csv")
    with pytest.raises(DatasetError, match="empty list"):
        load_dataset_rows([])


def test_multimodal_rows_keep_images_and_resolve_relative_paths(tmp_path):
    parts = [{"type": "image"}, {"type": "text", "text": "What color?"}]
    data_url = "data:image/png;base64,iVBORw0KGgo="
    row = make_row(prompt=[{"role": "user", "content": parts}], images=["img/a.png", data_url, "/abs/b.png"])
    (tmp_path / "mm").mkdir()
    [loaded] = load_dataset_rows(write_jsonl(tmp_path / "mm" / "rows.jsonl", [row]))
    assert loaded["images"] == [str(tmp_path / "mm" / "img" / "a.png"), data_url, "/abs/b.png"]
    assert loaded["prompt"][0]["content"] == parts


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_an_empty_file_is_an_error_naming_the_file(tmp_path, suffix):
    path = tmp_path / f"train{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n")
    elif suffix == ".json":
        path.write_text("[]")
    else:
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(DatasetError, match=rf"{path}: the dataset file has no rows"):
        load_dataset_rows([write_jsonl(tmp_path / "ok.jsonl", [make_row()]), path])


def test_prompt_key_names_the_messages_field(tmp_path):
    row = make_row()
    row["question"] = row.pop("prompt")
    path = write_jsonl(tmp_path / "q.jsonl", [row])
    assert load_dataset_rows(path, prompt_key="question") == [row]
    with pytest.raises(DatasetError, match=r"row 0: field 'prompt' is missing"):
        load_dataset_rows(path)
    with pytest.raises(DatasetError, match=r"row 0: field 'question' is missing \(data.prompt_key\)"):
        load_dataset_rows(write_jsonl(tmp_path / "p.jsonl", [make_row()]), prompt_key="question")


def test_rows_keep_their_tool_schemas(tmp_path):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    [loaded] = load_dataset_rows(write_jsonl(tmp_path / "t.jsonl", [make_row(tools=tools)]))
    assert loaded["tools"] == tools


def test_a_byte_that_is_not_utf8_names_the_file_row_and_line(tmp_path):
    good = json.dumps(make_row(0)) + "\n"
    bad = json.dumps(make_row(1)).replace("What is", "What\xa0is").encode("latin-1")  # 0xa0: a Latin-1 space
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good.encode() + b"\n" + bad + b"\n")
    with pytest.raises(DatasetError) as err:
        load_dataset_rows(path)
    column = bad.index(b"\xa0") + 1
    message = str(err.value)
    assert message.startswith(f"{path}: row 1 (line 3, byte {column}): byte 0xa0 is not UTF-8 text")
    assert "re-save the file as UTF-8" in message and "codec" not in message

    rows = json.dumps([make_row(0), make_row(1)], indent=1).encode()
    path = tmp_path / "latin1.json"
    path.write_bytes(rows.replace(b"What is 1", b"What is \xff1"))
    with pytest.raises(DatasetError, match=r"latin1\.json: line \d+, byte \d+: byte 0xff is not UTF-8"):
        load_dataset_rows(path)
