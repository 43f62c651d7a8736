"""SwiGLU's product silu(gate) * up (`fastdpo.kernels.swiglu`): the Triton kernels against eager torch, forward and
backward, at the intermediate sizes of Qwen3-1.7B and 8B.

    python benchmarks/kernels/swiglu.py [--repeat 20]    # on a CUDA GPU
    python benchmarks/kernels/swiglu.py --smoke          # anywhere: tiny shapes (the interpreter off CUDA)

Prints ms, GB/s (what each must move: gate and up read and the product written; backward, the gradient read too and
both gradients written), the Triton op's speed-up and each one's peak memory (eager keeps the activated gate for its
backward; the Triton op keeps gate and up only), once their outputs and gradients agree."""

import harness  # first: the checkout's src on the path, and Triton's interpreter off CUDA
import torch
import torch.nn.functional as F

from fastdpo.kernels.swiglu import SiluMulFunction

INTERMEDIATE = {"Qwen3-1.7B": 6144, "Qwen3-8B": 12288}
TOKENS = 8192  # one micro-batch


def shape_rows(name: str, tokens: int, width: int, args) -> list[harness.Row]:
    g = torch.Generator(device=args.device).manual_seed(0)
    gate, up, grad = (torch.randn(tokens, width, device=args.device, generator=g).mul(3).bfloat16() for _ in range(3))
    gate.requires_grad_()
    up.requires_grad_()
    impls = {"torch": lambda: F.silu(gate) * up, "triton": lambda: SiluMulFunction.apply(gate, up, True)}
    size = gate.numel() * gate.element_size()
    return harness.fwd_bwd(name, impls, (gate, up), grad, (3 * size, 5 * size), harness.GB, args.repeat, 1e-2)


def main() -> None:
    args = harness.parse(__doc__)
    widths, tokens = ({"smoke": 200}, 37) if args.smoke else (INTERMEDIATE, TOKENS)
    rows = [row for name, width in widths.items() for row in shape_rows(name, tokens, width, args)]
    harness.print_table(f"silu(gate) * up over {tokens} tokens, bf16", rows, "GB/s")


if __name__ == "__main__":
    main()
