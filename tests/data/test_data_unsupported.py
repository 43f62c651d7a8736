"""Rows fastdpo cannot train (multimodal) are refused at `train` with counts and one clear sentence, instead of
training as text or failing once per row with "field 'chosen' is missing"; `check-data` reads and checks them.
Unpaired rows are read (see test_data_unpaired)."""

import pickle

import pytest
from cli_helpers import run_cli
from data_helpers import assistant, user, write_jsonl

from fastdpo.data.unsupported import MULTIMODAL, UnsupportedRow, unsupported_kind

SWIFT_IMAGE = {"messages": [user("<image>w1 w2"), assistant("w5")], "rejected_response": "w7",
               "images": ["/data/cat.png"]}
TRL_VISION = {"images": ["<PIL image>"], "prompt": [{"role": "user", "content": [
    {"type": "image"}, {"type": "text", "text": "w1"}]}], "chosen": [assistant("w5")], "rejected": [assistant("w7")]}
KTO = {"prompt": "w1 w2", "completion": " w5", "label": True}
SWIFT_KTO = {"messages": [user("w1"), assistant("w5")], "label": False}
GOOD = {"prompt": "w1 w2", "chosen": " w5", "rejected": " w7"}


@pytest.mark.parametrize("value,kind", [
    (SWIFT_IMAGE, MULTIMODAL), (TRL_VISION, MULTIMODAL), ({**GOOD, "videos": ["a.mp4"]}, MULTIMODAL),
    ({**GOOD, "prompt": "<image>w1"}, MULTIMODAL), (KTO, None), (SWIFT_KTO, None),
    ({**GOOD, "kto_tag": True, "chosen": None, "rejected": None}, None),
    (GOOD, None), ({**GOOD, "label": 1}, None), ({**GOOD, "image": None, "images": []}, None),
    ({**GOOD, "prompt": "<video> is an HTML element"}, None),
])
def test_kinds(value, kind):
    got = unsupported_kind(value)
    assert (got[0] if got else None) == kind


def test_the_row_error_survives_worker_processes():
    e = pickle.loads(pickle.dumps(UnsupportedRow("d.jsonl:3", MULTIMODAL, "the images column")))
    assert e.kind == MULTIMODAL and str(e).startswith("d.jsonl:3: holds the images column. The model is text-only")


def test_check_data_reads_them_and_names_a_problem_of_many_rows_once(tmp_path, capsys):
    """check-data reads rows with images (test_check_data_images): here every image is missing, one message."""
    f = write_jsonl(tmp_path / "d.jsonl", [GOOD] + [SWIFT_IMAGE] * 40 + [GOOD])
    code, out = run_cli(capsys, "check-data", "--dataset", f)
    assert code == 1 and f"missing image in 40 of 42 rows of {f} (lines 2, 3, 4, ...)" in out, out
    assert "field 'images[0]' names an image file that does not exist: /data/cat.png" in out
    assert "FAILED: 1 error." in out and "is missing" not in out


@pytest.mark.parametrize("row,needle", [(SWIFT_IMAGE, "rows are multimodal"), (TRL_VISION, "rows are multimodal")])
def test_train_refuses_them_with_counts(tmp_path, capsys, model_dirs, restore_logging, row, needle):
    f = write_jsonl(tmp_path / "d.jsonl", [row] * 5 + [GOOD])
    code, out = run_cli(capsys, "train", "--model", model_dirs(), "--dataset", f, "--output_dir", tmp_path / "out",
                        "--max_steps", "1")
    assert code == 1 and f"{f}: 5 of 6 {needle}" in out, out
    assert "is missing" not in out and not (tmp_path / "out" / "final").exists()
