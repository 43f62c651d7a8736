"""`fastdpo verify`: every fast path and checkpointing policy gives the plain path's gradients (against the plain path
in float32, within twice the plain path's own rounding error in lower precision), checkpointing gives the same
gradients as no checkpointing, and the check has teeth; memory savings are measured and a missing saving gets a named
cause."""

import json

import pytest
import torch
from data_helpers import easy_rows, write_jsonl

from fastdpo.cli import main
from fastdpo.commands.verify import (
    TOLERANCE,
    HeldForBackward,
    PathResult,
    no_saving_causes,
    param_group,
    relative_differences,
    run_verify,
    tolerance_for,
)
from fastdpo.model.backend import Backend, prepare_packed
from fastdpo.model.load import load_model
from fastdpo.model.memory import apply_checkpointing


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


def test_relative_difference_is_a_norm_over_the_group():
    ref = {"layers.0.mlp.w": torch.tensor([3.0, 0.0]), "layers.1.mlp.w": torch.tensor([0.0, 4.0]),
           "embed_tokens.weight": torch.tensor([1.0])}
    got = {"layers.0.mlp.w": torch.tensor([3.0, 0.5]), "layers.1.mlp.w": torch.tensor([0.0, 4.0]),
           "embed_tokens.weight": torch.tensor([1.0])}
    d = relative_differences(got, ref)
    assert d["mlp"] == pytest.approx(0.5 / 5.0) and d["embed"] == 0.0


def test_tolerance_is_twice_the_plain_paths_own_error_never_below_the_dtype_minimum():
    assert tolerance_for(torch.float32, 0.0) == (1e-4, "dtype")
    assert tolerance_for(torch.bfloat16, 0.005) == (3e-2, "dtype")
    assert tolerance_for(torch.bfloat16, 0.105) == (pytest.approx(0.21), "floor")
    assert tolerance_for(torch.float16, 0.02) == (pytest.approx(0.04), "floor")
    assert tolerance_for(torch.bfloat16, 0.105, user=0.05) == (0.05, "user")


def test_a_policy_passes_only_when_it_also_equals_the_path_without_checkpointing():
    def row(worst, same):
        return PathResult("ckpt full", "dense", "full", {"mlp": worst}, 0.2, 1.0, None, 0.1, dtype="bfloat16",
                          floor=0.1, tolerance_from="floor", vs_no_ckpt=same, ckpt_tolerance=3e-2)

    assert row(0.15, 0.0).passed and row(0.15, 3e-2).passed
    assert not row(0.15, 0.031).passed  # within the float32 tolerance, but recomputation changed the gradients
    assert not row(0.25, 0.0).passed
    plain = PathResult("plain (padded)", "padded", "none", {"mlp": 0.1}, 0.2, 1.0, None, 0.1)
    assert plain.passed and plain.vs_no_ckpt is None


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_every_path_and_policy_passes_on_cpu(model_dirs, data, family):
    results = run_verify(str(model_dirs(family)), [str(data)], num_pairs=8, max_length=64)
    names = [r.name for r in results]
    assert names[0].startswith("plain") and results[0].worst == 0.0  # in float32 the plain path is the reference
    assert "packed dense" in names and any("budget" in n for n in names)
    assert [r.policy for r in results if r.policy != "none"] == ["full", "ffn", "attn", "every:2"]
    for r in results:
        assert r.passed, (r.name, r.groups)
        assert set(r.groups) >= {"attention", "mlp", "norm", "embed"}
        assert r.tolerance == 1e-4 and r.worst < 1e-5
        assert r.truth_dtype == "float32" and r.floor == 0.0 and not r.fallback
        assert (r.ckpt_tolerance is None) == (r.policy == "none")
    again = [r for r in results if r.name.endswith(", again")]
    assert [r.name for r in again] == ["packed dense, again"]  # the no-checkpointing path run twice: on CPU
    assert again[0].vs_no_ckpt == 0.0  # deterministic, so recomputation is held to the fixed tolerance
    assert all(r.vs_no_ckpt is None for r in results if r.policy == "none" and r not in again)
    policies = {r.policy: r for r in results if r.policy != "none"}
    assert all(r.vs_no_ckpt < 1e-5 and r.ckpt_tolerance == 1e-4 for r in policies.values())
    assert all(r.lowered and not r.causes for r in policies.values())
    packed = next(r for r in results if r.name == "packed dense")
    assert policies["full"].held_mib < policies["ffn"].held_mib < packed.held_mib
    assert packed.held_mib < results[0].held_mib  # the prompt is computed once, no padding



