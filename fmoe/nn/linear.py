"""Linear layers and embeddings that read the placement of their weight.

The weight is in the Hugging Face layout ``w [out, in]``, ``y = x @ w.T + b``. What ``linear``
does on a rank depends only on ``placement_of(w)`` and on the width of ``x``:

====================  ==============================  ========================================
placement of ``w``    input ``x``                     output, collectives
====================  ==============================  ========================================
``P()``               full width                      full; none
colwise ``P("tp",     full width (replicated over     this rank's slice of the out features;
None)``               tp; wrapped in ``grad_sum``,    with ``gather=True`` gathered to full
                      so ``dx`` is summed over tp)    width (``gather_slices``)
rowwise ``P(None,     this rank's slice of the in     partial products summed with
"tp")``               features, or the full width     ``all_reduce``; the bias (replicated) is
                      (own part sliced out)           added once, after the sum
====================  ==============================  ========================================

``packed=2`` (a fused ``[gate | up]`` weight) splits each block separately: a colwise output
is locally ``[gate_r | up_r]``, so ``chunk(2, -1)`` still separates gate from up, and a
rowwise layer slices a full-width input block by block. Splits over ``fsdp`` / ``efsdp`` /
``dp_replicate`` are gathered for the call by :func:`fmoe.fsdp.unshard` (gradients
reduce-scattered back). bf16 on a CPU without native bf16 multiplies in fp32, on the same bf16
values (:func:`fmoe.precision.gemm`).

``embedding`` does the same for a lookup table ``[V, D]``: replicated, vocabulary-parallel
``P("tp", None)`` (each rank looks up the tokens in its row range, others give zeros, the
partial lookups are all-reduced) or split on ``D`` (local lookup, features gathered). Its
``padding_idx`` row gets no gradient on any placement (the rank holding that row drops it).

Sequence parallelism (a weight placed on ``fmoe.Mesh(tp=n, sp=True)``,
:func:`fmoe.sharding.sequence_parallel`): between tensor-parallel layers the activations are
split over tp on the sequence dim (``[..., S / n, F]``), so a colwise layer all-gathers its
input along the sequence (backward: reduce-scatter, which also does the ``grad_sum``; it keeps
only this rank's piece for backward and gathers it again there: ``collectives.gathered_linear``),
a rowwise layer reduce-scatters its partial products along the sequence instead of all-reducing
them, a replicated weight (and a rowwise layer's bias) works on this rank's piece of the sequence, so
its gradient is marked ``Partial`` over tp, and the vocabulary-parallel embedding
reduce-scatters its partial lookups along the sequence (a replicated or ``D``-split table keeps
this rank's piece of its output). ``n`` must divide the sequence.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..collectives import all_reduce, grad_sum, gather_slices, gathered_linear
from ..fsdp import unshard
from ..precision import gemm
from ..sharding import chunk_range, chunk_sizes, placement_of
from ..transforms import data_checks_enabled
from ._tp import SEQ_DIM, check_tensor, own_part, own_seq, scatter_seq, sp_group, tp_size_rank, unpack_gathered

__all__ = ["linear", "embedding"]


def _check_weight(fn: str, name: str, w: torch.Tensor, ndim: int) -> None:
    check_tensor(fn, name, w, ndim)
    p = placement_of(w)
    if {"ep", "efsdp"} & set(p.mesh_axes()):
        raise ValueError(f"{fn}: {name} is placed {p!r} on the expert mesh; expert weights are "
                         "computed by fmoe.moe, not by dense layers")


def _colwise_bias(b: torch.Tensor, width: int, n: int, r: int, packed: int) -> torch.Tensor:
    """The bias slice matching a colwise output of local ``width``."""
    if placement_of(b).dim_of("tp") is not None:
        bl = unshard(b, keep=("tp",))
    else:  # replicated bias: slice own part; its gradient is then a partial sum over tp
        bl = own_part(unshard(b, keep=("tp",), partial_grad=("tp",)), n, r, packed)
    if bl.shape[-1] != width:
        raise ValueError(f"linear: b has {b.shape[-1]} features but the colwise weight gives "
                         f"{width * n} (local {width}); place b like the weight's rows (style colwise)")
    return bl


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, *,
           gather: Optional[bool] = None) -> torch.Tensor:
    """``y = x @ w.T + b`` with the collectives that ``w``'s placement needs (see module doc).

    Args:
        x: input ``[..., in]`` (or ``[..., in / tp]`` for a rowwise weight fed a local slice);
            with sequence parallelism ``[..., S / tp, in]`` except for a rowwise weight.
        w: weight ``[out, in]``: plain tensor or DTensor from :func:`fmoe.shard`.
        b: optional bias ``[out]``.
        gather: for a colwise weight, gather the output to full width (True), keep the local
            slice (False), or do what the placement says (None: ``P(..., gather=True)``).
    Returns:
        ``[..., out]``, or ``[..., out / tp]`` for a colwise weight that is not gathered (with
        sequence parallelism a colwise output has the whole sequence, a rowwise one ``S / tp``).

    Example:
        >>> linear(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(4)).shape
        torch.Size([2, 4])
    """
    check_tensor("linear", "x", x)
    _check_weight("linear", "w", w, 2)
    if b is not None:
        _check_weight("linear", "b", b, 1)
        if b.shape[0] != w.shape[0]:
            raise ValueError(f"linear: b has shape {tuple(b.shape)} but w has {w.shape[0]} output features")
    p = placement_of(w)
    tp_dim = p.dim_of("tp")
    group, n, r = tp_size_rank(w)
    sp = sp_group(w)[1] > 1                   # x (and a rowwise output) split over tp on the sequence
    partial = ("tp",) if sp else ()           # a replicated weight on this rank's tokens only
    wl = unshard(w, keep=("tp",), partial_grad=partial if tp_dim is None else ())
    if tp_dim is None or n == 1:
        if x.shape[-1] != wl.shape[1]:
            raise ValueError(f"linear: x has {x.shape[-1]} features but w {tuple(w.shape)} expects {wl.shape[1]}")
        if b is not None and placement_of(b).dim_of("tp") is not None and n > 1:
            raise ValueError(f"linear: b is split over tp ({placement_of(b)!r}) but w is not ({p!r})")
        return gemm(F.linear, x, wl, None if b is None else unshard(b, keep=("tp",), partial_grad=partial))
    if tp_dim == 0:  # colwise: [out/tp, in]
        if x.shape[-1] != wl.shape[1]:
            raise ValueError(f"linear: colwise w {tuple(w.shape)} needs the full input width "
                             f"{wl.shape[1]}, but x has {x.shape[-1]} features")
        bl = None if b is None else _colwise_bias(b, wl.shape[0], n, r, p.packed)
        if sp:   # the whole sequence for this rank's features; x's piece (not the gathered x) kept for backward
            y = gathered_linear(x, wl, bl, group, dim=SEQ_DIM)
        else:
            y = gemm(F.linear, grad_sum(x, group), wl, bl)
        if gather or (gather is None and p.gather):
            sizes = [y.shape[-1]] * n if p.packed > 1 else chunk_sizes(w.shape[0], n)  # uneven: torch.chunk
            y = gather_slices(y, group, dim=-1, sizes=sizes)
            y = unpack_gathered(y, n, p.packed)
        return y
    # rowwise: [out, in/tp]
    in_local = wl.shape[1]
    if x.shape[-1] == in_local:
        xl = x
    elif x.shape[-1] == w.shape[1] and not sp:  # replicated input: own part; dx summed over tp in backward
        xl = own_part(grad_sum(x, group), n, r, p.packed)
    else:
        raise ValueError(f"linear: rowwise w {tuple(w.shape)} takes x with {in_local} (local slice) "
                         f"{'' if sp else f'or {w.shape[1]} (full) '}features, got {x.shape[-1]}"
                         + (" (with sequence parallelism a rowwise layer takes a colwise layer's local features)"
                            if sp else ""))
    if sp and xl.shape[SEQ_DIM] % n:
        raise ValueError(f"linear: sequence parallelism splits the sequence over tp={n}, but x has "
                         f"{xl.shape[SEQ_DIM]} positions on dim {SEQ_DIM} (shape {tuple(x.shape)})")
    y = scatter_seq(gemm(F.linear, xl, wl), group) if sp else all_reduce(gemm(F.linear, xl, wl), group)
    if b is not None:
        if placement_of(b).dim_of("tp") is not None:
            raise ValueError(f"linear: a rowwise layer's bias must be replicated over tp, got {placement_of(b)!r}")
        y = y + unshard(b, keep=("tp",), partial_grad=partial)
    return y


def embedding(tokens: torch.Tensor, table: torch.Tensor, padding_idx: Optional[int] = None) -> torch.Tensor:
    """Look up ``tokens`` in ``table [V, D]``, replicated or sharded over tp (see module doc).

    Args:
        tokens: integer ids ``[...]`` in ``[0, V)``.
        table: ``[V, D]``: plain, vocabulary-parallel ``P("tp", None)`` or ``P(None, "tp")``.
        padding_idx: as ``torch.nn.Embedding(padding_idx=)`` (transformers passes the config's
            ``pad_token_id``): row ``padding_idx`` gets no gradient; the output is unchanged. None:
            every row learns.
    Returns:
        ``[..., D]``, identical on every rank of the tp group; with sequence parallelism this
        rank's piece ``[..., S / tp, D]`` of the sequence (the last dim of ``tokens``).

    Example:
        >>> table = torch.eye(3, requires_grad=True)
        >>> embedding(torch.tensor([[1, 0]]), table, padding_idx=0).sum().backward()
        >>> table.grad.tolist()
        [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """
    check_tensor("embedding", "tokens", tokens)
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"embedding: tokens must be an integer tensor, got dtype {tokens.dtype}")
    _check_weight("embedding", "table", table, 2)
    vocab = table.shape[0]
    if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)
                                    or not 0 <= padding_idx < vocab):
        raise ValueError(f"embedding: padding_idx must be None or an int in [0, {vocab}), got {padding_idx!r}")
    if tokens.numel() and data_checks_enabled() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"embedding: token ids must lie in [0, {vocab}), got min {int(tokens.min())}, "
                         f"max {int(tokens.max())}")
    tp_dim = placement_of(table).dim_of("tp")
    group, n, r = tp_size_rank(table)
    sp = sp_group(table)[1] > 1
    if sp and (tokens.ndim < 1 or tokens.shape[-1] % n):
        raise ValueError(f"embedding: sequence parallelism splits the sequence over tp={n}, so tp must divide "
                         f"the sequence length, got tokens of shape {tuple(tokens.shape)}")
    tl = unshard(table, keep=("tp",))
    if tp_dim is None or n == 1:
        out = F.embedding(tokens, tl, padding_idx)
        return own_seq(out, group, n) if sp else out
    if tp_dim == 1:  # features split: local lookup, gather the features
        out = gather_slices(F.embedding(tokens, tl, padding_idx), group, dim=-1, sizes=chunk_sizes(table.shape[1], n))
        return own_seq(out, group, n) if sp else out
    first, rows = chunk_range(vocab, n, r)  # vocabulary-parallel: rows [first, first + rows) (torch.chunk)
    local = tokens - first
    outside = (local < 0) | (local >= rows)
    pad = None if padding_idx is None or not first <= padding_idx < first + rows else padding_idx - first
    out = F.embedding(local.masked_fill(outside, 0), tl, pad).masked_fill(outside.unsqueeze(-1), 0.0)
    return scatter_seq(out, group) if sp else all_reduce(out, group)
