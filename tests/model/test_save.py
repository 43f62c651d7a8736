"""Saving a full model: the fast host copy (`host_state_dict`) writes the very files transformers writes from the
model itself, tied embeddings included."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config

from fastdpo.model.load import host_state_dict


def tiny(tied: bool):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(cfg)


def test_the_host_copy_saves_the_same_files_and_keeps_tied_weights_one(tmp_path):
    for tied in (True, False):
        m = tiny(tied)
        copy = host_state_dict(m, gpu_only=False)
        state = m.state_dict()
        assert set(copy) == set(state)
        for name, t in state.items():
            assert torch.equal(copy[name], t) and copy[name].data_ptr() != t.data_ptr(), name
        assert (copy["lm_head.weight"] is copy["model.embed_tokens.weight"]) == tied
        m.save_pretrained(tmp_path / f"own-{tied}")
        m.save_pretrained(tmp_path / f"copy-{tied}", state_dict=copy)
        own, ours = load_file(tmp_path / f"own-{tied}" / "model.safetensors"), load_file(
            tmp_path / f"copy-{tied}" / "model.safetensors")
        assert set(own) == set(ours) and ("lm_head.weight" in ours) != tied
        assert all(torch.equal(own[k], ours[k]) for k in own)


def test_nothing_is_copied_for_a_cpu_model_or_for_views_sharing_a_storage():
    m = tiny(True)
    assert host_state_dict(m) is None  # on the CPU: transformers saves it as it is

    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("whole", torch.arange(6.0))
            self.register_buffer("first", self.whole[:3])

    assert host_state_dict(Views(), gpu_only=False) is None


def test_no_host_copy_when_the_host_is_short_of_memory(monkeypatch):
    from fastdpo.model import load

    m = tiny(True)
    assert load.host_state_dict(m, gpu_only=False) is not None
    monkeypatch.setattr(load, "_host_free_bytes", lambda: 1_000)  # the model is far more than a quarter of this
    assert load.host_state_dict(m, gpu_only=False) is None