def verify_cli(model_dirs, data, tmp_path, capsys, *flags) -> tuple[int, str, list]:
    """`fastdpo verify` on the tiny Qwen3 and `data` with `flags`: exit status, printed text (whitespace folded)
    and the JSON rows."""
    out = tmp_path / "r.json"
    rc = main(["verify", "--model", str(model_dirs("qwen3")), "--dataset", str(data), *flags, "--json", str(out)])
    return rc, " ".join(capsys.readouterr().out.split()), json.loads(out.read_text())

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_fails_when_a_fast_path_is_wrong(model_dirs, data, monkeypatch, capsys, tmp_path, dtype):
    import fastdpo.model.attention as attention

    real = attention.allowed

    def leaky(q_pair, k_pair, q_seg, k_seg, *rest):  # rejected may see chosen: a bug the check must catch
        return real(q_pair, k_pair, q_seg, k_seg.clamp(max=0) if k_seg.dtype != torch.bool else k_seg, *rest)

    monkeypatch.setattr(attention, "allowed", leaky)
    rc, text, rows = verify_cli(model_dirs, data, tmp_path, capsys, "--pairs", "6", "--policies", "ffn",
                                "--torch_dtype", dtype)
    assert rc == 1 and "FAIL" in text
    assert rows[0]["passed"] and not any(r["passed"] for r in rows[1:])
    assert all(r["worst"] > r["tolerance"] for r in rows[1:])  # far from float32, not merely from each other
    assert rows[-1]["policy"] == "ffn" and rows[-1]["vs_no_ckpt"] < TOLERANCE[getattr(torch, dtype)]
    if dtype == "bfloat16":
        assert rows[0]["floor"] > 0 and rows[0]["tolerance"] == max(3e-2, 2 * rows[0]["floor"])


def test_a_bad_policy_names_the_policies_flag(data, capsys):
    assert main(["verify", "--model", "m", "--dataset", str(data), "--policies", "full,bogus"]) == 1
    out = capsys.readouterr().out
    assert "--policies 'bogus' is not one of: true, false, none, full, ffn, attn, every:K, keep:N." in out, out
    assert "gradient_checkpointing" not in out and "auto" not in out, out
    assert main(["verify", "--model", "m", "--dataset", str(data), "--policies", "every:0"]) == 1
    assert "--policies 'every:0': K in every:K" in capsys.readouterr().out


def test_verify_command_passes(model_dirs, data, capsys, tmp_path):
    rc, text, rows = verify_cli(model_dirs, data, tmp_path, capsys, "--pairs", "4", "--policies", "full,every:2")
    assert rc == 0 and "PASS: 5 paths match the plain float32 path within 0.0001" in text and "held MiB" in text
    assert "= no ckpt" in text and "tolerance 0.0001 (float32: the plain path is the reference)" in text
    assert [r["policy"] for r in rows][-2:] == ["full", "every:2"] and all(r["passed"] for r in rows)
    assert {"worst", "passed", "tolerance", "floor", "truth_dtype", "fallback", "vs_no_ckpt"} <= set(rows[0])
    assert rows[0]["vs_no_ckpt"] is None and rows[-1]["vs_no_ckpt"] == pytest.approx(0.0, abs=1e-5)


@pytest.fixture
def loaded(monkeypatch):
    """Capture the model run_verify loads, with a copy of its parameters and buffers as loaded."""
    import fastdpo.commands.verify as verify

    seen = {}

    def load(*args, **kwargs):
        model = load_model(*args, **kwargs)
        seen["model"] = model
        seen["before"] = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        return model

    monkeypatch.setattr(verify, "load_model", load)
    return seen


def _unchanged(seen) -> None:
    model = seen["model"]
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert now.keys() == seen["before"].keys()
    for n, t in seen["before"].items():
        assert now[n].dtype == t.dtype and torch.equal(now[n], t), n  # bit for bit


def test_bfloat16_is_compared_with_float32_within_twice_its_own_error(model_dirs, data, loaded, monkeypatch,
                                                                       capsys):
    from rich.console import Console

    import fastdpo.commands.verify as verify

    real = verify._gradients
    dtypes = []

    def gradients(model, *args):
        dtypes.append({p.dtype for p in model.parameters()})
        return real(model, *args)

    monkeypatch.setattr(verify, "_gradients", gradients)
    results = run_verify(str(model_dirs("qwen3")), [str(data)], num_pairs=8, max_length=64, torch_dtype="bfloat16",
                         policies=("full", "ffn"))
    assert dtypes[0] == {torch.float32} and all(d == {torch.bfloat16} for d in dtypes[1:])  # only the reference
    assert all(p.dtype == torch.bfloat16 for p in loaded["model"].parameters())
    _unchanged(loaded)
    plain = results[0]
    assert plain.name.startswith("plain") and plain.dtype == "bfloat16" and plain.truth_dtype == "float32"
    assert plain.floor == plain.worst > 0 and not plain.fallback  # bfloat16 rounding, measured against float32
    for r in results:
        assert r.passed, (r.name, r.groups, r.vs_no_ckpt)
        assert r.tolerance == max(3e-2, 2 * plain.floor) and r.floor == plain.floor
    policies = [r for r in results if r.policy != "none"]
    assert len(policies) == 2 and all(r.vs_no_ckpt <= 3e-2 and r.ckpt_tolerance == 3e-2 for r in policies)
    verify.print_results(results, Console(width=200), cuda=False)
    text = " ".join(capsys.readouterr().out.split())
    assert "bfloat16 gradients vs the plain float32 path" in text and "the minimum for bfloat16" in text
    assert f"PASS: {len(results)} paths match the plain float32 path" in text


