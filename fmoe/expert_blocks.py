"""Gather, SwiGLU experts, routing weight and scatter-add, fused expert block by expert block.

The MoE layer's expert work is, for ``A`` (row, expert) assignments sorted by expert::

    out[row_of[a]] += scale[a] * down_e(silu(gate_e(x[row_of[a]])) * up_e(x[row_of[a]]))

Written as whole-tensor ops (gather ``[A, D]``, projection ``[A, 2I]``, activation ``[A, I]``,
output ``[A, D]``, scatter) every step streams tensors of ``A`` rows through memory, and on a
CPU each fresh tensor above the allocator's mmap threshold (32 MB in glibc) is page-faulted in
again on every call: at ``A = 32k, I = 256`` those faults cost more than the arithmetic.

:func:`weighted_expert_sum` does the same math one block of at most ``block_rows`` rows of one
expert at a time (``BLOCK_ROWS = 2048``: whole experts at training sizes), so the gathered rows,
the activation and the output are small temporaries that the allocator reuses. Only the output
``[N, D]``, the projection ``h [A, 2I]`` and ``silu(gate) [A, I]`` (both kept for backward) are
full-size. Backward re-gathers the rows and output gradients per block, accumulates the weight
gradients block by block (the first block writes, the next ones add) and scatter-adds the input
gradient; no ``[A, D]`` tensor exists in either direction. Measured on a 2-core CPU
(``benchmarks/RESULTS.md``): a Qwen3-MoE train step went from 0.84x to 0.64-0.68x of
transformers' time in one process.

It is the CPU path of the layer for plain SwiGLU experts without biases with ``matmul="loop"``,
or ``"auto"`` from ``fmoe.ep.BLOCKED_MIN_ROWS`` (256) rows per local expert on average: below
that the whole-tensor path's few large ops beat a Python loop over many small experts (measured:
1024 tokens, 32 experts, top-2 is 0.88x transformers' time whole-tensor, 1.03x blocked). CUDA keeps ``torch._grouped_mm`` over whole tensors (one kernel per op beats a
Python loop over experts there). Double backward and ``torch.func`` transforms run the same math
as whole-tensor differentiable ops (``torch.is_grad_enabled()`` inside backward).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .experts import swiglu_backward

__all__ = ["weighted_expert_sum", "BLOCK_ROWS"]

BLOCK_ROWS = 2048  # rows per block: whole experts at training sizes; temporaries stay far below 32 MB


def _blocks(counts: Sequence[int], block_rows: int):
    """``(expert, start, stop)`` row blocks of at most ``block_rows`` rows, in sorted order."""
    start = 0
    for e, c in enumerate(counts):
        for a in range(start, start + c, block_rows):
            yield e, a, min(a + block_rows, start + c)
        start += c


class _BlockedSwiGLU(torch.autograd.Function):
    """``out [N, D]``, ``h [A, 2I]`` and ``silu(gate) [A, I]`` (both non-differentiable, saved
    for backward: on a CPU the memory is cheaper than recomputing the exponentials)."""

    @staticmethod
    def forward(rows, row_of, scale, w_gate_up, w_down, counts, block_rows):
        A, n_i = row_of.shape[0], w_down.shape[2]
        out = rows.new_zeros(rows.shape[0], w_down.shape[1])                       # [N, D]
        h = rows.new_empty(A, 2 * n_i)                                             # [A, 2I]
        sg = rows.new_empty(A, n_i)                                                # [A, I] silu(gate)
        for e, a, b in _blocks(counts, block_rows):
            idx = row_of[a:b]
            hb = torch.mm(rows.index_select(0, idx), w_gate_up[e].t(), out=h[a:b])  # [B, 2I]
            act = torch.ops.aten.silu.out(hb[:, :n_i], out=sg[a:b]) * hb[:, n_i:]  # [B, I]
            if scale is not None:
                act.mul_(scale[a:b].unsqueeze(1))
            out.index_add_(0, idx, act @ w_down[e].t())
        return out, h, sg

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, row_of, scale, w_gate_up, w_down, ctx.counts, ctx.block_rows = inputs
        ctx.mark_non_differentiable(output[1], output[2])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(rows, row_of, scale, w_gate_up, w_down, output[1], output[2])

    @staticmethod
    def backward(ctx, dout, _dh, _dsg):
        rows, row_of, scale, w_gate_up, w_down, h, sg = ctx.saved_tensors
        if dout is None:
            return (None,) * 7
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():     # double backward / torch.func: differentiable ops only
            return _backward_functional(dout, rows, row_of, scale, w_gate_up, w_down, h, ctx.counts, need)
        dout = dout.contiguous()
        n_i = w_down.shape[2]
        drows = torch.zeros_like(rows) if need[0] else None
        dscale = scale.new_empty(scale.shape) if scale is not None and need[2] else None
        dw_gu = _weight_grad(w_gate_up, ctx.counts) if need[3] else None
        dw_dn = _weight_grad(w_down, ctx.counts) if need[4] else None
        for e, a, b in _blocks(ctx.counts, ctx.block_rows):
            first = a == sum(ctx.counts[:e])    # the expert's first block writes its weight grads
            idx = row_of[a:b]
            x, dy = rows.index_select(0, idx), dout.index_select(0, idx)          # [B, D]
            gate, up = h[a:b, :n_i], h[a:b, n_i:]
            s = sg[a:b]
            act = s * up                                                           # unscaled [B, I]
            da = dy @ w_down[e]                                                    # [B, I]
            if scale is not None:
                if dscale is not None:
                    torch.linalg.vecdot(da, act, out=dscale[a:b])
                sc = scale[a:b].unsqueeze(1)
                act.mul_(sc)
                da.mul_(sc)
            if dw_dn is not None:
                _accumulate_mm(dw_dn[e], dy.t(), act, first)                       # [D, I]
            dh = torch.empty(b - a, 2 * n_i, dtype=h.dtype, device=h.device)      # [B, 2I]
            torch.mul(da, s, out=dh[:, n_i:])
            torch.ops.aten.silu_backward.grad_input(da.mul_(up), gate, grad_input=dh[:, :n_i])
            if drows is not None:
                drows.index_add_(0, idx, dh @ w_gate_up[e])
            if dw_gu is not None:
                _accumulate_mm(dw_gu[e], dh.t(), x, first)                         # [2I, D]
        return drows, None, dscale, dw_gu, dw_dn, None, None


def _weight_grad(w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Uninitialised gradient buffer like ``w [E, ...]``; idle experts' slices zeroed."""
    g = torch.empty_like(w)
    for e, c in enumerate(counts):
        if c == 0:
            g[e].zero_()
    return g


