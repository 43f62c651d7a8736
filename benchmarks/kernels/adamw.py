"""The fused AdamW step (`fastdpo.kernels.adamw`): one Triton launch updating every tensor of a decoder layer (bf16
weights, gradients and moments, computed in float32, weights written with stochastic rounding) against the same
update in eager torch (float32 foreach ops, the noise added by torch), at the decoder layers of Qwen3-1.7B and 8B.

    python benchmarks/kernels/adamw.py [--repeat 20]    # on a CUDA GPU
    python benchmarks/kernels/adamw.py --smoke          # anywhere: tiny shapes (the interpreter off CUDA)

Prints ms per step, GB/s (what each must move: weight, gradient and both moments read, weight and moments written),
the Triton op's speed-up and each one's peak memory (eager's float32 temporaries), once the two agree (rounded to
nearest, the weights' updates and the moments)."""

import harness  # first: the checkout's src on the path, and Triton's interpreter off CUDA
import torch

from fastdpo.kernels.adamw import adamw_update_

LAYERS = {"Qwen3-1.7B": (2048, 6144, 2048, 1024), "Qwen3-8B": (4096, 12288, 4096, 1024)}  # hidden, MLP, q, k/v widths
HEAD_DIM = 128
HYPER = dict(lr=1e-3, weight_decay=0.1, b1=0.9, b2=0.999, eps=1e-8)
# Triton's interpreter rounds to bfloat16 by truncation, not to nearest as CUDA does: off CUDA, float32 state
DTYPE = torch.bfloat16 if harness.CUDA else torch.float32
STOCHASTIC = DTYPE == torch.bfloat16


def layer_shapes(hidden: int, mlp: int, q: int, kv: int) -> list[tuple[int, ...]]:
    """A decoder layer's parameters: the attention's and MLP's projections, the two norms and the q and k norms."""
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (mlp, hidden), (mlp, hidden), (hidden, mlp),
            (hidden,), (hidden,), (HEAD_DIM,), (HEAD_DIM,)]


def eager_update_(ws, gs, ms, vs, step: int, stochastic: bool, gen: torch.Generator) -> None:
    """AdamW's step in float32 foreach ops, written back in the state's dtype: the weights rounded stochastically
    (16 random low bits added, then truncated) or to nearest."""
    lr, wd, b1, b2, eps = (HYPER[k] for k in ("lr", "weight_decay", "b1", "b2", "eps"))
    w32, g32, m32, v32 = ([t.float() for t in lst] for lst in (ws, gs, ms, vs))
    torch._foreach_mul_(w32, 1 - lr * wd)
    torch._foreach_lerp_(m32, g32, 1 - b1)
    torch._foreach_mul_(v32, b2)
    torch._foreach_addcmul_(v32, g32, g32, 1 - b2)
    denom = torch._foreach_sqrt(v32)
    torch._foreach_div_(denom, (1 - b2**step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(w32, m32, denom, -lr / (1 - b1**step))
    for dst, src in zip(ms + vs, m32 + v32):
        dst.copy_(src)
    for dst, src in zip(ws, w32):
        if stochastic:
            bits = src.view(torch.int32)
            noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=gen)
            src = (bits + noise).bitwise_and_(-65536).view(torch.float32)
        dst.copy_(src)


def state(shapes, device) -> list[list[torch.Tensor]]:
    """Weights, gradients and both moments of the given shapes, in DTYPE, seeded."""
    g = torch.Generator(device=device).manual_seed(0)

    def each(scale: float, square: bool = False):
        return [((torch.randn(s, device=device, generator=g) * scale) ** (2 if square else 1)).to(DTYPE) for s in shapes]

    return [each(0.02), each(1e-3), each(1e-4), each(1e-4, square=True)]


def check(name: str, shapes, device) -> None:
    """Rounded to nearest, the kernel's updates of the weights and its moments against eager's."""
    ok = torch.ones(1, dtype=torch.bool, device=device)
    start = state(shapes, device)
    fused, eager = ([[t.clone() for t in lst] for lst in start] for _ in range(2))
    adamw_update_(*fused, ok, step=3, seeds=list(range(len(shapes))), stochastic=False, **HYPER)
    eager_update_(*eager, step=3, stochastic=False, gen=torch.Generator(device=device))
    for kind, lst in (("weights' update", 0), ("first moment", 2), ("second moment", 3)):
        base = start[0] if lst == 0 else [torch.zeros_like(t) for t in start[0]]
        got = torch.cat([(a.float() - b.float()).flatten() for a, b in zip(fused[lst], base)])
        want = torch.cat([(a.float() - b.float()).flatten() for a, b in zip(eager[lst], base)])
        harness.agree(f"{name}, {kind}", got, want, 2e-2)


def shape_rows(name: str, shapes, args) -> list[harness.Row]:
    check(name, shapes, args.device)
    ws, gs, ms, vs = state(shapes, args.device)
    ok = torch.ones(1, dtype=torch.bool, device=args.device)
    seeds = list(range(len(shapes)))
    gen = torch.Generator(device=args.device).manual_seed(1)
    params = sum(w.numel() for w in ws)
    size = params * 7 * ws[0].element_size()  # four tensors read, three written
    fused = lambda: adamw_update_(ws, gs, ms, vs, ok, step=3, seeds=seeds, stochastic=STOCHASTIC, **HYPER)
    eager = lambda: eager_update_(ws, gs, ms, vs, 3, STOCHASTIC, gen)
    return [harness.measure(name, "step", "torch", eager, args.repeat, size, harness.GB),
            harness.measure(name, "step", "triton", fused, args.repeat, size, harness.GB)]


def main() -> None:
    args = harness.parse(__doc__)
    layers = {"smoke": [(40, 24), (24, 40), (24,), (7,)]} if args.smoke else {
        name: layer_shapes(*widths) for name, widths in LAYERS.items()}
    rows = [row for name, shapes in layers.items() for row in shape_rows(name, shapes, args)]
    dtype = str(DTYPE).removeprefix("torch.")
    harness.print_table(f"AdamW step of one decoder layer, {dtype} weights, gradients and moments", rows, "GB/s")


if __name__ == "__main__":
    main()
