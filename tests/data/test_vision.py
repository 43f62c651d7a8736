"""Rows with images: the three layouts users bring read into rows that carry their images (paths or bytes, in the
order of their tags), relative paths read against the data file's directory, and every bad input refused with the
row's file:line, the field and what to do."""

import json

import pytest
from data_helpers import assistant, user, write_image, write_jsonl

from fastdpo.data.columns import RowOptions
from fastdpo.data.dataset_info import resolve
from fastdpo.data.formats import RowError
from fastdpo.data.sources import InMemoryData, iter_records, parse_spec
from fastdpo.data.vision import ImageRef, check_images

READ = RowOptions(images=True)


def rows_of(spec, read=READ) -> list:
    return [row for rec in iter_records(parse_spec(str(spec))) for row in rec.rows(read)]


def error_of(tmp_path, row: dict, read=READ) -> RowError:
    f = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(RowError) as e:
        rows_of(f, read)
    assert str(e.value).startswith(f"{f}:1")
    return e.value


@pytest.fixture
def pictures(tmp_path):
    """Two images under tmp_path/img/ (a 24 x 16 and a 16 x 16 one)."""
    return write_image(tmp_path / "img" / "a.png", 24, 16), write_image(tmp_path / "img" / "b.png", 16, 16, (0, 90, 0))


def swift(**extra) -> dict:
    return {"messages": [user("<image>w1 w2 <image>"), assistant("w5 w6")], "rejected_response": "w7",
            "images": ["img/a.png", "img/b.png"], **extra}


def test_ms_swift_rows_hold_their_images_in_tag_order_read_against_the_data_file(tmp_path, pictures, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # not the data file's directory
    (row,) = rows_of(write_jsonl(tmp_path / "d.jsonl", [swift()]))
    assert row.format == "ms_swift" and row.prompt == [user("<image>w1 w2 <image>")]
    assert row.chosen == [assistant("w5 w6")] and row.rejected == [assistant("w7")]
    assert row.images == (ImageRef(str(pictures[0])), ImageRef(str(pictures[1])))
    assert check_images(row) == [(24, 16), (16, 16)]


def test_ms_swift_rejected_messages_with_equal_rejected_images(tmp_path, pictures):
    value = {"messages": [user("<image>w1"), assistant("w5")], "images": ["img/a.png"],
             "rejected_messages": [user("<image>w1"), assistant("w7")], "rejected_images": ["img/a.png"]}
    (row,) = rows_of(write_jsonl(tmp_path / "d.jsonl", [value]))
    assert row.rejected == [assistant("w7")] and [i.path for i in row.images] == [str(pictures[0])]


def test_differing_rejected_images_are_refused(tmp_path, pictures):
    e = error_of(tmp_path, swift(rejected_images=["img/b.png", "img/a.png"]))
    assert e.field == "rejected_images" and "differ from images" in str(e)
    assert "computes the prompt and its images once for chosen and rejected" in str(e)


def test_trl_vision_rows_turn_image_parts_into_tags(tmp_path, pictures):
    value = {"images": ["img/b.png", "img/a.png"],
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w1 "},
                                                     {"type": "image"}, {"type": "text", "text": "w2"}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "w5"}]}],
             "rejected": [assistant("w7")]}
    (row,) = rows_of(write_jsonl(tmp_path / "d.jsonl", [value]))
    assert row.format == "conversational" and row.prompt == [user("<image>w1 <image>w2")]
    assert row.chosen == [assistant("w5")] and [i.path for i in row.images] == [str(pictures[1]), str(pictures[0])]