def _accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``out = a @ b`` on an expert's first block, ``out += a @ b`` on the next ones."""
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


def _backward_functional(dout, rows, row_of, scale, w_gate_up, w_down, h, counts, need):
    """The same gradients with whole-tensor, out-of-place ops (differentiable once more)."""
    x, dy = rows.index_select(0, row_of), dout.index_select(0, row_of)          # [A, D]
    dx, dscale, dw_gu, dw_dn = swiglu_backward(x, dy, scale, w_gate_up, w_down, h, counts,
                                               (need[0], need[2], need[3], need[4]))
    drows = torch.zeros_like(rows).index_add(0, row_of, dx) if need[0] else None
    return drows, None, dscale, dw_gu, dw_dn, None, None


def weighted_expert_sum(
    rows: torch.Tensor,
    row_of: torch.Tensor,
    counts: Sequence[int],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    scale: Optional[torch.Tensor] = None,
    block_rows: int = BLOCK_ROWS,
) -> torch.Tensor:
    """Sum of (weighted) SwiGLU expert outputs per row, computed block by block.

    Args:
        rows: ``[N, D]`` input rows (any row stride).
        row_of: ``[A]`` int64, the row of each assignment, assignments sorted by expert.
        counts: assignments per local expert (``sum == A``).
        w_gate_up: ``[E, 2I, D]``; w_down: ``[E, D, I]``.
        scale: optional ``[A]`` weight of each assignment (differentiable).
        block_rows: the most rows of one expert processed at once.
    Returns:
        ``[N, D]``: ``out[n] = sum over assignments a of row n of scale[a] * expert(rows[n])``.

    Example:
        >>> rows, wgu, wd = torch.randn(3, 4), torch.randn(2, 6, 4), torch.randn(2, 4, 3)
        >>> weighted_expert_sum(rows, torch.tensor([0, 2, 0]), [2, 1], wgu, wd).shape
        torch.Size([3, 4])
    """
    counts = [int(c) for c in counts]
    if len(counts) != w_gate_up.shape[0] or sum(counts) != row_of.shape[0]:
        raise ValueError(f"weighted_expert_sum: counts {counts} do not fit {w_gate_up.shape[0]} experts "
                         f"and {row_of.shape[0]} assignments")
    if scale is not None and tuple(scale.shape) != (row_of.shape[0],):
        raise ValueError(f"weighted_expert_sum: scale must have shape ({row_of.shape[0]},), got {tuple(scale.shape)}")
    if not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"weighted_expert_sum: block_rows must be a positive int, got {block_rows!r}")
    return _BlockedSwiGLU.apply(rows, row_of, scale, w_gate_up, w_down, counts, block_rows)[0]
