"""Token log-probs through the output head (`fastdpo.kernels.logprob_head`): the Triton kernels (a chunk of logits at
a time, in the GEMM's dtype) against eager torch (the full logits in float32, log_softmax and a gather) and against
the op's own chunked float32 path, forward and backward, at the heads of Qwen3-1.7B and 8B.

    python benchmarks/kernels/logprob_head.py [--repeat 20]    # on a CUDA GPU
    python benchmarks/kernels/logprob_head.py --smoke          # anywhere: tiny shapes (the interpreter off CUDA)

Prints ms, TFLOP/s (of the head's GEMMs: 2 N V H forward, 4 N V H backward, though the chunked paths recompute the
logits), the speed-up over eager torch and each one's peak memory, once their log-probs and gradients agree."""

import harness  # first: the checkout's src on the path, and Triton's interpreter off CUDA
import torch

from fastdpo.kernels.logprob_head import token_logps

HEADS = {"Qwen3-1.7B": 2048, "Qwen3-8B": 4096}  # hidden size
VOCAB = 151936
ROWS = 4096  # a micro-batch's completion tokens


def eager(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax((h @ w.t()).float(), -1).gather(1, t[:, None]).squeeze(1)


def shape_rows(name: str, rows: int, vocab: int, hidden: int, args) -> list[harness.Row]:
    g = torch.Generator(device=args.device).manual_seed(0)
    h = torch.randn(rows, hidden, device=args.device, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device=args.device, generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (rows,), device=args.device, generator=g)
    grad = torch.randn(rows, device=args.device, generator=g)
    impls = {"torch": lambda: eager(h, w, t), "chunked": lambda: token_logps(h, w, t),
             "triton": lambda: token_logps(h, w, t, kernels=True)}
    flops = 2 * rows * vocab * hidden
    return harness.fwd_bwd(name, impls, (h, w), grad, (flops, 2 * flops), harness.TFLOP, args.repeat, 2e-2)


def main() -> None:
    args = harness.parse(__doc__)
    heads, rows, vocab = ({"smoke": 16}, 37, 300) if args.smoke else (HEADS, ROWS, VOCAB)
    table = [row for name, hidden in heads.items() for row in shape_rows(name, rows, vocab, hidden, args)]
    harness.print_table(f"Token log-probs of {rows} rows through a {vocab}-wide head, bf16", table, "TFLOP/s")


if __name__ == "__main__":
    main()
