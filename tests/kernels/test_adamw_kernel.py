"""The fused AdamW step's kernel (`fastdpo.kernels.adamw`) under Triton's interpreter on the CPU, which fuses nothing:
the gradient scale it applies as it reads, bit for bit. The kernel compiled for CUDA is held to the float32 update
in tests/model/test_gpu.py."""

import torch
from interpreter_helpers import interpreted, run_interpreted


def test_adamw_kernel_under_the_interpreter():
    run_interpreted(__file__)


@interpreted
def test_the_adamw_kernel_scales_the_gradients_it_reads():
    """The update's kernel multiplies each gradient by `scale` (clipping's coefficient) as it loads it: the bits of
    gradients scaled beforehand in float32 (bfloat16 weights rounded stochastically, and float32 ones), the
    gradients left as they were, and the foreach path's update with the same scale."""
    from fastdpo.kernels.adamw import adamw_update_
    from fastdpo.optim.adamw import _foreach_steps

    g = torch.Generator().manual_seed(0)
    ok, coef = torch.ones(1, dtype=torch.bool), torch.tensor([0.0123])
    for dtype, stochastic in ((torch.bfloat16, True), (torch.float32, False)):
        kw = dict(lr=1e-3, weight_decay=0.1, b1=0.9, b2=0.999, step=3, eps=1e-8, seeds=[11, 12], stochastic=stochastic)
        ws = [(torch.randn(n, generator=g) * 0.02).to(dtype) for n in (9001, 300)]
        start = [ws, [torch.randn(w.shape, generator=g).to(dtype) for w in ws],
                 [(torch.randn(w.shape, generator=g) * 1e-3).to(dtype) for w in ws],
                 [(torch.rand(w.shape, generator=g) * 1e-6).to(dtype) for w in ws]]
        scaled, pre, plain = ([[t.clone() for t in lst] for lst in start] for _ in range(3))
        pre[1] = [(t.float() * coef).to(torch.float32) for t in pre[1]]
        adamw_update_(*scaled, ok, scale=coef, **kw)
        adamw_update_(*pre, ok, **kw)
        adamw_update_(*plain, ok, **kw)
        for a, b in zip(scaled[0] + scaled[2] + scaled[3], pre[0] + pre[2] + pre[3]):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(scaled[1], start[1]))
        assert not torch.equal(scaled[2][0], plain[2][0])  # the scale changed the moments
        if dtype == torch.float32:
            ref = [[t.clone() for t in lst] for lst in start]
            group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
            _foreach_steps(ref, group, 3, None, coef.reshape(()))
            for a, b in zip(scaled[0] + scaled[2] + scaled[3], ref[0] + ref[2] + ref[3]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
