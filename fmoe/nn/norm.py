"""RMS normalisation, over the model dim or per attention head.

Both normalise in fp32 and scale by a learned weight, in exactly the order of transformers'
``LlamaRMSNorm`` (so logits match bit for bit in fp32)::

    y = w * (x * rsqrt(mean(x**2, -1) + eps))

The weight is replicated over tp (its input is replicated too; with sequence parallelism, a
weight placed on ``fmoe.Mesh(..., sp=True)``, the input is this rank's piece of the sequence,
so ``rms_norm`` marks the weight's gradient ``Partial`` over tp: each rank saw other tokens).
A per-head norm (the q/k norms
of Qwen3 and friends) is the one subtle case: its weight ``[hd]`` is replicated, but when a plan
shards attention heads over tp each rank normalises only its own heads, so its weight gradient
is a *partial* sum over tp. ``head_rms_norm`` infers that from the number of heads it sees
versus the configured ``num_heads`` and marks the gradient ``Partial`` (summed by
:func:`fmoe.gather` / DTensor reductions); with replicated attention the gradient is already
complete on every rank. Either way gathered gradients equal single-process gradients.

A norm over a whole projection (OLMoE's q / k norms: ``w [H*hd]`` on ``q [..., H*hd]``, before
the heads are split) meets the projection's tp split: its weight is placed like the
projection's rows (``P("tp")``), each rank holds a slice of the features, and ``rms_norm`` then
sums the squares of its slice and all-reduces the sums over the weight's tp group
(:func:`fmoe.collectives.all_reduce`; in backward the sum's gradient, a part on each rank, is
summed by :func:`fmoe.collectives.grad_sum`), so the mean is over the full width, as on one process; each rank scales its features by its slice of ``w`` (whose gradient is complete:
every rank sees every token).
"""

from __future__ import annotations

import torch

from ..collectives import all_reduce, gather_slices, grad_sum, group_size
from ..fsdp import unshard
from ..precision import upcast
from ..sharding import chunk_sizes, placement_of
from ._tp import axis_group, check_tensor, sp_group, tp_size_rank

__all__ = ["rms_norm", "head_rms_norm"]


def _norm(x: torch.Tensor, wl: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = upcast(x)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return wl * h.to(dtype)


def _check(fn: str, x: torch.Tensor, w: torch.Tensor, eps: float, split: bool = False) -> None:
    check_tensor(fn, "x", x)
    check_tensor(fn, "w", w, 1)
    if placement_of(w).dim_of("tp") is not None and not split and group_size(axis_group(w)) > 1:
        raise ValueError(f"{fn}: w must be replicated over tp, got placement {placement_of(w)!r}")
    if not split and x.shape[-1] != w.shape[0]:
        raise ValueError(f"{fn}: x has last dim {x.shape[-1]} but w has {w.shape[0]} entries")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{fn}: eps must be a number >= 0, got {eps!r}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` and scale by ``w``.

    Args:
        x: ``[..., D]`` (replicated over tp; with sequence parallelism this rank's piece of the
            sequence), or with a tp-split ``w`` this rank's features ``[..., D / tp]`` (a colwise
            projection's output; the full ``[..., D]`` is normalised with ``w`` gathered).
        w: ``[D]``, replicated or split over tp (``P("tp")``: the mean of squares all-reduced
            over its tp group); a split over fsdp is gathered for the call.
        eps: added to the mean square.
    Returns:
        ``[..., D]`` (``[..., D / tp]`` for local features) in ``x``'s dtype (times ``w``'s dtype promotion).

    Example:
        >>> rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), eps=0.0)
        tensor([[0.8485, 1.1314]])
    """
    group, n, _ = tp_size_rank(w)
    _check("rms_norm", x, w, eps, split=placement_of(w).dim_of("tp") is not None and n > 1)
    if n == 1 or placement_of(w).dim_of("tp") is None:
        partial = ("tp",) if sp_group(w)[1] > 1 else ()   # sequence parallel: this rank's tokens only
        return _norm(x, unshard(w, keep=("tp",), partial_grad=partial), eps)
    wl, width = unshard(w, keep=("tp",)), w.shape[0]      # wl: this rank's slice [D / tp]
    if x.shape[-1] == width:                              # full-width features: the whole weight
        return _norm(x, gather_slices(wl, group, dim=0, sizes=chunk_sizes(width, n)), eps)
    if x.shape[-1] != wl.shape[0]:
        raise ValueError(f"rms_norm: x has last dim {x.shape[-1]} but w, split over tp={n}, has {wl.shape[0]} "
                         f"entries on this rank ({width} in all)")
    h = upcast(x)
    # [..., 1] over the full width; each rank scales only its features by it, so its gradient is summed too
    square_sum = grad_sum(all_reduce(h.pow(2).sum(-1, keepdim=True), group), group)
    return wl * (h * torch.rsqrt(square_sum / width + eps)).to(x.dtype)


def head_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, num_heads: int) -> torch.Tensor:
    """RMS-normalise each head of ``x`` (q/k norm) with a weight shared by all heads.

    Args:
        x: ``[..., H_local, hd]``: this rank's heads (all ``num_heads`` or a tp share of them).
        w: ``[hd]``, replicated over tp.
        eps: added to the mean square.
        num_heads: the configured (global) number of heads of this projection.
    Returns:
        ``[..., H_local, hd]``.

    Example:
        >>> head_rms_norm(torch.ones(2, 4, 8), torch.ones(8), 1e-6, num_heads=4).shape
        torch.Size([2, 4, 8])
    """
    _check("head_rms_norm", x, w, eps)
    if x.ndim < 2:
        raise ValueError(f"head_rms_norm: x must be [..., heads, head_dim], got shape {tuple(x.shape)}")
    local = x.shape[-2]
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 \
            or local > num_heads or num_heads % local:
        raise ValueError(f"head_rms_norm: num_heads={num_heads!r} must be a positive multiple of "
                         f"the {local} heads x holds")
    sharded = local < num_heads  # heads split over tp: this rank's weight gradient is partial
    wl = unshard(w, keep=("tp",), partial_grad=("tp",) if sharded else ())
    return _norm(x, wl, eps)
