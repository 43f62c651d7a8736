"""`fastdpo check-data` on rows with images: counts the rows and images, opens each, checks tags against images
(file:line), and with a vision-language --model counts the images' placeholder tokens in the lengths, under
--max_pixels."""

import pytest
from cli_helpers import run_cli
from data_helpers import assistant, user, write_image, write_jsonl

from fastdpo.model.tiny import build_tiny_model, build_tiny_vlm_dir

TEXT = {"prompt": [user("w1 w2")], "chosen": [assistant("w5")], "rejected": [assistant("w7")]}


def swift(images: list, text: str = "<image>w1 w2") -> dict:
    return {"messages": [user(text), assistant("w5 w6")], "rejected_response": "w7", "images": images}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm_dir(tmp_path_factory.mktemp("vlm"))


@pytest.fixture
def data(tmp_path):
    write_image(tmp_path / "img" / "a.png", 64, 64)
    write_image(tmp_path / "img" / "b.png", 16, 16)
    return write_jsonl(tmp_path / "d.jsonl", [swift(["img/a.png"]), TEXT, swift(["img/a.png", "img/b.png"],
                                                                                 "<image>w1 <image>w2")])


def test_counts_and_opens_the_images_and_names_the_model_that_trains_them(capsys, data):
    code, out = run_cli(capsys, "check-data", "--dataset", data)
    assert code == 0 and "images: 2 rows hold 3 images, each opened and verified." in out, out
    assert "`fastdpo train` trains the 2 rows with images with a vision-language --model" in out and "OK: no errors." in out


def test_image_tokens_count_in_the_lengths_under_max_pixels(capsys, data, vlm_dir):
    code, out = run_cli(capsys, "check-data", "--dataset", data, "--model", vlm_dir)
    assert code == 0, out
    # 64 x 64 pixels in 4-pixel patches merged 2 x 2: 64 tokens; 16 x 16: 4
    assert "3 images of the pairs kept hold 132 placeholder tokens." in out, out
    assert "image placeholder tokens included" in out
    code, out = run_cli(capsys, "check-data", "--dataset", data, "--model", vlm_dir, "--max_pixels", 1024)
    assert "3 images of the pairs kept hold 36 placeholder tokens (--max_pixels 1024)." in out, out  # 16 + 16 + 4


def test_max_pixels_from_the_environment(capsys, data, vlm_dir, monkeypatch):
    monkeypatch.setenv("MAX_PIXELS", "1024")
    code, out = run_cli(capsys, "check-data", "--dataset", data, "--model", vlm_dir)
    assert "3 images of the pairs kept hold 36 placeholder tokens" in out, out


def test_a_prompt_cut_through_an_image_is_dropped_and_counted(capsys, data, vlm_dir):
    code, out = run_cli(capsys, "check-data", "--dataset", data, "--model", vlm_dir, "--max_length", 40,
                        "--truncation_strategy", "left")
    assert "and 2 (the prompt would be cut through an image)" in out, out


def test_without_a_vision_processor_rows_with_images_are_left_out_of_the_lengths(capsys, data, tmp_path):
    text_model = build_tiny_model(tmp_path / "text", words=["user", "assistant", "w1", "w2", "w5", "w7"])
    code, out = run_cli(capsys, "check-data", "--dataset", data, "--model", text_model, "--template", "chatml")
    assert "(2 rows with images left out:" in out and "has no vision-language processor" in out, out


@pytest.mark.parametrize("row,needle", [
    (swift(["img/a.png", "img/b.png"]), "d.jsonl:1: field 'images' the prompt has 1 <image> tag (or image parts) and "
                                        "the row 2 images."),
    (swift(["img/bad.png"]), "d.jsonl:1: field 'images[0]' cannot be read as an image"),
    (swift(["img/none.png"]), "d.jsonl:1: field 'images[0]' names an image file that does not exist"),
])
def test_bad_rows_are_errors_with_their_line(capsys, data, row, needle):
    (data.parent / "img" / "bad.png").write_text("no image")
    f = write_jsonl(data.parent / "d.jsonl", [row, TEXT])
    code, out = run_cli(capsys, "check-data", "--dataset", f)
    assert code == 1 and needle in out, out
