"""`fastdpo verify`: every fast path and checkpointing policy gives the plain path's gradients, and the check has
teeth; memory savings are measured and a missing saving gets a named cause."""

import json

import pytest
import torch
from conftest import easy_rows, write_jsonl

from fastdpo.cli import main
from fastdpo.memory import apply_checkpointing
from fastdpo.model import Backend, load_model, prepare_packed
from fastdpo.verify import HeldForBackward, no_saving_causes, param_group, run_verify


@pytest.fixture(autouse=True)
def _logging(restore_logging):
    pass


@pytest.fixture
def data(tmp_path):
    rows = easy_rows(12, seed=4)
    for i, r in enumerate(rows):  # varied completion lengths
        r["chosen"] += " w11" * (i % 4)
    return write_jsonl(tmp_path / "d.jsonl", rows)


def test_param_groups():
    assert param_group("model.layers.0.self_attn.q_proj.weight") == "attention"
    assert param_group("model.layers.1.mlp.down_proj.weight") == "mlp"
    assert param_group("model.layers.1.post_attention_layernorm.weight") == "norm"
    assert param_group("model.embed_tokens.weight") == "embed" and param_group("lm_head.weight") == "lm_head"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_every_path_and_policy_passes_on_cpu(model_dirs, data, family):
    results = run_verify(str(model_dirs(family)), [str(data)], num_pairs=8, max_length=64)
    names = [r.name for r in results]
    assert names[0].startswith("plain") and results[0].worst == 0.0
    assert "packed dense" in names and any("budget" in n for n in names)
    assert [r.policy for r in results if r.policy != "none"] == ["full", "ffn", "attn", "every:2"]
    for r in results:
        assert r.passed, (r.name, r.groups)
        assert set(r.groups) >= {"attention", "mlp", "norm", "embed"}
        assert r.tolerance == 1e-4 and r.worst < 1e-5
    policies = {r.policy: r for r in results if r.policy != "none"}
    assert all(r.lowered and not r.causes for r in policies.values())
    packed = next(r for r in results if r.name == "packed dense")
    assert policies["full"].held_mib < policies["ffn"].held_mib < packed.held_mib
    assert packed.held_mib < results[0].held_mib  # the prompt is computed once, no padding


def test_verify_fails_when_a_fast_path_is_wrong(model_dirs, data, monkeypatch, capsys, tmp_path):
    import fastdpo.attention as attention

    real = attention.allowed

    def leaky(q_pair, k_pair, q_seg, k_seg, *rest):  # rejected may see chosen: a bug the check must catch
        return real(q_pair, k_pair, q_seg, k_seg.clamp(max=0) if k_seg.dtype != torch.bool else k_seg, *rest)

    monkeypatch.setattr(attention, "allowed", leaky)
    out = tmp_path / "r.json"
    rc = main(["verify", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--pairs", "6",
               "--policies", "ffn", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1 and "FAIL" in text
    rows = json.loads(out.read_text())
    assert rows[0]["passed"] and not any(r["passed"] for r in rows[1:])


def test_verify_command_passes(model_dirs, data, capsys, tmp_path):
    out = tmp_path / "r.json"
    rc = main(["verify", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--pairs", "4",
               "--policies", "full,every:2", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "PASS: 4 paths match the plain path" in text and "held MiB" in text
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows][-2:] == ["full", "every:2"] and all(r["passed"] for r in rows)


def test_eval_mode_is_named_when_checkpointing_saves_nothing(model_dirs):
    from conftest import random_pairs

    from fastdpo.data.pack import pack_pairs
    from fastdpo.model import sequence_logps

    model = load_model(str(model_dirs("qwen3")), torch.float32, torch.device("cpu"))
    prepare_packed(model, Backend("dense"))
    batch = pack_pairs(random_pairs(4, model.config.vocab_size, seed=1))

    def held():
        with HeldForBackward(model) as meter:
            sequence_logps(model, batch, Backend("dense"))
        return meter.mib

    model.train()
    plain = held()
    wrapped = apply_checkpointing(model, "full")
    assert held() < 0.5 * plain
    model.eval()  # checkpointing is bypassed outside train mode: nothing saved
    assert held() == pytest.approx(plain)
    causes = no_saving_causes(model, wrapped, longest_pair=30)
    assert len(causes) == 1 and "eval mode" in causes[0] and "case 4" in causes[0]
    model.train()
    assert "small share of memory at this length" in no_saving_causes(model, wrapped, 30)[0]
    assert "wrapped no module" in no_saving_causes(model, [], 30)[0]


@pytest.mark.gpu
def test_flex_and_compiled_paths_pass_on_cuda(model_dirs, data):
    results = run_verify(str(model_dirs("qwen3")), [str(data)], num_pairs=8, max_length=64, device="cuda")
    names = [r.name for r in results]
    assert "packed flex" in names and "packed dense" in names and any("compiled" in n for n in names)
    assert all(r.passed for r in results), [(r.name, r.worst) for r in results if not r.passed]
    assert all(r.peak_mib is not None for r in results)


def test_verify_takes_conversational_rows_with_a_template(model_dirs, capsys, tmp_path):
    from conftest import WORDS

    from fastdpo.verify import load_pairs

    rows = [{"prompt": [{"role": "user", "content": " ".join(WORDS[4 + i:10 + i])}],
             "chosen": [{"role": "assistant", "content": " ".join(WORDS[5 + i:8 + i])}],
             "rejected": [{"role": "assistant", "content": " ".join(WORDS[6 + i:11 + i])}]} for i in range(4)]
    data = write_jsonl(tmp_path / "conv.jsonl", rows)
    model = str(model_dirs("qwen3"))
    plain = load_pairs(model, [str(data)], 4, 512, 42, False, template="chatml")
    chat = load_pairs(model, [str(data)], 4, 512, 42, False, template="chatml", system="be brief")
    assert len(chat) == 4 and all(len(c.prompt) > len(p.prompt) for c, p in zip(chat, plain))
    rc = main(["verify", "--model", model, "--dataset", str(data), "--pairs", "4", "--policies", "full",
               "--template", "chatml"])
    assert rc == 0 and "PASS" in capsys.readouterr().out
