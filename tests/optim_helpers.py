"""Optimizer steps skipped on a device-side non-finite flag (`step_unless_nonfinite`), on the CPU or CUDA."""

import torch

from fastdpo.optim.adamw import AdamW


def skip_run(make_opt, dtype, skip: bool, device="cpu"):
    """Three good steps; with `skip`, a NaN step flagged non-finite between the second and the third."""
    from fastdpo.optim.optimizer import step_unless_nonfinite, undo_step_count

    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(64, 33) * 0.02).to(device, dtype))
    b = torch.nn.Parameter(torch.ones(33, dtype=dtype, device=device))
    opt = make_opt([w, b])
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(w.shape, generator=gen).to(device, dtype), torch.randn(b.shape, generator=gen).to(device, dtype))
             for _ in range(3)]
    stepped_log = []
    for i, (gw, gb) in enumerate(grads):
        if skip and i == 2:
            w.grad, b.grad = torch.full_like(w, float("nan")), torch.full_like(b, float("inf"))
            flag = torch.isfinite(w.grad).all() & torch.isfinite(b.grad).all()  # false, on the device
            stepped = step_unless_nonfinite(opt, flag)
            stepped_log.append(stepped)
            if stepped:
                undo_step_count(opt)
            opt.zero_grad(set_to_none=True)
        w.grad, b.grad = gw.clone(), gb.clone()
        assert step_unless_nonfinite(opt, torch.tensor(True, device=device))
        opt.zero_grad(set_to_none=True)
    state = opt.state_dict()["state"]
    return [w.detach().clone(), b.detach().clone()], state, stepped_log


# the optimizers whose skipped steps are checked, by name
MAKERS = {"fastdpo": lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1, seed=3),
          "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
          "torch": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}


def check_skipped_step(kind, dtype, device):
    """A skipped step (NaN gradients, flag false) of optimizer `kind` (a key of MAKERS) leaves weights, moments and
    step counts as if it never ran."""
    clean, clean_state, _ = skip_run(MAKERS[kind], dtype, False, device)
    skipped, skipped_state, stepped = skip_run(MAKERS[kind], dtype, True, device)
    # the device-side paths call step() and obey the flag; the plain torch optimizer is not called at all
    assert stepped == [kind != "torch"]
    for a, b in zip(clean, skipped):
        assert torch.equal(a, b) and torch.isfinite(b.float()).all()
    for k in clean_state:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(clean_state[k][key]), torch.as_tensor(skipped_state[k][key])), key

