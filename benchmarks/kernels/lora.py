"""The LoRA linear with dropout (`fastdpo.kernels.lora`): base(x) + s * dropout(x) @ A^T @ B^T as three GEMMs with the
dropout mask applied in registers by the Triton kernels, against PEFT's forward in eager torch (x cast to the
adapters' float32, dropout written out, the adapter's output scaled and added), forward and backward, at the MLP down
projections of Qwen3-1.7B and 8B (rank 16, dropout 0.05, bf16 weights and float32 adapters, as PEFT keeps them).

    python benchmarks/kernels/lora.py [--repeat 20]    # on a CUDA GPU
    python benchmarks/kernels/lora.py --smoke          # anywhere: tiny shapes (the interpreter off CUDA)

Prints ms, TFLOP/s (of the GEMMs: 2 T i o + 2 T r (i + o) forward, twice the adapter's share more backward), the
Triton op's speed-up and each one's peak memory. The two draw different masks, so agreement is checked against the
float32 computation under the kernels' own mask."""

import harness  # first: the checkout's src on the path, and Triton's interpreter off CUDA
import torch
import torch.nn.functional as F

from fastdpo.kernels.lora import LoraLinearFunction, lora_dropout_keep, lora_dropout_seed

DOWN = {"Qwen3-1.7B": (6144, 2048), "Qwen3-8B": (12288, 4096)}  # the down projection's in and out features
TOKENS = 8192  # one micro-batch
RANK, SCALE, P = 16, 2.0, 0.05


def peft(x, w, a, b):
    """PEFT's LoRA linear forward: the adapter's product in its own dtype, scaled and added to the base's output."""
    out = F.linear(x, w)
    return (out + F.linear(F.linear(F.dropout(x.to(a.dtype), P), a), b) * SCALE).to(out.dtype)


def check_under_the_kernels_mask(name: str, x, w, a, b) -> None:
    """The Triton op's output and gradients against float32 under the mask its kernels draw (from torch's seed)."""
    torch.manual_seed(7)
    out = LoraLinearFunction.apply(x, w, None, a, b, SCALE, P)
    up = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (x, a, b), up))
    torch.manual_seed(7)
    keep = lora_dropout_keep(lora_dropout_seed(), tuple(x.shape), P, x.device)
    xf, af, bf = (t.detach().float().requires_grad_() for t in (x, a, b))
    want = xf @ w.float().t() + SCALE * ((xf * keep / (1 - P)) @ af.t()) @ bf.t()
    for i, (g, r) in enumerate(zip(got, (want, *torch.autograd.grad(want, (xf, af, bf), up.float())))):
        harness.agree(f"{name}, result {i} under the kernels' mask", g, r, 2e-2)


def shape_rows(name: str, tokens: int, features: tuple[int, int], rank: int, args) -> list[harness.Row]:
    g = torch.Generator(device=args.device).manual_seed(0)
    fan_in, fan_out = features
    x = torch.randn(tokens, fan_in, device=args.device, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(fan_out, fan_in, device=args.device, generator=g) * fan_in**-0.5).bfloat16()
    a = (torch.randn(rank, fan_in, device=args.device, generator=g) * fan_in**-0.5).requires_grad_()
    b = (torch.randn(fan_out, rank, device=args.device, generator=g) * 0.02).requires_grad_()
    grad = torch.randn(tokens, fan_out, device=args.device, generator=g).bfloat16()
    check_under_the_kernels_mask(name, x, w, a, b)
    impls = {"torch": lambda: peft(x, w, a, b), "triton": lambda: LoraLinearFunction.apply(x, w, None, a, b, SCALE, P)}
    base, adapter = 2 * tokens * fan_in * fan_out, 2 * tokens * rank * (fan_in + fan_out)
    work = (base + adapter, base + 2 * adapter)
    return harness.fwd_bwd(name, impls, (x, a, b), grad, work, harness.TFLOP, args.repeat, None)


def main() -> None:
    args = harness.parse(__doc__)
    shapes, tokens, rank = ({"smoke": (64, 48)}, 37, 4) if args.smoke else (DOWN, TOKENS, RANK)
    rows = [row for name, features in shapes.items() for row in shape_rows(name, tokens, features, rank, args)]
    harness.print_table(f"LoRA linear (rank {rank}, dropout {P}) over {tokens} tokens", rows, "TFLOP/s")


if __name__ == "__main__":
    main()
