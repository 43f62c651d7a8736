"""Vision-language pairs in the packed layout (`fastdpo.model.vlm`) against the model's own forwards, run separately
on [prompt | chosen] and [prompt | rejected]: log-prob sums, M-RoPE positions, gradients, one vision call per image,
for the tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL (its DeepStack features included) and LLaVA models.

The images are built directly as the model takes them, not through an image processor. Qwen: an image of h x w
patches (4-pixel patches, `fastdpo.model.tiny.VLM_PATCH`) is `pixel_values` of h w rows of 3 x 2 x 4 x 4 values
(channels x temporal patch x patch x patch) and a grid (1, h, w); its prompt holds (h / 2) (w / 2) placeholder
tokens. LLaVA: every image is one 3 x 16 x 16 picture, without a grid; its prompt holds 16 placeholder tokens."""

import pytest
import torch

from fastdpo.data.tokenize import TokenizedPair
from fastdpo.errors import FastDPOError
from fastdpo.model.tiny import LLAVA_IMAGE_SIZE, LLAVA_IMAGE_TOKENS, build_tiny_llava, build_tiny_vlm
from fastdpo.model.vlm import (
    VisionIds,
    image_embeddings,
    language_attention,
    mrope_positions,
    pack_vision_pairs,
    vision_sequence_logps,
)

FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"]  # M-RoPE
ALL_FAMILIES = FAMILIES + ["llava"]
ATOL = 1e-5


def build(family: str, **kw):
    # weights 10x the default spread, so that an image moves the log-probs well above float32 rounding
    if family == "llava":
        return build_tiny_llava(initializer_range=0.2, **kw)
    return build_tiny_vlm(family, initializer_range=0.2, **kw)


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def model(request):
    return build(request.param)


@pytest.fixture(scope="module", params=FAMILIES)
def qwen_model(request):
    return build(request.param)


def is_llava(config) -> bool:
    return config.model_type == "llava"


def tower(model):
    """The vision tower module (Qwen: with its merger inside)."""
    return model.model.vision_tower if is_llava(model.config) else model.model.visual


def image(h: int, w: int, seed: int, llava: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pixel_values (h w, 96), grid (1, 3)) of an image of h x w patches; LLaVA: (1, 3, 16, 16), no grid."""
    g = torch.Generator().manual_seed(seed)
    if llava:
        return torch.randn(1, 3, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE, generator=g), None
    return torch.randn(h * w, 3 * 2 * 4 * 4, generator=g), torch.tensor([[1, h, w]])


def placeholders(config, grid: torch.Tensor | None) -> list[int]:
    if is_llava(config):
        return [config.image_token_id] * LLAVA_IMAGE_TOKENS
    t, h, w = grid[0].tolist()
    return [config.vision_start_token_id] + [config.image_token_id] * (t * h * w // 4) + [config.vision_end_token_id]


def cat_or_none(tensors: list) -> torch.Tensor | None:
    return None if not tensors or tensors[0] is None else torch.cat(tensors)


def example(config, seed: int = 0) -> tuple[list[TokenizedPair], list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Three pairs and their images: one square image; two images of other sizes, one not square (LLaVA: all of one
    size); no image. Prompts and completions of different lengths."""
    llava = is_llava(config)
    a, b, c = image(4, 4, seed, llava), image(8, 6, seed + 1, llava), image(2, 4, seed + 2, llava)
    images = [[a], [b, c], []]
    prompts = [[3, 5] + placeholders(config, a[1]) + [6, 7],
               [3] + placeholders(config, b[1]) + [8] + placeholders(config, c[1]) + [9, 10, 11],
               [3, 12, 13]]
    completions = [([20, 21, 22], [23, 24]), ([25], [26, 27, 28, 29]), ([30, 31, 32, 33], [34, 35, 36])]
    pairs = [TokenizedPair(p, ch, rj, i) for i, (p, (ch, rj)) in enumerate(zip(prompts, completions))]
    return pairs, images


def batch_of(model, pairs, images):
    flat = [im for ims in images for im in ims]
    return pack_vision_pairs(pairs, model.config, cat_or_none([p for p, _ in flat]), cat_or_none([g for _, g in flat]))


