"""Row buckets for bf16 GEMMs on CPU: expert row counts padded to a few sizes.

On a CPU, bf16 (and fp16) GEMMs run in oneDNN's AMX / AVX-512 kernels, which oneDNN builds and
caches per shape at 1-10 ms each, far more than one expert's GEMM itself. The rows routed to an
expert change every step, so a GEMM per expert on its exact row count builds new kernels every
step. Padding each group's rows with zero rows to one of ~24 bucket sizes (:func:`bucket`: a
multiple of ``MIN_PIECE`` up to 128, then 4 sizes per octave, at most 25% more rows) builds the
kernels once per run; the padding rows contribute exactly zero. Both expert paths use the rule:
the blocked eager path (:mod:`fmoe.experts.blocked`) and the grouped operators' CPU kernels
(:mod:`fmoe.experts.ops`, the path under ``torch.compile`` and ``torch.func``).

Example:
    >>> x, w = torch.randn(5, 4).bfloat16(), torch.randn(4, 3).bfloat16()
    >>> torch.equal(padded_mm(x, w), x @ w)
    True
"""

from __future__ import annotations

import torch

__all__ = ["MIN_PIECE", "bucket", "bucketed", "gather_padded", "padded_mm", "padded_tmm"]

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


def padded_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a [n, k] @ b [k, m]`` computed on ``a``'s rows padded to :func:`bucket` ``(n)`` (into ``out``
    ``[n, m]`` if given)."""
    full = _padded(a) @ b
    if out is None:
        return full[:a.shape[0]]
    return out.copy_(full[:a.shape[0]])


def padded_tmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``a^T @ b`` for ``a [n, ka]``, ``b [n, kb]`` (a weight gradient: ``n`` is the contraction),
    both padded with zero rows to :func:`bucket` ``(n)``, into ``out [ka, kb]``."""
    return torch.mm(_padded(a).t(), _padded(b), out=out)