def test_without_memory_for_float32_the_reference_is_the_bfloat16_plain_path(model_dirs, data, loaded, monkeypatch,
                                                                             capsys, tmp_path):
    import fastdpo.commands.verify as verify

    real = verify._gradients

    def gradients(model, *args):
        if any(p.dtype == torch.float32 for p in model.parameters()):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 1073741824 bytes. Error code 12")
        return real(model, *args)

    monkeypatch.setattr(verify, "_gradients", gradients)
    rc, text, rows = verify_cli(model_dirs, data, tmp_path, capsys, "--pairs", "6", "--policies", "full",
                                "--torch_dtype", "bfloat16")
    assert rc == 0 and "NOT compared with float32 because float32 did not fit in memory" in text
    assert "tolerance 0.03, fixed for bfloat16" in text and "PASS: 4 paths match the plain bfloat16 path" in text
    assert all(r["truth_dtype"] == "bfloat16" and "can't allocate memory" in r["fallback"] for r in rows)
    assert rows[0]["worst"] == 0.0 and rows[0]["floor"] == 0.0 and all(r["tolerance"] == 3e-2 for r in rows)
    _unchanged(loaded)


def test_other_errors_in_the_float32_reference_are_raised(model_dirs, data, loaded, monkeypatch):
    import fastdpo.commands.verify as verify

    def broken(model, *args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(verify, "_gradients", broken)
    with pytest.raises(RuntimeError, match="shapes"):
        run_verify(str(model_dirs("qwen3")), [str(data)], num_pairs=4, torch_dtype="bfloat16", policies=())
    _unchanged(loaded)


def test_a_policy_whose_recomputation_differs_fails(model_dirs, data, monkeypatch, capsys, tmp_path):
    import fastdpo.model.memory as memory

    real = memory.checkpoint

    def drifting(fn, *args, **kwargs):  # the recompute in backward sees a slightly different input
        calls = []

        def run(x, *rest, **kw):
            calls.append(1)
            return fn(x * (1 + 1e-3) if len(calls) > 1 else x, *rest, **kw)

        return real(run, *args, **kwargs)

    monkeypatch.setattr(memory, "checkpoint", drifting)
    reentrant = memory._Recomputed.backward

    def drifting_backward(ctx, grad):  # the reentrant form's recompute, drifting alike
        run = ctx.run
        ctx.run = lambda x: run(x * (1 + 1e-3))
        return reentrant(ctx, grad)

    monkeypatch.setattr(memory._Recomputed, "backward", staticmethod(drifting_backward))
    rc, text, rows = verify_cli(model_dirs, data, tmp_path, capsys, "--pairs", "6", "--policies", "ffn",
                                "--tolerance", "1e-2")
    assert rc == 1 and "FAIL: ckpt ffn (differs from the path without checkpointing)" in text
    rows = {r["name"]: r for r in rows}
    ffn = rows["ckpt ffn"]
    assert ffn["tolerance"] == 1e-2 and ffn["worst"] <= 1e-2  # within --tolerance of float32 ...
    assert 1e-4 < ffn["vs_no_ckpt"] < 1e-2 and not ffn["passed"]  # ... but not what the same path gives without it
    assert all(r["passed"] for n, r in rows.items() if n != "ckpt ffn")


def test_eval_mode_is_named_when_checkpointing_saves_nothing(model_dirs):
    from data_helpers import random_pairs

    from fastdpo.data.pack import pack_pairs
    from fastdpo.model.backend import sequence_logps

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
    from model_helpers import WORDS

    from fastdpo.commands.verify import load_pairs

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


def test_recomputation_is_held_to_the_paths_own_run_to_run_difference(model_dirs, data, monkeypatch):
    """Where the path without checkpointing differs from itself when run again (non-deterministic kernels on GPUs),
    a policy may differ from it by up to twice that much; here the second run is perturbed to stand for such noise."""
    from fastdpo.commands import verify

    real = verify._gradients
    calls = {"n": 0}

    def gradients(model, pairs, backend, *args):
        grads, held, peak = real(model, pairs, backend, *args)
        if backend.name != "padded" and args[-2] == 0 and not any(getattr(m, "_fastdpo_ckpt", False)
                                                                  for m in model.modules()):
            calls["n"] += 1
            if calls["n"] == 2:  # the repeat run of the no-checkpointing path
                grads = {k: v * 1.02 for k, v in grads.items()}
        return grads, held, peak

    monkeypatch.setattr(verify, "_gradients", gradients)
    results = run_verify(str(model_dirs("qwen3")), [str(data)], num_pairs=4, policies=("full",), tolerance=0.1)
    again = next(r for r in results if r.name.endswith(", again"))
    full = next(r for r in results if r.policy == "full")
    assert again.vs_no_ckpt == pytest.approx(0.02, rel=1e-3)
    assert full.ckpt_tolerance == pytest.approx(0.04, rel=1e-3) and full.passed