def separate_forward(model, prompt, completion, images):
    """The model's own forward on [prompt | completion] (the processor's inputs; Qwen: mm_token_type_ids included,
    without them transformers 5 falls back to 1-D positions), full float32 logits: (completion log-prob sum, its
    positions: Qwen's rope index, None for LLaVA)."""
    language_attention(model)  # the model's own attention, also after a packed forward switched it
    ids = torch.tensor([prompt + completion])
    llava = is_llava(model.config)
    kw = {} if llava else {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if images:
        kw["pixel_values"] = torch.cat([p for p, _ in images])
        if not llava:
            kw["image_grid_thw"] = torch.cat([g for _, g in images])
    logits = model(input_ids=ids, use_cache=False, **kw).logits[0].float()
    logps = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    positions = None
    if not llava:
        positions, _ = model.model.get_rope_index(ids, kw["mm_token_type_ids"], kw.get("image_grid_thw"))
    return logps[len(prompt) - 1:].sum(), positions


def separate_sums(model, pairs, images):
    """(2B,) chosen then rejected sums and each sequence's positions (3, 1, L), from 2B separate forwards."""
    chosen = [separate_forward(model, p.prompt, p.chosen, ims) for p, ims in zip(pairs, images)]
    rejected = [separate_forward(model, p.prompt, p.rejected, ims) for p, ims in zip(pairs, images)]
    return torch.stack([s for s, _ in chosen + rejected]), [pos for _, pos in chosen + rejected]


def segments(batch):
    """The packed token indices of each sequence, chosen of every pair then rejected: [prompt | own completion]."""
    chosen, rejected, off = [], [], 0
    for n_p, n_c, n_r in batch.pairs.pair_lengths:
        prompt = list(range(off, off + n_p))
        chosen.append(prompt + list(range(off + n_p, off + n_p + n_c)))
        rejected.append(prompt + list(range(off + n_p + n_c, off + n_p + n_c + n_r)))
        off += n_p + n_c + n_r
    return chosen + rejected


def test_packed_logps_equal_separate_forwards(model):
    pairs, images = example(model.config)
    batch = batch_of(model, pairs, images)
    with torch.no_grad():
        packed, tok = vision_sequence_logps(model, batch)
        expected, _ = separate_sums(model, pairs, images)
    assert packed.dtype == torch.float32 and packed.shape == (6,) and tok.shape == (batch.pairs.tgt.numel(),)
    torch.testing.assert_close(packed, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_eager_attention_takes_the_mask_too(family):
    model = build(family)
    model.set_attn_implementation("eager")
    pairs, images = example(model.config, seed=5)
    with torch.no_grad():
        packed, _ = vision_sequence_logps(model, batch_of(model, pairs, images))
        expected, _ = separate_sums(model, pairs, images)
    torch.testing.assert_close(packed, expected, atol=ATOL, rtol=0)


def test_mrope_positions_equal_get_rope_index_per_sequence(qwen_model):
    model = qwen_model
    pairs, images = example(model.config)
    batch = batch_of(model, pairs, images)
    with torch.no_grad():
        _, positions = separate_sums(model, pairs, images)
    for s, (index, expected) in enumerate(zip(segments(batch), positions)):
        assert torch.equal(batch.positions[:, :, index], expected), s
    # images move the text after them: pair 1's prompt of 23 tokens (packed at 15..37) ends at position 14, not 22;
    # its chosen and its rejected completion both start at 15
    assert batch.pairs.pair_lengths[1] == (23, 1, 4)
    assert batch.positions[:, 0, 37].tolist() == [14, 14, 14]
    assert batch.positions[:, 0, 38].tolist() == batch.positions[:, 0, 39].tolist() == [15, 15, 15]


def test_qwen3_vl_deepstack_features_count(monkeypatch):
    """Qwen3-VL's DeepStack features (one per DeepStack layer, added after the first decoder layers) are part of the
    packed forward: without them the sums of the pairs with images move off the separate forwards', those of the pair
    without stay; with them every DeepStack merger gets its gradient, as in the separate forwards."""
    from fastdpo.model import vlm

    model = build("qwen3_vl")
    assert len(model.model.visual.deepstack_merger_list) == len(model.config.vision_config.deepstack_visual_indexes) == 2
    pairs, images = example(model.config)
    batch = batch_of(model, pairs, images)
    with torch.no_grad():
        expected, _ = separate_sums(model, pairs, images)
        kept, _ = vision_sequence_logps(model, batch)
        monkeypatch.setattr(vlm, "deepstack_inputs", lambda *a: {})
        dropped, _ = vision_sequence_logps(model, batch)
    monkeypatch.undo()
    torch.testing.assert_close(kept, expected, atol=ATOL, rtol=0)
    moved = (dropped - expected).abs()
    assert moved[[0, 1, 3, 4]].min() > 1e-3, moved
    torch.testing.assert_close(dropped[[2, 5]], expected[[2, 5]], atol=ATOL, rtol=0)
    grads = weighted_grads(model, lambda: vision_sequence_logps(model, batch)[0])
    for i in range(2):
        assert grads[f"model.visual.deepstack_merger_list.{i}.linear_fc2.weight"].abs().max() > 0


def test_an_image_changes_its_own_pair_only(model):
    pairs, images = example(model.config)
    with torch.no_grad():
        before, _ = vision_sequence_logps(model, batch_of(model, pairs, images))
        pixels, grid = images[1][1]
        changed = [images[0], [images[1][0], (pixels + torch.randn_like(pixels), grid)], images[2]]
        after, _ = vision_sequence_logps(model, batch_of(model, pairs, changed))
    moved = (after - before).abs()
    assert moved[[1, 4]].min() > 1e-3, moved  # pair 1's chosen and rejected
    torch.testing.assert_close(after[[0, 2, 3, 5]], before[[0, 2, 3, 5]], atol=1e-6, rtol=0)


def test_the_vision_tower_runs_once_per_call_on_every_image(model, monkeypatch):
    pairs, images = example(model.config)
    batch = batch_of(model, pairs, images)
    visual = tower(model)
    calls = []
    forward = visual.forward

    def counted(pixels, *args, **kwargs):
        grid = args[0] if args else kwargs.get("grid_thw")
        calls.append((pixels.shape[0], None if grid is None else grid.clone()))
        return forward(pixels, *args, **kwargs)

    monkeypatch.setattr(visual, "forward", counted)
    with torch.no_grad():
        vision_sequence_logps(model, batch)
    assert len(calls) == 1, "one vision call for the 3 images of 3 pairs (separate forwards: 6 calls, 6 images)"
    assert calls[0][0] == batch.pixel_values.shape[0]
    if is_llava(model.config):
        assert batch.image_grid_thw is None and batch.num_images == 3
        tokens = 3 * LLAVA_IMAGE_TOKENS
    else:
        assert torch.equal(calls[0][1], batch.image_grid_thw)
        tokens = 4 + 12 + 2
    assert image_embeddings(model, batch.pixel_values, batch.image_grid_thw).shape == (tokens, 64)


def test_placeholders_and_images_must_agree(qwen_model):
    model = qwen_model
    pairs, images = example(model.config)
    with pytest.raises(FastDPOError, match="more image placeholder runs than images"):
        batch_of(model, pairs, [images[0], images[1][:1], []])
    with pytest.raises(FastDPOError, match="4 images for 3 image placeholder runs"):
        batch_of(model, pairs, [images[0], images[1], [image(2, 2, 9)]])
    short = TokenizedPair(pairs[0].prompt[:3] + pairs[0].prompt[4:], [20], [21], 0)  # one placeholder less
    with pytest.raises(FastDPOError, match="placeholder tokens"):
        batch_of(model, [short], [images[0]])


def test_llava_placeholders_and_images_must_agree():
    """LLaVA's runs have no grid to check them by when packing: the forward counts placeholders against features."""
    model = build("llava")
    pairs, images = example(model.config)
    for fewer in ([images[0], images[1][:1], []], [images[0], images[1], [image(0, 0, 9, llava=True)]]):
        with pytest.raises(FastDPOError, match="image placeholder tokens in the row"), torch.no_grad():
            vision_sequence_logps(model, batch_of(model, pairs, fewer))
    with pytest.raises(FastDPOError, match="without grids"):
        pack_vision_pairs(pairs, model.config, torch.zeros(3, 96), torch.tensor([[1, 4, 4]] * 3))


VISION_PARTS = ("model.visual.", "model.vision_tower.")  # Qwen's tower, LLaVA's


def weighted_grads(model, sums_of) -> dict[str, torch.Tensor]:
    """Gradients by parameter name of a fixed weighting of the (2B,) log-prob sums `sums_of()` returns."""
    model.zero_grad()
    sums = sums_of()
    weights = torch.linspace(-1.0, 1.5, sums.numel())
    (sums * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def assert_grads_close(packed: dict, separate: dict, tol: float = ATOL) -> None:
    """Each gradient within `tol` of the reference, relative to the reference's largest entry when that is above 1
    (these gradients reach about 70: float32 rounding of sums over ~40 tokens is some 1e-5 absolute there)."""
    assert packed.keys() == separate.keys()
    for name in packed:
        scale = max(1.0, separate[name].abs().max().item())
        assert (packed[name] - separate[name]).abs().max().item() <= tol * scale, name


def test_gradients_equal_separate_forwards(model):
    """Every parameter's gradient, the language model's and the vision tower's: the packed forward uses each image
    once where the separate forwards use it twice, and the gradients still agree."""
    pairs, images = example(model.config)
    batch = batch_of(model, pairs, images)
    packed = weighted_grads(model, lambda: vision_sequence_logps(model, batch)[0])
    separate = weighted_grads(model, lambda: separate_sums(model, pairs, images)[0])
    assert any(n.startswith(VISION_PARTS) for n in packed) and any("language_model" in n for n in packed)
    if is_llava(model.config):
        assert any(n.startswith("model.multi_modal_projector.") for n in packed)
    assert_grads_close(packed, separate)


def test_lora_on_the_language_model(model):
    """PEFT LoRA on the language model's attention only (B drawn at random): the packed sums and the adapters'
    gradients equal the separate forwards'; with the adapters off, the sums are the base model's."""
    from peft import LoraConfig, get_peft_model

    base = build(model.config.model_type)
    pairs, images = example(base.config)
    batch = batch_of(base, pairs, images)
    with torch.no_grad():
        plain, _ = vision_sequence_logps(base, batch)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q|k|v|o)_proj"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:  # PEFT starts B at zero, which would hide the adapters
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all("language_model" in n and "lora_" in n for n in trainable)
    hf = peft.get_base_model()  # the same modules, adapters in place: the model's own forward
    packed = weighted_grads(peft, lambda: vision_sequence_logps(peft, batch)[0])
    separate = weighted_grads(peft, lambda: separate_sums(hf, pairs, images)[0])
    assert packed.keys() == set(trainable)
    assert_grads_close(packed, separate)
    with torch.no_grad():
        adapted, _ = vision_sequence_logps(peft, batch)
        expected, _ = separate_sums(hf, pairs, images)
        with peft.disable_adapter():
            off, _ = vision_sequence_logps(peft, batch)
    torch.testing.assert_close(adapted, expected, atol=ATOL, rtol=0)
    assert (adapted - plain).abs().max() > 1e-3
    torch.testing.assert_close(off, plain, atol=ATOL, rtol=0)


def test_mrope_positions_by_hand():
    """One pair: prompt [a, image of 2 x 3 merged tokens, b], chosen [c, d], rejected [e]. The image starts at 1 and
    spans rows 1..2 and columns 1..3, so b resumes at 1 + max(1, 2, 3) = 4; both completions start at 5."""
    img = 9
    row = torch.tensor([[0] + [img] * 6 + [1, 2, 3, 4]])
    got = mrope_positions(row, [(8, 2, 1)], torch.tensor([[1, 4, 6]]), img, 2)
    assert got[:, 0].tolist() == [[0, 1, 1, 1, 1, 1, 1, 4, 5, 6, 5],   # temporal
                                  [0, 1, 1, 1, 2, 2, 2, 4, 5, 6, 5],   # height
                                  [0, 1, 2, 3, 1, 2, 3, 4, 5, 6, 5]]   # width


def test_pixels_from_the_image_processor(qwen_model):
    """The inputs transformers' (PIL) Qwen2-VL image processor writes for two PIL images of 32 x 24 and 16 x 16
    pixels (4-pixel patches, 2 x 2 merge): grids (1, 6, 8) and (1, 4, 4); the packed sums equal the separate
    forwards' on them too."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = torch.Generator().manual_seed(3)
    pictures = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())
                for h, w in ((24, 32), (16, 16))]
    processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                                         max_pixels=64 * 64)
    out = processor(images=pictures, return_tensors="pt")
    grids = out["image_grid_thw"]
    assert grids.tolist() == [[1, 6, 8], [1, 4, 4]]
    patches = grids.prod(-1).tolist()
    first = (out["pixel_values"][: patches[0]], grids[:1])
    second = (out["pixel_values"][patches[0]:], grids[1:])
    model = qwen_model
    cfg = model.config
    pairs = [TokenizedPair([3] + placeholders(cfg, first[1]) + [5, 6], [20, 21], [22], 0),
             TokenizedPair([3, 7] + placeholders(cfg, second[1]), [23], [24, 25, 26], 1)]
    images = [[first], [second]]
    with torch.no_grad():
        packed, _ = vision_sequence_logps(model, batch_of(model, pairs, images))
        expected, _ = separate_sums(model, pairs, images)
    torch.testing.assert_close(packed, expected, atol=ATOL, rtol=0)


def with_pixels(pairs, images):
    """The pairs holding their images, as prepared rows hold them (`TokenizedPair.pixel_values`)."""
    for p, ims in zip(pairs, images):
        if ims:
            p.pixel_values, p.image_grid_thw = torch.cat([x for x, _ in ims]), cat_or_none([g for _, g in ims])
    return pairs


@pytest.fixture
def attention_on_cpu(monkeypatch):
    """fastdpo's CUDA attention kernels by their float32 contracts on the CPU: the varlen kernel by
    `model_helpers.varlen_stand_in`, compiled FlexAttention by its eager form."""
    from model_helpers import varlen_stand_in
    from torch.nn.attention.flex_attention import flex_attention

    from fastdpo.model import attention

    monkeypatch.setattr(attention, "_varlen_kernel", varlen_stand_in)
    monkeypatch.setattr(attention, "_compiled_flex", lambda: flex_attention)


@pytest.mark.parametrize("name", ["varlen", "flex"])
def test_the_text_attention_backends_serve_vision_pairs(model, name, attention_on_cpu):
    """The varlen offsets and a FlexAttention BlockMask (memory linear in the tokens on CUDA) give the packed row's
    sums as the separate forwards do, and varlen every gradient, the vision tower's included; only the language
    model's layers switch to fastdpo's attention, and the model's own forward (the padded path) runs again after."""
    from fastdpo.model.backend import Backend, make_batch, prepare_packed, sequence_logps, target_hidden
    from fastdpo.model.vlm import vision_ids

    pairs, images = example(model.config)
    with_pixels(pairs, images)
    backend = Backend(name, vision=vision_ids(model.config))
    prepare_packed(model, backend)
    batch = make_batch(pairs, backend, 0, torch.device("cpu"), budget=0)
    assert (batch.num_tokens % 128 == 0) == (name == "flex")
    vision_attn = tower(model).config._attn_implementation
    with torch.no_grad():
        packed, _ = sequence_logps(model, batch, backend)
        assert tower(model).config._attn_implementation == vision_attn
        assert model.model.language_model.layers[0].self_attn.config._attn_implementation.startswith("fastdpo")
        expected, _ = separate_sums(model, pairs, images)
    torch.testing.assert_close(packed, expected, atol=ATOL, rtol=0)
    with torch.no_grad():
        sequence_logps(model, batch, backend)  # the switch again, then the model's own path
    padded = make_batch(pairs, backend.plain(), 0, torch.device("cpu"))
    with torch.no_grad():  # the plain path after the packed one: the language model's own attention again
        hidden = target_hidden(model, padded, backend.plain())
    assert hidden.shape[0] == padded.tgt.numel() and torch.isfinite(hidden).all()
    if name == "flex":  # FlexAttention has no backward on the CPU: its gradients are checked on the GPU
        return
    grads = weighted_grads(model, lambda: sequence_logps(model, batch, backend)[0])
    assert any(n.startswith(VISION_PARTS) for n in grads)
    assert_grads_close(grads, weighted_grads(model, lambda: separate_sums(model, pairs, images)[0]))


def test_a_wrong_offset_is_caught(model, attention_on_cpu):
    """The comparison above can fail: offsets that let rejected see chosen move the rejected sums."""
    from fastdpo.model import attention
    from fastdpo.model.backend import Backend, build_mask, make_batch, prepare_packed, sequence_logps
    from fastdpo.model.vlm import vision_ids

    pairs, images = example(model.config)
    with_pixels(pairs, images)
    backend = Backend("varlen", vision=vision_ids(model.config))
    prepare_packed(model, backend)
    batch = make_batch(pairs, backend, 0, torch.device("cpu"))
    n = batch.num_tokens
    leaky = attention.VarlenMask(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                                 torch.tensor([0, n], dtype=torch.int32), 1 << (n - 1).bit_length(),
                                 1 << (n - 1).bit_length())  # one causal sequence over the whole row
    with torch.no_grad():
        right, _ = sequence_logps(model, batch, backend, build_mask(batch, backend))
        wrong, _ = sequence_logps(model, batch, backend, leaky)
    assert (right[3:] - wrong[3:]).abs().max() > 1e-3  # rejected sums


def test_backend_choice_for_a_vision_language_model(monkeypatch):
    """auto: dense on the CPU, varlen on CUDA in bfloat16 and flex in float32 (as for text); the names users bring
    (flash_attention_2) map to auto; a sliding-window language model takes the padded rows; sequence parallelism is
    refused with what to do."""
    from fastdpo.model import backend as backend_mod
    from fastdpo.model.backend import choose_backend
    from fastdpo.parallel import sequence

    model = build_tiny_vlm("qwen2_5_vl")
    ids = (model.config.image_token_id, model.config.vision_config.spatial_merge_size)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_backend(model, "auto", True, cpu) == backend_mod.Backend("dense", vision=ids)
    assert choose_backend(model, "flash_attention_2", True, cpu).name == "dense"
    assert choose_backend(model, "auto", False, cpu) == backend_mod.Backend("padded", vision=ids)
    with pytest.raises(FastDPOError, match="varlen needs a CUDA device"):
        choose_backend(model, "varlen", True, cpu)
    monkeypatch.setattr(backend_mod, "varlen_unsupported", lambda m: "" if m.dtype == torch.bfloat16 else "float32")
    assert choose_backend(model, "auto", True, cuda).name == "flex"
    assert choose_backend(model.to(torch.bfloat16), "auto", True, cuda, lengths=8) == backend_mod.Backend(
        "varlen", lengths=8, vision=ids)
    with pytest.raises(FastDPOError, match="vision-language model"):
        sequence.resolve_mode(model, "auto", 2, backend_mod.Backend("varlen", vision=ids))
    llava = build_tiny_llava()
    assert choose_backend(llava, "auto", True, cpu) == backend_mod.Backend("dense", vision=VisionIds(llava.config.image_token_id))
    assert choose_backend(llava, "auto", False, cpu).vision.merge_size is None
    windowed = build_tiny_vlm("qwen2_5_vl")
    text = windowed.model.language_model.config
    text.sliding_window, text.layer_types = 8, ["sliding_attention"] * text.num_hidden_layers
    assert choose_backend(windowed, "auto", True, cpu).name == "padded"


@pytest.mark.parametrize("name", ["dense", "varlen"])
def test_a_prompts_pairs_with_the_same_images_form_one_group(model, name, attention_on_cpu, monkeypatch):
    """Two pairs of one prompt and image (a list of rejected replies) pack as one run [prompt | y1 | ... | yK], the
    image once; a third pair of the same prompt ids with another image of the same size stays apart. Sums and every
    gradient equal the separate forwards, and the vision tower sees each distinct image once."""
    from fastdpo.model.backend import Backend, make_batch, prepare_packed, sequence_logps
    from fastdpo.model.vlm import vision_ids

    pairs, images = example(model.config)
    twin = TokenizedPair(pairs[0].prompt, pairs[0].chosen, [40, 41, 42], 3)  # same prompt, same image, shared chosen
    other = image(4, 4, 7, is_llava(model.config))  # the same size as pair 0's image: the same placeholder ids
    apart = TokenizedPair(pairs[0].prompt, [43], [44, 45], 4)
    pairs, images = pairs + [twin, apart], images + [images[0], [other]]
    with_pixels(pairs, images)
    backend = Backend(name, vision=vision_ids(model.config)).grouping(True)
    prepare_packed(model, backend)
    batch = make_batch(pairs, backend, 0, torch.device("cpu"))
    assert len(batch.pair_lengths) == 4 and len(batch.pair_lengths[0]) == 4  # prompt, chosen (shared), two rejected
    assert batch.unit_heads == (0, 1, 2, 4)
    seen = []
    tower = model.model.visual if hasattr(model.model, "visual") else model.model.vision_tower
    hook = tower.register_forward_pre_hook(lambda m, args, kw: seen.append(args[0].shape[0]), with_kwargs=True)
    try:
        with torch.no_grad():
            packed, _ = sequence_logps(model, batch, backend)
    finally:
        hook.remove()
    assert sum(seen) == sum(x.shape[0] for x, _ in images[0] + images[1] + images[4])  # pair 0's image once
    expected, _ = separate_sums(model, pairs, images)
    torch.testing.assert_close(packed, expected, atol=ATOL, rtol=0)
    grads = weighted_grads(model, lambda: sequence_logps(model, batch, backend)[0])
    assert_grads_close(grads, weighted_grads(model, lambda: separate_sums(model, pairs, images)[0]))
