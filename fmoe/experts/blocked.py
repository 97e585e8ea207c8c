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
or ``"auto"`` from ``fmoe.experts.BLOCKED_MIN_ROWS`` (256) rows per local expert on average: below
that the whole-tensor path's few large ops beat a Python loop over many small experts (measured:
1024 tokens, 32 experts, top-2 is 0.88x transformers' time whole-tensor, 1.03x blocked).
In bf16 (and fp16) on CPU the GEMMs run in oneDNN's AMX kernels (``brg_matmul:..._amx``), which
oneDNN builds and caches per shape at 1-10 ms each, far more than the GEMM itself; expert row
counts change every step, so each block is computed on ``bucket(B)`` rows (:mod:`fmoe.experts.buckets`: the gathered rows
padded with zero rows to one of ~24 sizes up to 2048, at most 25% more rows, padding rows
contribute exactly zero) and the kernels are built once per run. Sums over assignments (the
output and the input gradient) accumulate in fp32 and are rounded once; the fp32 path is as
described above. ``fmoe.experts`` takes this path for bf16 on CPU at any number of rows.
CUDA keeps ``torch._grouped_mm`` over whole tensors (one kernel per op beats a Python loop over
experts there). Double backward and ``torch.func`` transforms run the same math
as whole-tensor differentiable ops (``torch.is_grad_enabled()`` inside backward).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..transforms import vmap_by_loop
from .buckets import bucket, bucketed, gather_padded
from .mlp import _gmm, check_groups, swiglu_backward, swiglu_jvp

__all__ = ["weighted_expert_sum", "BLOCK_ROWS"]

BLOCK_ROWS = 2048  # rows per block: whole experts at training sizes; temporaries stay far below 32 MB


def _block_plan(counts: Sequence[int], block_rows: int,
                pad: bool = False) -> tuple[list[int], list[int], list[bool], list[int]]:
    """Row blocks of at most ``block_rows`` rows, in sorted order: the expert of each block, its
    size, whether it is its expert's first block (which writes the weight gradients), and the
    rows it is computed on (its size, or with ``pad`` the :func:`fmoe.experts.buckets.bucket` above it)."""
    experts, sizes, firsts = [], [], []
    for e, c in enumerate(counts):
        for a in range(0, c, block_rows):
            experts.append(e)
            sizes.append(min(block_rows, c - a))
            firsts.append(a == 0)
    return experts, sizes, firsts, [bucket(b) for b in sizes] if pad else sizes


