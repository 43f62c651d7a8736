"""The FP8 frozen linear (`fastdpo.kernels.fp8`): x @ W^T and x's gradient with W held in e4m3 with row-wise scales and
x (forward) or dY (backward) quantised per row at each call, against the bfloat16 linear, at the projections of
Qwen3-1.7B and 8B (the shapes of `../shared/bench/fp8_probe.py`, here with the quantisation of the activation
included, as training pays it).

    python benchmarks/kernels/fp8.py [--repeat 20]    # on a CUDA GPU (FP8 products need compute capability 8.9)
    python benchmarks/kernels/fp8.py --smoke          # anywhere: tiny shapes, the float32 emulation off CUDA

Prints ms, TFLOP/s (2 T i o per product), the FP8 op's speed-up and each one's peak memory, once the two agree within
FP8's error (6 % relative)."""

import harness  # first: the checkout's src on the path
import torch
import torch.nn.functional as F

from fastdpo.kernels.fp8 import Fp8LinearFunction, quantise_rowwise

LINEARS = {"1.7B qkv": (2048, 4096), "1.7B o": (2048, 2048), "1.7B gate_up": (2048, 12288), "1.7B down": (6144, 2048),
           "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B gate_up": (4096, 24576), "8B down": (12288, 4096)}
TOKENS = 8192


def shape_rows(name: str, tokens: int, features: tuple[int, int], args) -> list[harness.Row]:
    g = torch.Generator(device=args.device).manual_seed(0)
    fan_in, fan_out = features
    dtype = torch.bfloat16 if harness.CUDA else torch.float32
    x = torch.randn(tokens, fan_in, device=args.device, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(fan_out, fan_in, device=args.device, generator=g) * fan_in**-0.5).to(dtype)
    wq, w_scale = quantise_rowwise(w)
    grad = torch.randn(tokens, fan_out, device=args.device, generator=g).to(dtype)
    impls = {"torch": lambda: F.linear(x, w), "fp8": lambda: Fp8LinearFunction.apply(x, wq, w_scale, None)}
    flops = 2 * tokens * fan_in * fan_out
    return harness.fwd_bwd(name, impls, (x,), grad, (flops, flops), harness.TFLOP, args.repeat, 0.06)


def main() -> None:
    args = harness.parse(__doc__)
    shapes, tokens = ({"smoke": (48, 32)}, 37) if args.smoke else (LINEARS, TOKENS)
    rows = [row for name, features in shapes.items() for row in shape_rows(name, tokens, features, args)]
    harness.print_table(f"FP8 frozen linear (e4m3, row-wise scales) over {tokens} tokens", rows, "TFLOP/s")


if __name__ == "__main__":
    main()
