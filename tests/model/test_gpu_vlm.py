"""Vision-language pairs through the CUDA attention backends (varlen, flex) in bfloat16 against the model's own
multimodal forwards in float32 on the same weights, and a VLM run on CUDA taking varlen by default. Run on a CUDA
device: `pytest -m gpu tests/model/test_gpu_vlm.py`."""

import json

import pytest
import torch
from data_helpers import write_jsonl
from gpu_helpers import logps_and_grads, rel
from vlm_helpers import image_rows

from fastdpo.data.tokenize import TokenizedPair
from fastdpo.model.backend import Backend, choose_backend, make_batch, prepare_packed
from fastdpo.model.vlm import VisionIds

pytestmark = pytest.mark.gpu

PATCH = 14


def small_vlm(dtype):
    """A random-init Qwen2.5-VL of width 512 (head 64, GQA), a 2-block vision tower of 14-pixel patches, on CUDA."""
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e6})
    vision = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=512, patch_size=PATCH,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1])
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=4092,
                                        video_token_id=4093, vision_start_token_id=4094, vision_end_token_id=4095)
    with torch.device("cuda"):
        return transformers.Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=dtype,
                                                                           attn_implementation="sdpa")


def pairs_with_images(n: int, seed: int = 0) -> list[TokenizedPair]:
    """n pairs, one image of (2a x 2b) patches each (a, b in 4..12: 16 to 144 placeholder tokens), prompts and
    completions of 20 to 200 tokens."""
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(10, 4000, (k,), generator=g).tolist()

    out = []
    for i in range(n):
        h, w = (2 * int(torch.randint(4, 13, (1,), generator=g)) for _ in range(2))
        pixels = torch.randn(h * w, 3 * 2 * PATCH * PATCH, generator=g)
        prompt = ids(int(torch.randint(5, 60, (1,), generator=g))) + [4094] + [4092] * (h * w // 4) + [4095] + ids(8)
        chosen, rejected = (ids(int(torch.randint(20, 200, (1,), generator=g))) for _ in range(2))
        out.append(TokenizedPair(prompt, chosen, rejected, i, pixel_values=pixels,
                                 image_grid_thw=torch.tensor([[1, h, w]])))
    return out


@pytest.mark.parametrize("name", ["varlen", "flex"])
def test_vision_pairs_bf16_match_the_float32_model_forwards(name):
    pairs = pairs_with_images(6)
    cuda = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_model = small_vlm(torch.float32)
    ids = VisionIds(4092, 2)
    plain = Backend("padded", vision=ids)
    slow, g_slow = logps_and_grads(ref_model, [make_batch(pairs[i:i + 3], plain, 0, cuda) for i in (0, 3)], plain)
    del ref_model
    model = small_vlm(torch.bfloat16)
    model.train()
    backend = choose_backend(model, name, True, cuda)
    assert backend.name == name and backend.vision == ids
    prepare_packed(model, backend)
    batches = [make_batch(pairs[i:i + 3], backend, 0, cuda, budget=4096) for i in (0, 3)]
    fast, g_fast = logps_and_grads(model, batches, backend)
    assert rel(fast, slow) < 1e-2
    assert any(n.startswith("model.visual.") for n in g_slow)
    worst = max(rel(g_fast[n], g_slow[n]) for n in g_slow)
    assert worst < 5e-2, worst


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_vision_language_run_on_cuda_takes_varlen(tmp_path, family):
    from fastdpo import TrainConfig, train
    from fastdpo.model.tiny import build_tiny_vlm_dir

    model_dir = build_tiny_vlm_dir(tmp_path / "model", family)
    data = write_jsonl(tmp_path / "d.jsonl", image_rows(tmp_path))
    cfg = TrainConfig(model=str(model_dir), dataset=[str(data)], output_dir=str(tmp_path / "o"), max_steps=2,
                      per_device_train_batch_size=2, torch_dtype="bfloat16", learning_rate=1e-3)
    summary = train(cfg, progress=False)
    assert summary["backend"] == "varlen"
    cert = json.loads((tmp_path / "o" / "summary.json").read_text())["certificate"]
    assert cert["status"] == "PASS", cert


def test_a_trained_vision_tower_checkpointed_on_cuda_gives_the_same_gradients():
    """On CUDA in bfloat16 (varlen, the reentrant recompute training uses on one GPU): with the tower's blocks
    checkpointed the log-probs and every gradient, the tower's included, are those without, and the memory plan's
    per-pixel figures order as they should (whole above checkpointed, both measured on the device)."""
    from fastdpo.model.memory import apply_checkpointing, vision_blocks
    from fastdpo.training.fit import measure_vision

    pairs = pairs_with_images(6)
    cuda = torch.device("cuda")
    model = small_vlm(torch.bfloat16)
    model.train()
    backend = choose_backend(model, "varlen", True, cuda)
    prepare_packed(model, backend)
    whole, checkpointed = measure_vision(model, pairs, cuda)
    assert whole > 1.25 * checkpointed > 0  # 1.53x on an H100: varlen attention keeps no score matrices
    batches = [make_batch(pairs[i:i + 3], backend, 0, cuda, budget=4096) for i in (0, 3)]
    plain, g_plain = logps_and_grads(model, batches, backend)
    assert apply_checkpointing(model, "full", reentrant=True)
    assert all(getattr(b, "_fastdpo_ckpt", False) for b in vision_blocks(model))
    again, g_again = logps_and_grads(model, batches, backend)
    assert rel(again, plain) < 1e-3
    assert any(n.startswith("model.visual.blocks") for n in g_plain)
    worst = max(rel(g_again[n], g_plain[n]) for n in g_plain)
    assert worst < 2e-2, worst