def test_llamafactory_sharegpt_reads_the_images_column_its_entry_names(tmp_path, pictures):
    write_jsonl(tmp_path / "pairs.jsonl", [{"conversations": [{"from": "human", "value": "<image>w1"}],
                                           "chosen": {"from": "gpt", "value": "w5"},
                                           "rejected": {"from": "gpt", "value": "w7"}, "pics": ["img/a.png"]}])
    table = {"vis": {"file_name": "pairs.jsonl", "ranking": True, "formatting": "sharegpt",
                     "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                                 "images": "pics"}}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(table))
    got = resolve("vis", table, str(tmp_path))
    assert dict(got.read.columns)["pics"] == "images"
    read = RowOptions(datasets=((got.spec, got.read),), images=True)
    (row,) = rows_of(got.spec, read)
    assert row.format == "sharegpt" and row.prompt == [user("<image>w1")]
    assert [i.path for i in row.images] == [str(pictures[0])]


def test_rows_without_images_sit_beside_rows_with_them(tmp_path, pictures):
    rows = rows_of(write_jsonl(tmp_path / "d.jsonl", [swift(), {"prompt": "w1", "chosen": "w2", "rejected": "w3"}]))
    assert [len(r.images) for r in rows] == [2, 0]


def test_hf_datasets_images_as_pil_or_bytes(tmp_path, pictures):
    import datasets

    raw = pictures[0].read_bytes()
    data = {"prompt": [[user("<image>w1")]], "chosen": [[assistant("w5")]], "rejected": [[assistant("w7")]],
            "images": [[{"bytes": raw, "path": None}]]}  # stored in the dataset, as a hub dataset's are
    features = datasets.Features({"prompt": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                                  "chosen": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                                  "rejected": [{"role": datasets.Value("string"),
                                                "content": datasets.Value("string")}],
                                  "images": datasets.Sequence(datasets.Image())})
    ds = datasets.Dataset.from_dict(data, features=features)
    decoded = rows_of_memory(list(ds))  # PIL images: kept as encoded bytes
    undecoded = rows_of_memory(list(ds.cast_column("images", datasets.Sequence(datasets.Image(decode=False)))))
    for row in (decoded, undecoded):
        (image,) = row.images
        assert image.data and check_images(row) == [(24, 16)]
    assert undecoded.images[0].data == raw  # {"bytes", "path"}: the bytes as stored


def rows_of_memory(values: list):
    spec = InMemoryData(values)
    (row,) = [row for rec in iter_records(parse_spec(spec)) for row in rec.rows(READ)]
    return row


@pytest.mark.parametrize("change,field,needle", [
    ({"images": ["img/a.png", "img/missing.png"]}, "images[1]", "names an image file that does not exist: "),
    ({"images": ["img/a.png"]}, "images", "the prompt has 2 <image> tags (or image parts) and the row 1 image."),
    ({"images": ["img/a.png", "https://example.com/b.png"]}, "images[1]",
     "is a URL (https://example.com/b.png). fastdpo reads no network: download the images and give their paths"),
    ({"videos": ["clip.mp4"]}, "videos", "holds videos, but videos are not trained; fastdpo reads still images only."),
    ({"messages": [user("<image>w1 <image>"), assistant("w5 <image>")], "images": ["img/a.png"] * 3}, "chosen",
     "holds an <image> tag (or image part), but images belong to the prompt"),
    ({"rejected_response": "w7 <image>", "images": ["img/a.png"] * 3}, "rejected",
     "holds an <image> tag (or image part), but images belong to the prompt"),
])
def test_bad_inputs_name_the_row_and_field(tmp_path, pictures, change, field, needle):
    e = error_of(tmp_path, swift(**change))
    assert e.field == field and needle in str(e), str(e)


def test_a_missing_image_says_where_it_was_looked_for(tmp_path, pictures):
    e = error_of(tmp_path, swift(images=["img/a.png", "img/nope.png"]))
    assert f"{tmp_path / 'img' / 'nope.png'} (read against {tmp_path})" in str(e) and e.reason == "missing image"


@pytest.mark.parametrize("part,needle", [
    ({"type": "video"}, "is a video part, but videos are not trained"),
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "is an image_url part (http://x/y.png). fastdpo "
                                                                     "reads no network"),
])
def test_media_parts_that_are_not_read(tmp_path, pictures, part, needle):
    value = {"images": ["img/a.png"], "prompt": [{"role": "user", "content": [part, {"type": "text", "text": "w1"}]}],
             "chosen": [assistant("w5")], "rejected": [assistant("w7")]}
    e = error_of(tmp_path, value)
    assert e.field == "prompt[0].content[0]" and needle in str(e)


def test_an_unreadable_image_is_found_when_opened(tmp_path, pictures):
    (tmp_path / "img" / "bad.png").write_text("not an image")
    (row,) = rows_of(write_jsonl(tmp_path / "d.jsonl", [swift(images=["img/a.png", "img/bad.png"])]))
    with pytest.raises(RowError) as e:
        check_images(row)
    assert e.value.field == "images[1]" and e.value.reason == "unreadable image"
    assert str(e.value).startswith(f"{tmp_path / 'd.jsonl'}:1: field 'images[1]' cannot be read as an image")


def test_without_the_reading_option_rows_with_images_stay_refused(tmp_path, pictures):
    e = error_of(tmp_path, swift(), RowOptions())
    assert "The model is text-only" in str(e) and "such as Qwen2.5-VL" in str(e)


def test_rows_differing_only_in_their_images_are_not_duplicates(tmp_path, pictures):
    a, b = rows_of(write_jsonl(tmp_path / "d.jsonl", [swift(), swift(images=["img/b.png", "img/a.png"])]))
    assert a.key() != b.key() and a.prompt == b.prompt


def test_text_rows_of_a_vision_dataset_may_hold_part_lists(tmp_path, pictures):
    value = {"images": [], "prompt": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "w5"}]}],
             "rejected": [assistant("w7")]}
    (row,) = rows_of(write_jsonl(tmp_path / "d.jsonl", [value]))
    assert row.prompt == [user("w1")] and row.chosen == [assistant("w5")] and row.images == ()


@pytest.mark.parametrize("change,field,needle", [
    ({"audios": ["a.wav"]}, "audios", "holds audio, which fastdpo does not train."),
    ({"messages": [user("<image>w1 <image><video>"), assistant("w5")]}, None, "holds <video> tags, but videos are "
                                                                               "not trained"),
    ({"images": ["img/a.png", "data:image/png;base64,AAAA"]}, "images[1]", "is a data URL."),
])
def test_other_media_are_refused(tmp_path, pictures, change, field, needle):
    e = error_of(tmp_path, swift(**change))
    assert e.field == field and needle in str(e), str(e)
