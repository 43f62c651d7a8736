"""The fused AdamW step for `fastdpo.optim.adamw.AdamW` on CUDA: one Triton launch updates a list of tensors in a
single pass, writing bfloat16 weights with stochastic rounding.

The plain-torch update reads and writes float32 copies of the weight, gradient and both moments several times
(about 150 bytes of memory traffic per parameter); this kernel reads each tensor once in its own dtype, computes in
float32 registers and writes weight and moments once (about 22 bytes per parameter for bf16 weights, gradients and
moments). All tensors of one dtype go in one launch: a table on the device holds where each tensor's weight,
gradient and moments start (in elements from the first tensor's), its size and its rounding seed; each program
updates one chunk of one tensor, so the host queues one kernel per step instead of one per tensor (a Qwen3-1.7B
step has 310). The rounding noise comes from Philox (`tl.randint`)
keyed by the tensor's seed and the element's index in its tensor, so it is a pure function of (seed, step, group,
tensor, element), as the plain path's seeded generator is.

Triton is imported here unguarded: importing this module without Triton raises ImportError, which the optimizer
takes to mean the foreach path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per inner iteration: four per thread (3.1 TB/s on an H200; 2048 reached 1.8)
ITERS = 8  # iterations per program: a program updates BLOCK * ITERS elements of one tensor

_maps: dict[tuple, torch.Tensor] = {}  # (device, sizes) -> the program -> (tensor, chunk) map, built once


@triton.jit
def _adamw_kernel(w_base, g_base, m_base, v_base, table_ptr, map_ptr, ok_ptr, scale_ptr, lr, decay, b1, b2, c1, sqrt_c2, eps,
                  WA: tl.constexpr, GA: tl.constexpr, MA: tl.constexpr, VA: tl.constexpr,
                  STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(map_ptr + 2 * pid).to(tl.int64)  # the tensor this program updates
    chunk = tl.load(map_ptr + 2 * pid + 1).to(tl.int64)  # and which of its chunks
    row = table_ptr + t * 6  # where weight, gradient and moments start (elements from the bases), numel, seed
    w_at = tl.load(row)
    g_at = tl.load(row + 1)
    m_at = tl.load(row + 2)
    v_at = tl.load(row + 3)
    # a false flag: the step is skipped (no element in range), nothing read or written
    n = tl.load(row + 4) * (tl.load(ok_ptr) != 0).to(tl.int64)
    seed = tl.load(row + 5)
    scale = tl.load(scale_ptr)  # the gradients' scale: clipping's coefficient, applied as they are read
    for i in range(ITERS):
        offs = chunk * (BLOCK * ITERS) + i * BLOCK + tl.arange(0, BLOCK)  # index in the tensor
        keep = offs < n
        # *A: every tensor starts 16 bytes aligned (A elements), so each thread's run of A elements is one access
        w_offs = tl.max_contiguous(tl.multiple_of(w_at + offs, WA), BLOCK)
        g_offs = tl.max_contiguous(tl.multiple_of(g_at + offs, GA), BLOCK)
        m_offs = tl.max_contiguous(tl.multiple_of(m_at + offs, MA), BLOCK)
        v_offs = tl.max_contiguous(tl.multiple_of(v_at + offs, VA), BLOCK)
        w = tl.load(w_base + w_offs, mask=keep).to(tl.float32)
        g = tl.load(g_base + g_offs, mask=keep).to(tl.float32) * scale
        m = tl.load(m_base + m_offs, mask=keep).to(tl.float32)
        v = tl.load(v_base + v_offs, mask=keep).to(tl.float32)
        w = w * decay
        m = m + (g - m) * (1.0 - b1)
        v = v * b2 + (1.0 - b2) * g * g
        w = w - (lr / c1) * m / (tl.sqrt(v) / sqrt_c2 + eps)
        tl.store(m_base + m_offs, m, mask=keep)
        tl.store(v_base + v_offs, v, mask=keep)
        if STOCHASTIC:
            # add 16 random low bits to the float32 pattern and truncate: rounds up with probability = the remainder
            noise = (tl.randint(seed, offs.to(tl.uint32)) & 0xFFFF).to(tl.int32)
            bits = w.to(tl.int32, bitcast=True)
            w = ((bits + noise) & -65536).to(tl.float32, bitcast=True)
        tl.store(w_base + w_offs, w, mask=keep)


def _program_map(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """For each program, (tensor index, chunk index), int32 pairs on `device`; cached per list of sizes (a model's
    parameter shapes do not change from step to step)."""
    key = (device, sizes)
    if key not in _maps:
        chunks = torch.tensor([triton.cdiv(n, BLOCK * ITERS) for n in sizes], dtype=torch.int64)
        tensor = torch.repeat_interleave(torch.arange(len(sizes)), chunks)
        first = torch.repeat_interleave(torch.cumsum(chunks, 0) - chunks, chunks)
        chunk = torch.arange(len(tensor)) - first
        _maps[key] = torch.stack([tensor, chunk], 1).to(torch.int32).to(device)
    return _maps[key]


def adamw_update_(ws: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor],
                  ok: torch.Tensor, *, lr: float, weight_decay: float, b1: float, b2: float, step: int, eps: float,
                  seeds: list[int], stochastic: bool, scale: torch.Tensor | None = None) -> None:
    """In place on contiguous CUDA tensors (weight, gradient, moments aligned; each kind of one dtype): AdamW's step
    `step` (decoupled decay, bias correction) computed in float32; the weights written with stochastic rounding when
    `stochastic` (for bfloat16), else rounded to nearest. `seeds` (31-bit ints, one per tensor) key the rounding
    noise. `ok`, a one-element bool tensor on the device, is read by the kernel: when false, the tensors are left as
    they are (the host never waits for it). `scale`, a one-element float32 tensor on the device (else 1), multiplies
    each gradient as it is read (clipping's coefficient; the gradients themselves are not written)."""
    live = [k for k, w in enumerate(ws) if w.numel()]
    if not live:
        return
    kinds = (ws, gs, ms, vs)
    bases = [lst[live[0]] for lst in kinds]
    addrs = [[lst[k].data_ptr() for k in live] for lst in kinds]
    aligned = all(a % 16 == 0 for column in addrs for a in column)
    if any((a - b.data_ptr()) % b.element_size() for column, b in zip(addrs, bases) for a in column):
        raise ValueError("AdamW kernel: a tensor starts between two elements of its dtype")
    rows = [[(a - b.data_ptr()) // b.element_size() for a in column] for column, b in zip(addrs, bases)]
    rows += [[ws[k].numel() for k in live], [seeds[k] for k in live]]
    device = bases[0].device
    if scale is None:
        scale = torch.ones(1, dtype=torch.float32, device=device)
    table = torch.tensor(rows, dtype=torch.int64).t().contiguous()
    table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table.to(device)
    programs = _program_map(tuple(rows[4]), device)
    steps = [16 // b.element_size() if aligned else 1 for b in bases]
    _adamw_kernel[(len(programs),)](*bases, table, programs, ok, scale, lr, 1.0 - lr * weight_decay, b1, b2, 1.0 - b1**step,
                                    (1.0 - b2**step) ** 0.5, eps, *steps, STOCHASTIC=stochastic, BLOCK=BLOCK,
                                    ITERS=ITERS, num_warps=8)
