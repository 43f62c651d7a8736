"""Rows with images prepared for the model: the token ids are the model's processor's own for the same conversation
(its chat template, then its call on text and images), each image's placeholders expanded to grid_t * grid_h *
grid_w / merge^2; --max_pixels / MAX_PIXELS reach the image processor; a prompt is never cut through an image."""

import dataclasses

import pytest
import torch
from data_helpers import assistant, user, write_image

from fastdpo.data.formats import Row, RowError
from fastdpo.data.tokenize import TokenizeOptions
from fastdpo.data.vision import ImageRef
from fastdpo.data.vision_tokenize import PixelOptions, tokenize_vision_rows
from fastdpo.errors import FastDPOError
from fastdpo.model.tiny import tiny_vlm_config, tiny_vlm_processor

PAD, START = 76, 78  # <|image_pad|>, <|vision_start|> of the tiny processor (the model config's ids)


@pytest.fixture(scope="module")
def processor():
    return tiny_vlm_processor()


def row_with(images: list, prompt: str = "<image>w1 w2 <image>", chosen: str = "w5 w6", rejected: str = "w7") -> Row:
    return Row([user(prompt)], [assistant(chosen)], [assistant(rejected)], "d.jsonl:1", format="ms_swift",
               images=tuple(ImageRef(str(p)) for p in images))


def parts(text: str) -> list:
    """The TRL content parts the processor's chat template takes for a text with <image> tags."""
    out = []
    for i, piece in enumerate(text.split("<image>")):
        out += ([{"type": "image"}] if i else []) + ([{"type": "text", "text": piece}] if piece else [])
    return out


def runs(ids: list[int]) -> list[int]:
    """Lengths of the runs of image placeholders."""
    out, n = [], 0
    for t in ids + [-1]:
        if t == PAD:
            n += 1
        elif n:
            out, n = out + [n], 0
    return out


def test_token_ids_are_the_processors_own(tmp_path, processor):
    from PIL import Image

    a, b = write_image(tmp_path / "a.png", 24, 16), write_image(tmp_path / "b.png", 16, 16, (0, 90, 0))
    (got,), stats = tokenize_vision_rows(processor, [row_with([a, b])], TokenizeOptions())
    pair = got.pair
    for completion, ids in (("w5 w6", pair.chosen), ("w7", pair.rejected)):
        text = processor.apply_chat_template([{"role": "user", "content": parts("<image>w1 w2 <image>")},
                                              assistant(completion)], tokenize=False)
        own = processor(text=[text], images=[Image.open(a), Image.open(b)], add_special_tokens=False)
        assert own["input_ids"][0] == pair.prompt + ids
        assert torch.equal(torch.as_tensor(own["pixel_values"]), got.pixel_values)
    assert got.image_grid_thw.tolist() == [[1, 4, 6], [1, 4, 4]]  # 24 x 16 pixels in 4-pixel patches
    assert runs(pair.prompt) == [6, 4]  # t h w / 2^2 each
    assert stats.images == 2 and stats.image_tokens == 10 and got.pixel_values.shape[0] == 24 + 16


def test_the_prepared_pair_packs_for_the_model(tmp_path, processor):
    from fastdpo.model.vlm import pack_vision_pairs

    a = write_image(tmp_path / "a.png", 24, 16)
    pairs, _ = tokenize_vision_rows(processor, [row_with([a, a])], TokenizeOptions())
    batch = pack_vision_pairs([p.pair for p in pairs], tiny_vlm_config("qwen2_5_vl", 80),
                              pairs[0].pixel_values, pairs[0].image_grid_thw)
    assert batch.num_images == 2 and batch.positions.shape[-1] == pairs[0].pair.num_tokens


