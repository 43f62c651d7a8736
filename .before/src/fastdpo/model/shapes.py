"""Random-init model shapes for benchmarks and tuning (Qwen3 0.6B/1.7B/8B, Llama-3 8B, a tiny one for CPUs): the
real architectures from their configs, with nothing to download."""

from __future__ import annotations

import gc
import tempfile

import torch

from fastdpo.config import TrainConfig
from fastdpo.data.anchor import VOCAB, anchor_tokenizer
from fastdpo.errors import FastDPOError

SHAPES = {
    # a few-layer model to try the commands and scripts on a CPU in seconds
    "tiny": dict(family="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, vocab_size=4096),
    "qwen3-0.6b": dict(family="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(family="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(family="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "llama3-8b": dict(family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                      vocab_size=128256, rope_theta=500000.0),
}


def shape_config(name: str):
    import transformers

    if name not in SHAPES:
        raise FastDPOError(f"--shape {name!r} is unknown. Choose from: {', '.join(SHAPES)}.")
    spec = dict(SHAPES[name])
    family = spec.pop("family")
    cls = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
    spec.setdefault("vocab_size", VOCAB)
    return cls(max_position_embeddings=32768, **spec)


def bench_model(cfg: TrainConfig, shape: str | None, device: torch.device, dtype: torch.dtype):
    """(tokenizer, model): a random-init shape with the anchor tokenizer, or --model. A QLoRA base is quantised while
    loading, from weights on disk: a random-init shape is saved to a temporary dir first and loaded like a user's."""
    from transformers import AutoModelForCausalLM

    from fastdpo.model.load import load_model, load_tokenizer

    bits = cfg.quant_bits if cfg.train_type == "qlora" else 0
    if not shape:
        return load_tokenizer(cfg.model), load_model(cfg.model, dtype, device, quant_bits=bits)
    tokenizer = anchor_tokenizer(shape_config(shape).vocab_size)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=dtype, attn_implementation="sdpa")
    if not bits:
        return tokenizer, model
    with tempfile.TemporaryDirectory(prefix="fastdpo-shape-") as tmp:
        model.save_pretrained(tmp)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return tokenizer, load_model(tmp, dtype, device, quant_bits=bits)
