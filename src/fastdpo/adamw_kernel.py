"""One Triton kernel for `fastdpo.adamw.AdamW` on CUDA: the whole update of one tensor in a single pass.

The plain-torch update reads and writes float32 copies of the weight, gradient and both moments several times
(about 150 bytes of memory traffic per parameter); this kernel reads each tensor once in its own dtype, computes in
float32 registers and writes weight and moments once (about 22 bytes per parameter for bf16 weights, gradients and
moments). The rounding noise comes from Philox (`tl.randint`) keyed by a per-tensor seed and the element's index,
so it is a pure function of (seed, step, group, tensor, element), as the plain path's seeded generator is.

Imported only when a CUDA device and Triton are present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _adamw_kernel(w_ptr, g_ptr, m_ptr, v_ptr, ok_ptr, n, lr, decay, b1, b2, c1, sqrt_c2, eps, seed,
                  STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    keep = (offs < n) & (tl.load(ok_ptr) != 0)  # a false flag: the step is skipped, nothing read or written
    w = tl.load(w_ptr + offs, mask=keep).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=keep).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=keep).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=keep).to(tl.float32)
    w = w * decay
    m = m + (g - m) * (1.0 - b1)
    v = v * b2 + (1.0 - b2) * g * g
    w = w - (lr / c1) * m / (tl.sqrt(v) / sqrt_c2 + eps)
    tl.store(m_ptr + offs, m, mask=keep)
    tl.store(v_ptr + offs, v, mask=keep)
    if STOCHASTIC:
        # add 16 random low bits to the float32 pattern and truncate: rounds up with probability = the remainder
        noise = (tl.randint(seed, offs.to(tl.uint32)) & 0xFFFF).to(tl.int32)
        bits = w.to(tl.int32, bitcast=True)
        w = ((bits + noise) & -65536).to(tl.float32, bitcast=True)
    tl.store(w_ptr + offs, w, mask=keep)


def adamw_update_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, ok: torch.Tensor, *,
                  lr: float, weight_decay: float, b1: float, b2: float, step: int, eps: float, seed: int,
                  stochastic: bool) -> None:
    """In place on contiguous CUDA tensors of equal shape: AdamW's step `step` (decoupled decay, bias correction)
    computed in float32; `w` written with stochastic rounding when `stochastic` (for bfloat16), else rounded to
    nearest. `seed` (a 31-bit int) keys the rounding noise. `ok`, a one-element bool tensor on the device, is read
    by the kernel: when false, the tensors are left as they are (the host never waits for it)."""
    n = w.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    _adamw_kernel[grid](w, g, m, v, ok, n, lr, 1.0 - lr * weight_decay, b1, b2, 1.0 - b1**step, (1.0 - b2**step) ** 0.5,
                        eps, seed, STOCHASTIC=stochastic, BLOCK=BLOCK, num_warps=8)