def test_rows_without_images_go_through_the_same_template(processor):
    row = Row([user("w1 w2")], [assistant("w5")], [assistant("w7")], "d.jsonl:2", format="ms_swift")
    (got,), _ = tokenize_vision_rows(processor, [row], TokenizeOptions())
    text = processor.apply_chat_template([user("w1 w2")], tokenize=False, add_generation_prompt=True)
    assert got.pixel_values is None and got.pair.prompt == processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_max_pixels_changes_the_grid(tmp_path, processor):
    big = write_image(tmp_path / "big.png", 64, 64)
    rows = [row_with([big], prompt="<image>w1")]

    def grid(pixels: PixelOptions) -> list:
        (got,), _ = tokenize_vision_rows(processor, rows, TokenizeOptions(), pixels)
        assert runs(got.pair.prompt) == [int(got.image_grid_thw.prod()) // 4]
        assert got.pixel_values.shape[0] == int(got.image_grid_thw.prod())
        return got.image_grid_thw.tolist()

    assert grid(PixelOptions()) == [[1, 16, 16]]  # the processor's own bound (64 x 64 pixels) keeps the size
    assert grid(PixelOptions(max_pixels=32 * 32)) == [[1, 8, 8]]
    assert grid(PixelOptions.resolve(environ={"MAX_PIXELS": "1024"})) == [[1, 8, 8]]  # ms-swift's variable
    assert PixelOptions.resolve(2048, environ={"MAX_PIXELS": "1024"}).max_pixels == 2048  # the flag wins
    small = write_image(tmp_path / "small.png", 8, 8)
    (got,), _ = tokenize_vision_rows(processor, [row_with([small], prompt="<image>w1")], TokenizeOptions(),
                                     PixelOptions(min_pixels=16 * 16))
    assert got.image_grid_thw.tolist() == [[1, 4, 4]]


@pytest.mark.parametrize("env,needle", [({"MAX_PIXELS": "lots"}, "the MAX_PIXELS environment variable must be a whole"),
                                        ({"MAX_PIXELS": "64", "MIN_PIXELS": "128"}, "min_pixels 128 is above")])
def test_bad_pixel_bounds(env, needle):
    with pytest.raises(FastDPOError, match=needle):
        PixelOptions.resolve(environ=env)


@pytest.mark.parametrize("option", ["max_length", "max_prompt_length"])
def test_a_prompt_is_never_cut_through_an_image(tmp_path, processor, option):
    a = write_image(tmp_path / "a.png", 16, 16)
    row = row_with([a], prompt=" ".join(f"w{i}" for i in range(10)) + " <image>w1", chosen="w5", rejected="w7")
    (whole,), _ = tokenize_vision_rows(processor, [row], TokenizeOptions())
    p, c = whole.pair.prompt, len(whole.pair.chosen)
    keep = len(p) - p.index(START)  # from the image's vision start on

    def limited(n: int):
        limit = {"max_length": n + c, "max_prompt_length": n}[option]
        return tokenize_vision_rows(processor, [row], TokenizeOptions(truncation_strategy="left", **{option: limit}))

    (kept,), stats = limited(keep)
    assert kept.pair.prompt == p[-keep:] and kept.pair.prompt[0] == START and stats.prompt_trimmed == 1
    pairs, stats = limited(keep - 1)
    assert pairs == [] and stats.dropped_image_cut == 1 and stats.dropped == 1 and stats.prompt_trimmed == 0


def test_image_tokens_count_toward_the_length(tmp_path, processor):
    a = write_image(tmp_path / "a.png", 64, 64)
    lengths: list = []
    (got,), _ = tokenize_vision_rows(processor, [row_with([a], prompt="<image>w1")], TokenizeOptions(), lengths=lengths)
    assert lengths == [(0, len(got.pair.prompt), 3, 2)] and len(got.pair.prompt) > 64
    pairs, stats = tokenize_vision_rows(processor, [row_with([a], prompt="<image>w1")], TokenizeOptions(max_length=40))
    assert pairs == [] and stats.dropped_prompt_too_long == 1


def test_bad_images_are_problems_of_their_row(tmp_path, processor):
    bad = tmp_path / "bad.png"
    bad.write_text("not an image")
    good = row_with([write_image(tmp_path / "a.png")], prompt="<image>w1")
    problems: list = []
    pairs, _ = tokenize_vision_rows(processor, [row_with([bad], prompt="<image>w1"), good], TokenizeOptions(),
                                    problems=problems)
    assert [p.pair.index for p in pairs] == [1] and [e.reason for e in problems] == ["unreadable image"]
    with pytest.raises(RowError, match="d.jsonl:1: field 'images\\[0\\]' cannot be read as an image"):
        tokenize_vision_rows(processor, [row_with([bad], prompt="<image>w1")], TokenizeOptions())


@pytest.mark.parametrize("family, patch", [("qwen2_5_vl", 4), ("qwen3_vl", 4), ("qwen3_vl", 16)])
def test_prepared_rows_score_as_the_model_scores_the_processors_own_inputs(tmp_path, family, patch):
    """End to end: rows read with images, prepared here and packed (`fastdpo.model.vlm`), give the log-prob sums of
    the model's own forward on what its processor makes of each whole conversation (Qwen3-VL: its own processor,
    with its pixel statistics, and its DeepStack features; also with its real 16-pixel patches, the images and the
    area bounds scaled with them)."""
    from PIL import Image

    from fastdpo.model.tiny import build_tiny_vlm
    from fastdpo.model.vlm import pack_vision_pairs, vision_sequence_logps

    k = patch // 4
    processor = tiny_vlm_processor(family=family, patch_size=patch, min_pixels=(16 * k) ** 2, max_pixels=(64 * k) ** 2)
    model = build_tiny_vlm(family, initializer_range=0.2, vision={"patch_size": patch})
    a = write_image(tmp_path / "a.png", 24 * k, 16 * k)
    b = write_image(tmp_path / "b.png", 16 * k, 16 * k, (0, 90, 0))
    rows = [row_with([a, b]), row_with([b], prompt="w3 <image>", chosen="w8", rejected="w9 w9")]
    pairs, _ = tokenize_vision_rows(processor, rows, TokenizeOptions())
    assert pairs[0].image_grid_thw.tolist() == [[1, 4, 6], [1, 4, 4]]  # 6 and 4 placeholders at any patch size
    assert pairs[0].pixel_values.shape[1] == 3 * 2 * patch * patch
    batch = pack_vision_pairs([p.pair for p in pairs], model.config, torch.cat([p.pixel_values for p in pairs]),
                              torch.cat([p.image_grid_thw for p in pairs]))
    expected = []
    with torch.no_grad():
        packed, _ = vision_sequence_logps(model, batch)
        for side in ("chosen", "rejected"):
            for row in rows:
                prompt = [{"role": "user", "content": parts(row.prompt[0]["content"])}]
                images = [Image.open(ref.path) for ref in row.images]
                texts = (processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                         processor.apply_chat_template(prompt + getattr(row, side), tokenize=False))
                alone, enc = (processor(text=[t], images=images, return_tensors="pt", add_special_tokens=False)
                              for t in texts)
                ids = enc["input_ids"][0]
                logps = torch.log_softmax(model(**enc, use_cache=False).logits[0, :-1].float(), -1)
                expected.append(logps.gather(1, ids[1:, None])[alone["input_ids"].shape[1] - 1:].sum())
    assert torch.allclose(packed, torch.stack(expected), atol=1e-5), (packed, expected)


def test_llava_rows_take_the_processors_fixed_runs(tmp_path):
    """A LLaVA processor (CLIP image processor of one fixed size): each `<image>` becomes its run of 16 image tokens,
    pixel_values hold one 3 x 16 x 16 picture per image and no grid; the pair counts its images by them and packs
    with the plain positions."""
    from PIL import Image

    from fastdpo.model.tiny import LLAVA_IMAGE_TOKENS, tiny_llava_config, tiny_llava_processor
    from fastdpo.model.vlm import pack_vision_pairs

    llava = tiny_llava_processor()
    a, b = write_image(tmp_path / "a.png", 24, 16), write_image(tmp_path / "b.png", 16, 16, (0, 90, 0))
    (got,), stats = tokenize_vision_rows(llava, [row_with([a, b])], TokenizeOptions())
    text = llava.apply_chat_template([{"role": "user", "content": parts("<image>w1 w2 <image>")},
                                      assistant("w5 w6")], tokenize=False)
    own = llava(text=[text], images=[Image.open(a), Image.open(b)], add_special_tokens=False)
    assert own["input_ids"][0] == got.pair.prompt + got.pair.chosen
    assert got.pixel_values.shape == (2, 3, 16, 16) and got.image_grid_thw is None and got.num_images == 2
    assert stats.image_tokens == 2 * LLAVA_IMAGE_TOKENS == got.pair.prompt.count(llava.image_token_id)
    pair = dataclasses.replace(got.pair, pixel_values=got.pixel_values)
    assert pair.num_images == 2
    batch = pack_vision_pairs([pair], tiny_llava_config(), got.pixel_values)
    assert batch.num_images == 2 and torch.equal(batch.positions, batch.pairs.position_ids)


def test_pixel_bounds_with_a_fixed_size_image_processor(tmp_path):
    """Flags are refused; the environment variables (ms-swift's, for Qwen2-VL) are left to Qwen2-VL models."""
    from fastdpo.model.tiny import tiny_llava_processor

    images = tiny_llava_processor().image_processor
    with pytest.raises(FastDPOError, match="one fixed size"):
        PixelOptions.resolve(max_pixels=4096, environ={}).size(images)
    assert PixelOptions.resolve(environ={"MAX_PIXELS": "4096"}).size(images) is None
