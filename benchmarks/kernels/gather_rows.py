"""The gathered rows' backward (`fastdpo.kernels.gather_rows`): the gradient of a row gather that takes each row once
or twice (the varlen attention's keys and values, a prompt's rows in both of its pair's sequences), as one Triton pass
against index_select's own backward (index_add with atomics), at the key shape of Qwen3-1.7B and 8B.

    python benchmarks/kernels/gather_rows.py [--repeat 20]    # on a CUDA GPU
    python benchmarks/kernels/gather_rows.py --smoke          # anywhere: tiny shapes (the interpreter off CUDA)

The forward is index_select either way: only the backward is timed. Prints ms, GB/s (the gathered gradient read and
the rows' gradient written), the Triton op's speed-up and each one's peak memory, once the gradients agree."""

import harness  # first: the checkout's src on the path, and Triton's interpreter off CUDA
import torch

from fastdpo.kernels.gather_rows import gather_rows_backward

KEYS = {"Qwen3-1.7B/8B": (8, 128)}  # key heads, head size: the two models share them
TOKENS = 8192  # one micro-batch
PROMPT_SHARE = 0.5  # of the tokens, those of prompts: gathered twice, once for each sequence of the pair


def shape_rows(name: str, tokens: int, heads: int, dim: int, args) -> list[harness.Row]:
    g = torch.Generator(device=args.device).manual_seed(0)
    twice = int(tokens * PROMPT_SHARE)
    index = torch.cat([torch.arange(tokens), torch.arange(twice)]).to(args.device)  # the gather: x[index]
    first = torch.arange(tokens, device=args.device)  # where each row's gradient rows are
    second = torch.cat([torch.arange(tokens, tokens + twice), torch.full((tokens - twice,), -1)]).to(args.device)
    grad = torch.randn(len(index), heads, dim, device=args.device, generator=g).bfloat16()

    def eager():  # index_select's backward
        return torch.zeros(tokens, heads, dim, dtype=grad.dtype, device=grad.device).index_add_(0, index, grad)

    got, want = gather_rows_backward(grad, first, second), eager()
    harness.agree(f"{name}, the rows' gradient", got, want, 1e-2)
    size = (grad.numel() + tokens * heads * dim) * grad.element_size()
    return [harness.measure(name, "bwd", "torch", eager, args.repeat, size, harness.GB),
            harness.measure(name, "bwd", "triton", lambda: gather_rows_backward(grad, first, second), args.repeat, size,
                            harness.GB)]


def main() -> None:
    args = harness.parse(__doc__)
    shapes, tokens = ({"smoke": (2, 40)}, 37) if args.smoke else (KEYS, TOKENS)
    rows = [row for name, shape in shapes.items() for row in shape_rows(name, tokens, *shape, args)]
    harness.print_table(f"Gathered keys' backward over {tokens} tokens, bf16", rows, "GB/s")


if __name__ == "__main__":
    main()
