"""fastdpo's AdamW: the same update as torch.optim.AdamW, and bfloat16 weights written back by stochastic rounding so
that updates far below bf16's precision still count on average."""

import pytest
import torch
from optim_helpers import check_skipped_step

from fastdpo.optim.adamw import CHUNK, AdamW, _pieces, stochastic_round_


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    g = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way from 1.0 to the next bf16 value (1 + 2**-7)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(out, x, g)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert (out.float() == 1.0 + 2**-7).float().mean().item() == pytest.approx(0.125, abs=0.005)
    assert out.float().mean().item() == pytest.approx(1.0 + 2**-10, rel=2e-5)
    neg = torch.full((200_000,), -(1.0 + 2**-10))
    stochastic_round_(out, neg, g)
    assert out.float().mean().item() == pytest.approx(-(1.0 + 2**-10), rel=2e-5)
    exact = torch.randn(1000).bfloat16().float()  # already bf16 values: never moved
    stochastic_round_(out[:1000], exact, g)
    assert torch.equal(out[:1000].float(), exact)


def _train(opt_cls, dtype, steps=5, wd=0.1, **kw):
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(64, 33) * 0.02).to(dtype))
    b = torch.nn.Parameter(torch.ones(33, dtype=dtype))
    opt = opt_cls([{"params": [w], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}], lr=1e-2,
                  betas=(0.9, 0.99), eps=1e-8, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        w.grad = torch.randn(w.shape, generator=gen).to(dtype)
        b.grad = torch.randn(b.shape, generator=gen).to(dtype)
        opt.step()
    return w.detach(), b.detach(), opt


def test_float32_update_equals_torch_adamw():
    w1, b1, o1 = _train(AdamW, torch.float32)
    w2, b2, o2 = _train(torch.optim.AdamW, torch.float32)
    torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(b1, b2, rtol=1e-5, atol=1e-7)
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    for k in (0, 1):
        assert set(s1[k]) == set(s2[k]) == {"step", "exp_avg", "exp_avg_sq"}
        torch.testing.assert_close(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"])
        assert float(s1[k]["step"]) == float(s2[k]["step"]) == 5


def test_bf16_small_updates_count_on_average_where_round_to_nearest_drops_them():
    """lr 1e-6 on bf16 weights of magnitude ~0.02 and ~1.0 (norms): the summed change matches the float32 run's."""
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(256, 256) * 0.02)
    start = ref.detach().bfloat16()
    ref.data = start.float().clone()
    norm_ref = torch.nn.Parameter(torch.ones(65536))  # near 1.0 a step of 1e-6 is 1/3900 of a spacing
    params = {}
    for name, cls in (("sr", AdamW), ("nearest", torch.optim.AdamW)):
        w = torch.nn.Parameter(start.clone())
        n = torch.nn.Parameter(torch.ones(65536, dtype=torch.bfloat16))
        params[name] = (w, n, cls([w, n], lr=1e-6))
    opt_ref = torch.optim.AdamW([ref, norm_ref], lr=1e-6)
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        g, gn = torch.randn(256, 256, generator=gen) + 0.5, torch.randn(65536, generator=gen) + 0.5
        for w, n, opt in params.values():
            w.grad, n.grad = g.bfloat16(), gn.bfloat16()
            opt.step()
        ref.grad, norm_ref.grad = g.bfloat16().float(), gn.bfloat16().float()
        opt_ref.step()
    want = (ref.detach() - start.float()).sum()
    want_n = (norm_ref.detach() - 1).sum()
    got = {k: ((w.detach().float() - start.float()).sum(), (n.detach().float() - 1).sum())
           for k, (w, n, _) in params.items()}
    assert got["sr"][0].item() == pytest.approx(want.item(), rel=0.1)
    assert got["sr"][1].item() == pytest.approx(want_n.item(), rel=0.2)
    assert abs(got["nearest"][0].item()) < 0.1 * abs(want.item())  # what torch's AdamW keeps of it
    assert got["nearest"][1].item() == 0.0


def test_rounding_noise_depends_on_seed_and_step_only():
    """Same seed and step: the same rounding (DDP replicas stay equal, a resumed run rounds like the original)."""
    w1, _, _ = _train(AdamW, torch.bfloat16, seed=3)
    w2, _, _ = _train(AdamW, torch.bfloat16, seed=3)
    w3, _, _ = _train(AdamW, torch.bfloat16, seed=4)
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)
    # resume: 3 steps, state_dict into a fresh optimizer, 2 more steps == 5 uninterrupted steps
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(64, 33) * 0.02).bfloat16())
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(64, 33, generator=gen).bfloat16() for _ in range(5)]
    opt = AdamW([w], lr=1e-2, seed=3)
    for g in grads[:3]:
        w.grad = g
        opt.step()
    saved = opt.state_dict()
    opt2 = AdamW([w], lr=1e-2, seed=3)
    opt2.load_state_dict(saved)
    for g in grads[3:]:
        w.grad = g
        opt2.step()
    torch.manual_seed(0)
    u = torch.nn.Parameter((torch.randn(64, 33) * 0.02).bfloat16())
    opt3 = AdamW([u], lr=1e-2, seed=3)
    for g in grads:
        u.grad = g
        opt3.step()
    assert torch.equal(w.detach(), u.detach())


