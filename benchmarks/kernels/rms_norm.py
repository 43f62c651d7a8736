"""RMSNorm (`fastdpo.kernels.rms_norm`): the Triton kernels against eager torch (transformers' formula), forward and
backward, at the hidden sizes of Qwen3-1.7B and 8B.

    python benchmarks/kernels/rms_norm.py [--repeat 20]    # on a CUDA GPU
    python benchmarks/kernels/rms_norm.py --smoke          # anywhere: tiny shapes (the interpreter off CUDA)

Prints ms, GB/s (what each must move: the input read and the output written; backward, the gradient read too and
the input's written), the Triton op's speed-up and each one's peak memory, once their outputs and gradients agree."""

import harness  # first: the checkout's src on the path, and Triton's interpreter off CUDA
import torch

from fastdpo.kernels.rms_norm import RMSNormFunction

HIDDEN = {"Qwen3-1.7B": 2048, "Qwen3-8B": 4096}
TOKENS = 8192  # one micro-batch
EPS = 1e-6


def eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm: in float32, rounded to the input's dtype before the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def shape_rows(name: str, tokens: int, width: int, args) -> list[harness.Row]:
    g = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(tokens, width, device=args.device, generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(width, device=args.device, generator=g)).bfloat16().requires_grad_()
    grad = torch.randn(tokens, width, device=args.device, generator=g).bfloat16()
    impls = {"torch": lambda: eager(x, w), "triton": lambda: RMSNormFunction.apply(x, w, EPS, True)}
    size = x.numel() * x.element_size()
    return harness.fwd_bwd(name, impls, (x, w), grad, (2 * size, 3 * size), harness.GB, args.repeat, 2e-2)


def main() -> None:
    args = harness.parse(__doc__)
    widths, tokens = ({"smoke": 200}, 37) if args.smoke else (HIDDEN, TOKENS)
    rows = [row for name, width in widths.items() for row in shape_rows(name, tokens, width, args)]
    harness.print_table(f"RMSNorm over {tokens} tokens, bf16", rows, "GB/s")


if __name__ == "__main__":
    main()