class _BlockedSwiGLU(torch.autograd.Function):
    """``out [N, D]``, ``h [A', 2I]`` and ``silu(gate) [A', I]`` (both non-differentiable, saved
    for backward: on a CPU the memory is cheaper than recomputing the exponentials; ``A'`` is
    ``A`` plus the bf16 blocks' zero padding)."""

    @staticmethod
    def forward(rows, row_of, scale, w_gate_up, w_down, counts, block_rows):
        n_i = w_down.shape[2]
        experts, sizes, _, padded = _block_plan(counts, block_rows, bucketed(rows))
        acc = _accumulator(rows, (rows.shape[0], w_down.shape[1]))                # [N, D], >= fp32
        h = rows.new_empty(sum(padded), 2 * n_i)                                   # [A', 2I]
        sg = rows.new_empty(sum(padded), n_i)                                      # [A', I] silu(gate)
        scales = scale.unsqueeze(1).split(sizes) if scale is not None else [None] * len(sizes)
        wgu_t, wd_t = w_gate_up.transpose(1, 2).unbind(0), w_down.transpose(1, 2).unbind(0)
        for e, b, idx, hb, sb, sc in zip(experts, sizes, row_of.split(sizes), h.split(padded), sg.split(padded),
                                         scales):
            torch.mm(gather_padded(rows, idx, hb.shape[0]), wgu_t[e], out=hb)           # [B', 2I]
            act = torch.ops.aten.silu.out(hb[:, :n_i], out=sb) * hb[:, n_i:]      # [B', I], padding rows 0
            if sc is not None:
                act[:b].mul_(sc)
            acc.index_add_(0, idx, (act @ wd_t[e])[:b].to(acc.dtype))             # [B, D] summed per row
        return acc.to(rows.dtype), h, sg

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, row_of, scale, w_gate_up, w_down, ctx.counts, ctx.block_rows = inputs
        ctx.mark_non_differentiable(output[1], output[2])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(rows, row_of, scale, w_gate_up, w_down, output[1], output[2])
        ctx.save_for_forward(rows, row_of, scale, w_gate_up, w_down)

    @staticmethod
    def jvp(ctx, drows, _drow_of, dscale, dw_gate_up, dw_down, *_):
        rows, row_of, scale, w_gate_up, w_down = ctx.saved_tensors
        pick = lambda t: t.index_select(0, row_of) if t is not None else None  # noqa: E731
        mm = lambda a, w: _gmm(a, w, None, ctx.counts, False, trans=True)      # noqa: E731
        dy = swiglu_jvp(mm, pick(rows), scale, w_gate_up, w_down, pick(drows), dscale, dw_gate_up, dw_down)
        return rows.new_zeros(rows.shape[0], dy.shape[1]).index_add(0, row_of, dy), None, None

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
        drows = _accumulator(rows, rows.shape) if need[0] else None              # [N, D], >= fp32
        dscale = scale.new_empty(scale.shape) if scale is not None and need[2] else None
        dw_gu = _weight_grad(w_gate_up, ctx.counts) if need[3] else None
        dw_dn = _weight_grad(w_down, ctx.counts) if need[4] else None
        experts, sizes, firsts, padded = _block_plan(ctx.counts, ctx.block_rows, bucketed(rows))
        none = [None] * len(sizes)
        scales = scale.unsqueeze(1).split(sizes) if scale is not None else none
        dscales = dscale.split(sizes) if dscale is not None else none
        wgu, wd = w_gate_up.unbind(0), w_down.unbind(0)
        dwgu = dw_gu.unbind(0) if dw_gu is not None else None
        dwdn = dw_dn.unbind(0) if dw_dn is not None else None
        blocks = zip(experts, firsts, sizes, row_of.split(sizes), h[:, :n_i].split(padded), h[:, n_i:].split(padded),
                     sg.split(padded), scales, dscales)
        for e, first, b, idx, gate, up, s, sc, dsc in blocks:
            x, dy = gather_padded(rows, idx, gate.shape[0]), gather_padded(dout, idx, gate.shape[0])   # [B', D]
            act = s * up                                                           # unscaled [B', I]
            da = dy @ wd[e]                                                        # [B', I]
            if sc is not None:
                if dsc is not None:
                    torch.linalg.vecdot(da[:b], act[:b], out=dsc)
                act[:b].mul_(sc)
                da[:b].mul_(sc)
            if dwdn is not None:
                _accumulate_mm(dwdn[e], dy.t(), act, first)                        # [D, I]
            dh = torch.empty(x.shape[0], 2 * n_i, dtype=h.dtype, device=h.device)  # [B', 2I]
            torch.mul(da, s, out=dh[:, n_i:])
            torch.ops.aten.silu_backward.grad_input(da.mul_(up), gate, grad_input=dh[:, :n_i])
            if drows is not None:
                drows.index_add_(0, idx, (dh @ wgu[e])[:b].to(drows.dtype))
            if dwgu is not None:
                _accumulate_mm(dwgu[e], dh.t(), x, first)                          # [2I, D]
        return None if drows is None else drows.to(rows.dtype), None, dscale, dw_gu, dw_dn, None, None


_BlockedSwiGLU.vmap = staticmethod(vmap_by_loop(_BlockedSwiGLU.apply))


def _weight_grad(w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Uninitialised gradient buffer like ``w [E, ...]``; idle experts' slices zeroed."""
    g = torch.empty_like(w)
    for e, c in enumerate(counts):
        if c == 0:
            g[e].zero_()
    return g


def _accumulator(like: torch.Tensor, shape) -> torch.Tensor:
    """Zeros for a sum over assignments: ``like``'s dtype promoted to at least fp32 (bf16 rows
    are summed in fp32, then rounded once; fp32 and fp64 stay as they are)."""
    return torch.zeros(shape, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)


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


@torch.compiler.disable       # a kernel on host counts: never traced (a trace takes fmoe.experts.ops' operators)
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
    counts = check_groups("weighted_expert_sum", counts, w_gate_up.shape[0], row_of.shape[0], "assignments", scale)
    if not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"weighted_expert_sum: block_rows must be a positive int, got {block_rows!r}")
    return _BlockedSwiGLU.apply(rows, row_of, scale, w_gate_up, w_down, counts, block_rows)[0]