def test_large_tensors_are_updated_in_slices(monkeypatch):
    monkeypatch.setattr("fastdpo.optim.adamw.CHUNK", 100)
    a, b = torch.zeros(250), torch.zeros(30)
    pieces = _pieces([[a, b]])
    assert [sum(t.numel() for t in p[0]) for p in pieces] == [100, 100, 80]
    for p in pieces:  # slices are views: writing them writes the tensors
        for t in p[0]:
            t.fill_(1)
    assert a.sum() == 250 and b.sum() == 30
    assert CHUNK >= 1 << 20
    w1, _, _ = _train(AdamW, torch.float32)
    monkeypatch.undo()
    w2, _, _ = _train(AdamW, torch.float32)
    assert torch.equal(w1, w2)


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def test_training_in_bf16_applies_small_updates(tmp_path, model_dirs):
    """lr 1e-5 on a bf16 model: with stochastic rounding the weights move about as far as in float32; with
    round-to-nearest (torch's AdamW) most of that movement is lost."""
    from data_helpers import easy_rows, write_jsonl

    from fastdpo.config import TrainConfig
    from fastdpo.optim.optimizer import build_optimizer
    from fastdpo.training.loop import train

    model = model_dirs("qwen3")
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(24, seed=1))
    start = {k: v.float() for k, v in _load_model_weights(model).items()}
    moved = {}
    for name, dtype, rounding in (("fp32", "float32", "stochastic"), ("sr", "bfloat16", "stochastic"),
                                  ("nearest", "bfloat16", "nearest")):
        cfg = TrainConfig(model=str(model), dataset=[str(data)], output_dir=str(tmp_path / name), torch_dtype=dtype,
                          update_rounding=rounding, learning_rate=1e-5, max_steps=4, seed=3, disable_progress=True,
                          save_steps=0)
        train(cfg, progress=False)
        end = _weights(tmp_path / name)
        keys = [k for k in start if "layers" in k and k in end]
        begin = {k: start[k] if dtype == "float32" else start[k].bfloat16().float() for k in keys}
        moved[name] = sum((end[k].float() - begin[k]).abs().sum().item() for k in keys)
    assert moved["sr"] == pytest.approx(moved["fp32"], rel=0.25)
    assert moved["nearest"] < 0.3 * moved["fp32"]
    m = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert isinstance(build_optimizer(m, TrainConfig(model="x", dataset=["d"]), torch.device("cpu")), AdamW)
    near = TrainConfig(model="x", dataset=["d"], update_rounding="nearest")
    assert type(build_optimizer(m, near, torch.device("cpu"))) is torch.optim.AdamW
    assert type(build_optimizer(torch.nn.Linear(2, 2), TrainConfig(model="x", dataset=["d"]),
                                torch.device("cpu"))) is torch.optim.AdamW  # float32 weights: torch's AdamW


def _load_model_weights(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def test_bad_rounding_value_is_refused():
    from fastdpo.config import TrainConfig
    from fastdpo.errors import FastDPOError

    with pytest.raises(FastDPOError, match="--update_rounding 'up' is not one of: stochastic, nearest"):
        TrainConfig(model="m", dataset=["d"], update_rounding="up").validate()


def test_state_loads_from_and_into_torch_adamw():
    """A checkpoint of torch's AdamW (e.g. written with --update_rounding nearest) resumes with fastdpo's, and back."""
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(8, 8) * 0.02).bfloat16())
    theirs = torch.optim.AdamW([w], lr=1e-3)
    for _ in range(3):
        w.grad = torch.randn(8, 8).bfloat16()
        theirs.step()
    ours = AdamW([w], lr=1e-3)
    ours.load_state_dict(theirs.state_dict())
    w.grad = torch.randn(8, 8).bfloat16()
    ours.step()
    state = ours.state[w]
    assert float(state["step"]) == 4 and state["exp_avg"].dtype == torch.bfloat16
    back = torch.optim.AdamW([w], lr=1e-3)
    back.load_state_dict(ours.state_dict())
    back.step()
    assert float(back.state[w]["step"]) == 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["fastdpo", "torch_fused", "torch"])
def test_a_step_flagged_non_finite_changes_nothing(kind, dtype):
    """A skipped step (NaN gradients, flag false) leaves weights, moments and step counts as if it never ran: the
    next good step gives the same bits as a run without it (stochastic rounding's noise is keyed by the step)."""
    check_skipped_step(kind, dtype, "cpu")


