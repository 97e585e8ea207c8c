"""Row buckets for bf16 GEMMs on CPU: expert row counts padded to a few sizes.

On a CPU, bf16 (and fp16) GEMMs run in oneDNN's AMX / AVX-512 kernels, which oneDNN builds and
caches per shape at 1-10 ms each, far more than one expert's GEMM itself. The rows routed to an
expert change every step, so a GEMM per expert on its exact row count builds new kernels every
step. Padding each group's rows with zero rows to one of ~24 bucket sizes (:func:`bucket`: a
multiple of ``MIN_PIECE`` up to 128, then 4 sizes per octave, at most 25% more rows) builds the
kernels once per run; the padding rows contribute exactly zero. Both expert paths use the rule:
the blocked eager path (:mod:`fmoe.experts.blocked`) and the grouped operators' CPU kernels
(:mod:`fmoe.experts.ops`, the path under ``torch.compile`` and ``torch.func``).

The grouped kernels (:func:`grouped_mm`, :func:`grouped_wgrad`) pad without copying a group:
rows are independent in ``x_g @ w``, so a group's padding rows are simply the rows that follow it
(the next groups' rows, whose results those groups overwrite afterwards, in order); only a group
whose bucket runs past the last row is copied. A weight gradient sums over the rows, so there one
operand's padding rows must be zeros: its group is copied into one reused buffer.

Example:
    >>> x, w = torch.randn(5, 4).bfloat16(), torch.randn(1, 4, 3).bfloat16()
    >>> torch.equal(grouped_mm(x, w, [0, 5]), x @ w[0])
    True
"""

from __future__ import annotations

import torch

__all__ = ["MIN_PIECE", "bucket", "bucketed", "gather_padded", "grouped_mm", "grouped_wgrad"]

MIN_PIECE = 16     # GEMM row counts are padded to multiples of this (and coarser above 128)


def bucket(n: int) -> int:
    """The GEMM row count ``n`` rows are padded to.

    Example:
        >>> [bucket(n) for n in (5, 37, 128, 129, 300, 2048)]
        [16, 48, 128, 160, 320, 2048]
    """
    step = max(MIN_PIECE, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


def bucketed(t: torch.Tensor) -> bool:
    """Whether GEMMs on ``t`` run in oneDNN's per-shape kernels: bf16 / fp16 on CPU."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def gather_padded(src: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    """``src[idx]`` followed by zero rows up to ``rows`` rows."""
    if rows == idx.shape[0]:
        return src.index_select(0, idx)
    out = src.new_empty(rows, src.shape[1])
    torch.index_select(src, 0, idx, out=out[:idx.shape[0]])
    out[idx.shape[0]:].zero_()
    return out


def _padded(x: torch.Tensor) -> torch.Tensor:
    """``x [n, k]`` followed by zero rows up to :func:`bucket` ``(n)`` rows (``x`` itself when none)."""
    rows = bucket(x.shape[0])
    if rows == x.shape[0]:
        return x
    out = x.new_zeros(rows, x.shape[1])
    out[:x.shape[0]] = x
    return out


def grouped_mm(x: torch.Tensor, wt: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """``out_g = x_g @ wt[g]`` for the row groups ``x[bounds[g]:bounds[g + 1]]`` (``x [N, k]``,
    ``wt [G, k, n]``), each GEMM on :func:`bucket` rows (the rows after the group; a zero-padded
    copy only past the last row). Rows after ``bounds[-1]`` are zeros.

    Example:
        >>> x, wt = torch.randn(5, 4).bfloat16(), torch.randn(2, 4, 3).bfloat16()
        >>> torch.equal(grouped_mm(x, wt, [0, 2, 5]), torch.cat([x[:2] @ wt[0], x[2:] @ wt[1]]))
        True
    """
    n = x.shape[0]
    sizes = [(s, e - s) for s, e in zip(bounds[:-1], bounds[1:])]
    spill = max([bucket(m) + s - n for s, m in sizes if m] + [0])
    out = x.new_empty(n + spill, wt.shape[2])                     # [N + spill, n]
    for g, (s, m) in enumerate(sizes):                            # in order: a group overwrites the spill of earlier ones
        if m:
            rows = bucket(m)
            torch.mm(x[s:s + rows] if s + rows <= n else _padded(x[s:s + m]), wt[g], out=out[s:s + rows])
    out[bounds[-1]:n].zero_()
    return out[:n]


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """``out[g] = a_g^T @ b_g`` (``a [N, ka]``, ``b [N, kb]``, groups of rows by ``bounds``: a
    weight gradient, the rows are the contraction), on :func:`bucket` rows: the narrower operand's
    group copied into one zero-padded buffer, the other's padding rows read after the group (a
    copy where they would run past ``bounds[-1]``: rows of no group may hold anything).
    Returns ``[G, ka, kb]`` (zeros for an empty group).

    Example:
        >>> a, b = torch.randn(5, 3).bfloat16(), torch.randn(5, 4).bfloat16()
        >>> torch.equal(grouped_wgrad(a, b, [0, 2, 5])[1], a[2:].t() @ b[2:])
        True
    """
    flip = a.shape[1] > b.shape[1]                                # copy the narrower operand
    pad, full = (b, a) if flip else (a, b)
    sizes = [(s, e - s) for s, e in zip(bounds[:-1], bounds[1:])]
    out = a.new_empty(len(sizes), a.shape[1], b.shape[1])       # [G, ka, kb]
    buf = pad.new_empty(max([bucket(m) for _, m in sizes] + [0]), pad.shape[1])
    for g, (s, m) in enumerate(sizes):
        if not m:
            out[g].zero_()
            continue
        rows = bucket(m)
        buf[:m].copy_(pad[s:s + m])
        buf[m:rows].zero_()
        other = full[s:s + rows] if s + rows <= bounds[-1] else _padded(full[s:s + m])   # no row of no group
        if flip:
            torch.mm(other.t(), buf[:rows], out=out[g])
        else:
            torch.mm(buf[:rows].t(), other, out=out[g])
    return out
