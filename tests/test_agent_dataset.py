"""Prompt datasets: parquet and JSONL rows keep raw messages and metadata; a uid per draw."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tandem.agent.dataset import PromptDataset, read_records
from tandem.config.schema import DataConfig

ROWS = [
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
     "data_source": "arithmetic", "reward_model": {"style": "rule", "ground_truth": "2"},
     "extra_info": {"index": 0, "tools_kwargs": {"calculator": {"k": 1}}}},
    {"prompt": [{"role": "user", "content": "2+2?"}], "data_source": "arithmetic",
     "ground_truth": "4", "extra_info": {"index": 1}, "tools_kwargs": {"python": {"timeout": 5}},
     "interaction_kwargs": {"name": "x"}, "rollout_n": 3, "do_sample": False},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(params=["jsonl", "parquet"])
def dataset_file(request, tmp_path):
    if request.param == "jsonl":
        return write_jsonl(tmp_path / "train.jsonl", ROWS)
    path = tmp_path / "train.parquet"
    columns = sorted({key for row in ROWS for key in row})  # parquet rows share one schema
    pq.write_table(pa.Table.from_pylist([{key: row.get(key) for key in columns} for row in ROWS]),
                   path)
    return path


def test_rows_keep_messages_and_metadata(dataset_file):
    dataset = PromptDataset([dataset_file])
    assert len(dataset) == 2
    first, second = dataset[0], dataset[1]
    assert first.messages == ROWS[0]["prompt"] and second.messages == ROWS[1]["prompt"]
    assert first.data_source == "arithmetic" and first.ground_truth == "2"
    assert first.tools_kwargs == {"calculator": {"k": 1}}  # found inside extra_info
    assert first.rollout_n is None and first.do_sample is None
    assert second.ground_truth == "4" and second.tools_kwargs == {"python": {"timeout": 5}}
    assert second.interaction_kwargs == {"name": "x"}
    assert second.rollout_n == 3 and second.do_sample is False
    assert second.extra_info["index"] == 1 and second.raw["data_source"] == "arithmetic"


def test_every_draw_gets_a_fresh_uid(dataset_file):
    dataset = PromptDataset([dataset_file])
    uids = {dataset[0].uid, dataset[0].uid, dataset[1].uid}
    assert len(uids) == 3 and all(uids)


def test_batches_cover_every_row_once_per_epoch(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(7)]
    dataset = PromptDataset(write_jsonl(tmp_path / "d.jsonl", rows))
    batches = list(dataset.batches(3, epoch=1, shuffle=True, seed=5))
    assert [len(b) for b in batches] == [3, 3, 1]
    indices = [row.index for batch in batches for row in batch]
    assert sorted(indices) == list(range(7)) and indices != list(range(7))
    assert [r.index for b in dataset.batches(3, epoch=1, shuffle=True, seed=5) for r in b] == indices
    assert [len(b) for b in dataset.batches(3, drop_last=True)] == [3, 3]
    assert [len(b) for b in dataset.batches(0)] == [7]


def test_from_config_reads_the_split(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"q": [{"role": "user", "content": "a"}]}])
    dataset = PromptDataset.from_config(DataConfig(train_files=[str(train)], prompt_key="q"))
    assert dataset[0].messages == [{"role": "user", "content": "a"}]


@pytest.mark.parametrize("row, words", [
    ({"question": "x"}, "no column 'prompt' (data.prompt_key)"),
    ({"prompt": "just text"}, "must be a non-empty list of chat messages"),
    ({"prompt": [{"content": "x"}]}, "needs a string 'role'"),
    ({"prompt": [{"role": "user", "content": "x"}], "rollout_n": 0}, "rollout_n must be"),
    ({"prompt": [{"role": "user", "content": "x"}], "do_sample": "no"}, "do_sample must be"),
    ({"prompt": [{"role": "user", "content": "x"}], "extra_info": [1]}, "'extra_info' must be"),
    # video rows: refused until video reaches a policy, never trained on their text alone
    ({"prompt": [{"role": "user", "content": "<video>What moves?"}], "videos": ["a.mp4"]},
     "column 'videos' holds videos, but video cannot reach a policy yet"),
    ({"prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}]},
     "has a 'video' part; video and audio cannot reach a policy yet"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, row, words):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match="bad.jsonl: row 0") as error:
        PromptDataset([path])
    assert words in str(error.value)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        read_records(tmp_path / "d.csv")
    (tmp_path / "d.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match="d.jsonl:2: not a JSON line"):
        read_records(tmp_path / "d.jsonl")


def test_batch_at_equals_the_batches_it_skips(tmp_path):
    from tandem.agent.dataset import PromptDataset

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "q{i}"}}]}}\n' for i in range(10)))
    dataset = PromptDataset(path)
    for epoch in (0, 3):
        batches = list(dataset.batches(3, epoch, shuffle=True, seed=5, drop_last=True))
        for index, rows in enumerate(batches):
            picked = dataset.batch_at(3, epoch, index, shuffle=True, seed=5)
            assert [r.index for r in picked] == [r.index for r in rows]
    import pytest

    with pytest.raises(IndexError, match="no full batch 3"):
        dataset.batch_at(3, 0, 3)


VERL_ROWS = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}],
              "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
              "extra_info": {"index": i, "split": "train"}} for i in range(3)]


def test_hf_datasets_save_to_disk_directory_with_verl_columns(tmp_path):
    import datasets

    datasets.Dataset.from_list(VERL_ROWS).save_to_disk(str(tmp_path / "gsm"))
    data = PromptDataset([tmp_path / "gsm"])
    assert len(data) == 3
    row = data[2]
    assert row.messages == [{"role": "user", "content": "q2"}]
    assert (row.data_source, row.ground_truth, row.extra_info["index"]) == ("openai/gsm8k", "2", 2)
    assert row.raw["ability"] == "math"


def test_hf_datasets_dict_directory_asks_for_a_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(VERL_ROWS)}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"holds the splits \['train'\]; name one, e.g. .*dd/train"):
        read_records(tmp_path / "dd")
    assert len(read_records(tmp_path / "dd" / "train")) == 3


def test_hf_datasets_data_files_with_a_configurable_prompt_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"question": [{"role": "user", "content": "hi"}], "ground_truth": "1"}] * 2
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    data = PromptDataset.from_config(DataConfig(train_files=["json:rows.json"], prompt_key="question"))
    assert [row.messages for row in data.rows] == [[{"role": "user", "content": "hi"}]] * 2
    with pytest.raises(FileNotFoundError, match="dataset 'json:missing.json': no file"):
        read_records("json:missing.json")
    with pytest.raises(ValueError, match="not a datasets.save_to_disk directory"):
        read_records(tmp_path)


def png(path, size=(40, 30), colour=(200, 30, 30)):
    from PIL import Image

    Image.new("RGB", size, colour).save(path)
    return path


def test_vision_rows_carry_their_images_in_the_order_of_their_places(tmp_path):
    """verl's rows: `<image>` in the text becomes an image part, the `images` column fills the
    places in order (relative paths from the data file's folder, bytes, datasets Image dicts);
    rows of image parts with their own images need no column."""
    png(tmp_path / "red.png")
    blue = png(tmp_path / "blue.png", colour=(0, 0, 255)).read_bytes()  # a datasets Image dict
    rows = [{"prompt": [{"role": "user", "content": "<image>How many? <image>"}],
             "images": ["red.png", "blue.png"]},
            {"prompt": [{"role": "user", "content": [
                {"type": "text", "text": "Which?"},
                {"type": "image", "image": str(tmp_path / "red.png")}]}]},
            {"prompt": [{"role": "user", "content": "no <image> column, so this is text"}]}]
    dataset = PromptDataset([write_jsonl(tmp_path / "v.jsonl", rows)])
    first, second, text = dataset.rows
    assert first.messages == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "How many? "}, {"type": "image"}]}]
    assert first.images == [str(tmp_path / "red.png"), str(tmp_path / "blue.png")]
    assert second.messages[0]["content"][1] == {"type": "image"}
    assert second.images == [str(tmp_path / "red.png")]
    assert text.images == [] and text.messages[0]["content"] == "no <image> column, so this is text"
    assert dataset.skipped == []
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "<image>?"}],
                                   "images": [{"bytes": blue, "path": None}]}])
    pq.write_table(table, tmp_path / "v.parquet")
    [row] = PromptDataset([tmp_path / "v.parquet"]).rows
    assert row.images == [{"bytes": blue, "path": None}]


def test_a_row_with_a_broken_image_is_left_out_naming_file_row_and_reason(tmp_path):
    png(tmp_path / "ok.png")
    (tmp_path / "text.png").write_text("not an image")
    good = {"prompt": [{"role": "user", "content": "<image>?"}], "images": ["ok.png"]}
    rows = [good,
            {"prompt": [{"role": "user", "content": "<image>?"}], "images": ["gone.png"]},
            {"prompt": [{"role": "user", "content": "<image>?"}], "images": ["text.png"]},
            {"prompt": [{"role": "user", "content": "<image><image>?"}], "images": ["ok.png"]},
            {"prompt": [{"role": "user", "content": [{"type": "image"}]}]},
            good]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    dataset = PromptDataset([path])
    assert len(dataset) == 2 and len(dataset.skipped) == 4
    assert f"{path}: row 1, image 0: not a readable image" in dataset.skipped[0]
    assert f"{path}: row 2, image 0: not a readable image" in dataset.skipped[1]
    assert (f"{path}: row 3: 2 image place(s) (<image> or image parts) for 1 image(s) in column "
            "'images'") in dataset.skipped[2]
    assert "row 4: 1 image place(s) (<image> or image parts) but no column 'images'" in \
        dataset.skipped[3]
    with pytest.raises(ValueError, match="hold no rows; left out for their images"):
        PromptDataset([write_jsonl(tmp_path / "all_bad.jsonl", rows[1:3])])