def test_local_shard_reads_the_held_tensor_or_asks_for_it():
    """A DTensor's local tensor is read as its attribute (no dispatch); a wrapper that only offers `to_local()` is
    asked for it; a plain tensor is itself."""
    from fastdpo.optim.adamw import local_shard

    plain, held, asked = torch.zeros(3), torch.ones(2), torch.full((2,), 2.0)

    class Held:
        _local_tensor = held

        def to_local(self):
            raise AssertionError("the held tensor is read directly")

    class Asked:
        def to_local(self):
            return asked

    assert local_shard(plain) is plain
    assert local_shard(Held()) is held
    assert local_shard(Asked()) is asked


def _clip_run(dtype, fold: bool, max_norm: float, device: str = "cpu"):
    """Three steps of fastdpo's AdamW on two tensors with random gradients, clipped to `max_norm` either in place
    first (`clip_grad_norm`) or by the update as it reads them (`grad_scale`): the weights, moments, norms, and
    whether the folded run left its gradients as they were."""
    from fastdpo.parallel.collectives import clip_coef, clip_grad_norm, total_grad_norm

    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(64, 33) * 0.02).to(device, dtype))
    b = torch.nn.Parameter(torch.ones(33, dtype=dtype, device=device))
    opt = AdamW([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=1e-2, seed=5)
    gen = torch.Generator().manual_seed(1)
    norms, untouched = [], []
    for _ in range(3):
        w.grad = (torch.randn(w.shape, generator=gen) * 3).to(device, dtype)
        b.grad = torch.randn(b.shape, generator=gen).to(device, dtype)
        if fold:
            given = [w.grad.clone(), b.grad.clone()]
            norm = total_grad_norm([w, b])
            opt.step(grad_scale=clip_coef(norm, max_norm))
            untouched.append(torch.equal(given[0], w.grad) and torch.equal(given[1], b.grad))
        else:
            norm = clip_grad_norm([w, b], max_norm)
            opt.step()
        norms.append(norm.float().item())
    state = opt.state_dict()["state"]
    return [w.detach().float(), b.detach().float()], [state[k][m].float() for k in (0, 1)
                                                      for m in ("exp_avg", "exp_avg_sq")], norms, untouched


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_inside_the_update_equals_clipping_in_place(max_norm):
    """The trainer hands fastdpo's AdamW clipping's coefficient instead of scaling every gradient in place first:
    in float32 the weights and moments are bit for bit those of in-place clipping, the norm is torch's
    `clip_grad_norm_`'s, and the gradients are left as they were. In bfloat16 the folded run skips the rounding of
    each clipped gradient to bfloat16, so the two runs agree to a bfloat16 spacing."""
    from fastdpo.parallel.collectives import clip_coef

    ws, moments, norms, untouched = _clip_run(torch.float32, True, max_norm)
    ws_ref, moments_ref, norms_ref, _ = _clip_run(torch.float32, False, max_norm)
    assert all(untouched) and norms == norms_ref
    for a, b in zip(ws + moments, ws_ref + moments_ref):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    grads = [torch.randn(40, 7) * 3, torch.randn(7)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    assert torch.nn.utils.clip_grad_norm_(params, max_norm).item() == pytest.approx(
        torch.cat([g.flatten() for g in grads]).norm().item(), rel=1e-6)
    if max_norm < 1:
        assert norms[0] > max_norm  # the clipping was active
    else:
        assert clip_coef(torch.tensor(norms[0]), max_norm).item() == 1.0
    assert clip_coef(torch.tensor(2.0), float("inf")) is None

    ws, moments, _, _ = _clip_run(torch.bfloat16, True, max_norm)
    ws_ref, moments_ref, _, _ = _clip_run(torch.bfloat16, False, max_norm)
    for a, b in zip(ws + moments, ws_ref + moments_ref):  # a clipped gradient rounded or not: 2^-9 of it
        assert ((a - b).abs() <= 0.01 * b.abs().max()).all()
    if max_norm < 1:  # and the coefficient reached the update: the moments are the clipped gradients' (~1/300)
        _, moments_plain, _, _ = _clip_run(torch.bfloat16, True, 1e6)
        assert all(m.abs().max() < 0.05 * p.abs().max() for m, p in zip(moments, moments_plain))


def test_an_optimizer_that_cannot_scale_its_gradients_refuses_a_scale():
    from fastdpo.optim.optimizer import scales_gradients, step_unless_nonfinite

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p], lr=0.1)
    assert not scales_gradients(opt) and scales_gradients(AdamW([p], lr=0.1))
    with pytest.raises(ValueError, match="clip them in place"):
        step_unless_nonfinite(opt, torch.tensor([True]), torch.tensor(0.5))
