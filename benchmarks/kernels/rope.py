"""Rotary embeddings of q and k (`fastdpo.kernels.rope`): the Triton kernel against eager torch (transformers'
`apply_rotary_pos_emb`), forward and backward, at the attention shapes of Qwen3-1.7B and 8B.

    python benchmarks/kernels/rope.py [--repeat 20]    # on a CUDA GPU
    python benchmarks/kernels/rope.py --smoke          # anywhere: tiny shapes (the interpreter off CUDA)

Prints ms, GB/s (what each must move: q, k, cos and sin read and both rotations written; backward, the same for
their gradients), the Triton op's speed-up and each one's peak memory, once their outputs and gradients agree."""

import harness  # first: the checkout's src on the path, and Triton's interpreter off CUDA
import torch

from fastdpo.kernels.rope import RopeFunction

HEADS = {"Qwen3-1.7B": (16, 8, 128), "Qwen3-8B": (32, 8, 128)}  # query heads, key heads, head size
TOKENS = 8192  # one micro-batch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager(q, k, cos, sin):
    """transformers' `apply_rotary_pos_emb` (cos and sin unsqueezed at the heads' dimension)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def shape_rows(name: str, tokens: int, heads: int, kv_heads: int, dim: int, args) -> list[harness.Row]:
    g = torch.Generator(device=args.device).manual_seed(0)

    def projected(h):  # the projections' layout: (B, S, H, D) seen as (B, H, S, D)
        return torch.randn(1, tokens, h, dim, device=args.device, generator=g).bfloat16().transpose(1, 2)

    q, k = projected(heads).requires_grad_(), projected(kv_heads).requires_grad_()
    angles = torch.rand(1, tokens, dim // 2, device=args.device, generator=g).mul(50).repeat(1, 1, 2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    grads = (projected(heads), projected(kv_heads))
    impls = {"torch": lambda: eager(q, k, cos, sin), "triton": lambda: RopeFunction.apply(q, k, cos, sin)}
    size = (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()
    return harness.fwd_bwd(name, impls, (q, k), grads, (2 * size, 2 * size), harness.GB, args.repeat, 1e-2)


def main() -> None:
    args = harness.parse(__doc__)
    shapes, tokens = ({"smoke": (4, 2, 16)}, 37) if args.smoke else (HEADS, TOKENS)
    rows = [row for name, shape in shapes.items() for row in shape_rows(name, tokens, *shape, args)]
    harness.print_table(f"Rotary embeddings over {tokens} tokens, bf16", rows, "GB/s")


if __name__ == "__main__":
    main()
