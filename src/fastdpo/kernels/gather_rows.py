"""The backward of a row gather that takes each row once or twice: x.index_select(0, index) gives x's gradient back
as each row's at most two gradient rows summed, in one pass without atomics.

The varlen attention gathers each sequence's keys and values, so a prompt's rows appear in both of its pair's
sequences; index_select's own backward adds the rows one by one with atomics (`fastdpo.model.attention` routes a
fused attention's gather here)."""

from __future__ import annotations

import math

import torch

from fastdpo.kernels.launch import HAVE_TRITON, launch

if HAVE_TRITON:  # else no kernel: index_select's own backward
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["W"])
    def _gather_rows_bwd(G, FIRST, SECOND, DX, W, BLOCK: tl.constexpr):
        """One row of DX per program: G[first] + G[second] (the second when there is one, >= 0), summed in float32."""
        row = tl.program_id(0).to(tl.int64)
        i1 = tl.load(FIRST + row)  # every row is taken at least once
        i2 = tl.load(SECOND + row)
        twice = i2 >= 0
        i2 = tl.maximum(i2, 0)
        for start in range(0, W, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            keep = cols < W
            acc = tl.load(G + i1 * W + cols, mask=keep, other=0.0).to(tl.float32)
            acc += tl.where(twice, tl.load(G + i2 * W + cols, mask=keep, other=0.0).to(tl.float32), 0.0)
            tl.store(DX + row * W + cols, acc.to(DX.dtype.element_ty), mask=keep)


GATHER_BLOCK = 1024  # elements of a row per inner iteration, whatever the width: one build serves every model


def gather_rows_backward(grad: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The gradient of x.index_select(0, index) with respect to x when each row of x was taken once or twice, at
    `first` and `second` (-1: taken once; (T,) long each): grad[first] + grad[second], summed in float32 and rounded
    once, without atomics. grad (K, ...) -> (T, ...)."""
    g = grad.contiguous()
    rows, width = first.numel(), math.prod(g.shape[1:])
    out = torch.empty((rows, *g.shape[1:]), dtype=g.dtype, device=g.device)
    if rows and width:
        launch(_gather_rows_bwd, (rows,), g, first.contiguous(), second.contiguous(), out, width, num_warps=4,
               BLOCK=GATHER_BLOCK)
    return out


class GatherRows(torch.autograd.Function):
    """x.index_select(0, index) whose backward adds each row's at most two gradient rows in one kernel pass
    (`gather_rows_backward`, from `first` and `second`: the places each row of x was taken to, `second` -1 where
    it was taken once), where index_select's backward adds them one by one with atomics."""

    @staticmethod
    def forward(ctx, x, index, first, second):
        ctx.save_for_backward(first, second)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        first, second = ctx.saved_tensors
        return gather_rows_backward(grad, first, second), None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """`x.index_select(0, index)` with the one-pass backward (`GatherRows`)."""
    return GatherRows.apply(x, index, first, second)
