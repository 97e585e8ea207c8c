"""The ``all_to_all`` built-in: token dispatch once per (token, expert rank), weighted combine.

With ``tp > 1`` the ranks of a TP group hold the same tokens, so each dispatches a disjoint
``1/tp`` slice of the rows (uneven or empty slices are fine). Every token of the slice goes
**once to each rank** that owns at least one of its experts, as one payload row
``[x (D) | K weights | K global expert ids]``, gathered once from a per-token row (the ids ride
bit-cast in the payload dtype, :func:`pack_ids`, so one exchange carries all three; the expert
rank keeps the slots it owns, whose unused weights get a zero gradient). An inactive slot (expert
id ``-1``, :data:`fmoe.routing.core.INACTIVE`) sends nothing and counts no slot: a token whose
slots are all inactive is not sent at all. The expert rank sorts
the received (row, slot) assignments by expert once (the layer's only sort), runs its experts
with the routing weight folded into the hidden activation and sums per row, so the combine
returns **one already-weighted row per (token, rank)**; the source adds them up.

Per layer: three collectives forward (split sizes, payload, combine; the split-size exchange is
the one host sync) and two backward. With ``efsdp == 1`` the expert group holds the whole
``fsdp`` group, so the layer's routing statistics ride in the split-size exchange
(:func:`folds_stats`) and need no all-reduce. Both data exchanges are differentiable
all-to-alls, so gradients of the routing weights travel back to the token's rank. The TP slices
are cut with ``local_slice`` (backward all-gathers the slices' gradients, half the bytes of a
``grad_sum``) and reassembled with ``gather_slices`` (backward keeps each rank's slice), so every
TP rank ends with the full-batch gradient of ``x`` and the router. With sequence parallelism
(``mesh.sp``) each tp rank's tokens are its own piece of the sequence already: no slice, no
gather, and the folded statistics sum over the whole expert group.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..experts import fake_splits
from ..collectives import all_to_all, all_to_all_rows, gather_slices, local_slice
from ..experts import LocalExperts
from ..transforms import vmapping
from .contract import Dispatch, ExpertParallel

__all__ = ["ALL_TO_ALL", "folds_stats", "tp_slice_bounds", "pack_ids", "unpack_ids"]


def tp_slice_bounds(num_tokens: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` that TP rank ``rank`` dispatches (``tensor_split`` sizes).

    Example:
        >>> [tp_slice_bounds(5, 2, r) for r in range(2)]
        [(0, 3), (3, 5)]
    """
    base, extra = divmod(num_tokens, tp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}   # integer type of each element size


def pack_ids(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Integer ids (``-1`` allowed, ``|id| < 2**15`` for 2-byte dtypes) bit-cast to ``dtype`` so
    they travel in the same all-to-all as the rows; :func:`unpack_ids` inverts it exactly.

    Example:
        >>> unpack_ids(pack_ids(torch.tensor([[3, -1]]), torch.bfloat16)).tolist()
        [[3, -1]]
    """
    return ids.to(_BITS[torch.empty((), dtype=dtype).element_size()]).view(dtype)


def unpack_ids(bits: torch.Tensor) -> torch.Tensor:
    """The int64 ids packed by :func:`pack_ids` (no gradient)."""
    return bits.detach().contiguous().view(_BITS[bits.element_size()]).long()


def folds_stats(mesh) -> bool:
    """Whether the dispatch sums the layer's routing statistics in its split-size exchange: with
    ``efsdp == 1`` the expert group holds every rank of this rank's ``fsdp`` group (each batch
    once per tp rank), so the statistics' sum over batches is the sum of the rows received from
    those ranks."""
    return mesh is not None and mesh.efsdp == 1 and mesh.ep > 1


def _exchange_splits(sizes: torch.Tensor, stats: Optional[torch.Tensor], group, mesh, spread=None):
    """Exchange ``sizes [ep, 2]`` (rows and routing slots this rank sends to each rank) and
    bring to the host, in the layer's one sync: rows received from each rank, rows sent to each
    rank, and the total slots received (the expert assignments this rank computes). With
    ``stats`` (fp64 ``[S]``, differentiable) also their sum over this rank's ``fsdp`` group in
    the same exchange: the value every rank of the group computes identically (same rows, same
    order), the gradient passed straight to this rank's own stats (``all_reduce``'s backward).
    On fake tensors (the dry run) the sizes follow :mod:`fmoe.experts.fake_splits` for ``spread =
    (tokens per TP slice, K)``."""
    n = sizes.shape[0]
    if stats is None:
        recv = all_to_all_rows(sizes, group)
        total = None
    else:
        send = torch.cat([sizes.to(torch.float64), stats.detach().expand(n, -1)], dim=1)   # [ep, 2+S]
        recv = all_to_all_rows(send, group)
        batch_peers = set(mesh.ranks("ep" if mesh.sp else "fsdp"))  # one rank per batch, my tp index (sp: all)
        rows = [j for j, r in enumerate(mesh.ranks("ep")) if r in batch_peers]
        total = recv[rows, 2:].sum(0) + (stats - stats.detach())   # ep-group order: the same bits everywhere
    if fake_splits.is_fake(recv):                                  # dry run: no values, the spread rule
        return (*_spread_splits(mesh, spread), total)
    host = torch.cat([recv[:, :2].long().reshape(-1), sizes[:, 0]]).tolist()       # the host sync
    return host[0:2 * n:2], host[2 * n:], sum(host[1:2 * n:2]), total


def _spread_splits(mesh, spread: tuple[list, int]) -> tuple[list, list, int]:
    """The split sizes of :func:`_exchange_splits` on fake tensors (:mod:`fmoe.experts.fake_splits`):
    rows received from / sent to each expert rank and the slots received, for TP slices of
    ``spread[0]`` tokens and top-``spread[1]`` routing."""
    slices, k = spread
    me, mine = mesh.rank_in("ep"), slices[mesh.rank_in("tp") % len(slices)]
    out_s, slots = fake_splits.received([slices[r % len(slices)] for r in range(mesh.ep)], k=k, me=me)
    return out_s, [fake_splits.spread_rows(mine, k=k, ep=mesh.ep, dst=d) for d in range(mesh.ep)], slots


class _Sent(NamedTuple):
    """What the combine needs to bring the rows back (``Dispatch.state``)."""

    out_s: list             # rows received from each rank (the combine sends these back)
    in_s: list              # rows sent to each rank
    pair_tok: torch.Tensor  # [Pn] the token of each sent row
    Ts: int                 # tokens in this TP rank's slice
    sizes: list             # slice length per TP rank


def _token_dispatch(x, weights, expert_ids, experts: LocalExperts, mesh, stats=None) -> Dispatch:
    """This TP rank's slice of the tokens, once per (token, expert rank), with weights and ids."""
    T, D = x.shape
    ep_group, tp_group = mesh.group("ep"), mesh.group("tp")
    ep, tp, me = mesh.ep, 1 if mesh.sp else mesh.tp, mesh.rank_in("ep")   # sp: the tokens are this rank's own
    if ep > 1 and vmapping():       # every rank of the mesh is vmapping alike: all raise, none waits
        raise NotImplementedError(
            f"torch.func.vmap over fmoe.moe with expert parallelism (ep={ep}, impl 'all_to_all') is not "
            "supported: the dispatch exchanges per-example split sizes on the host, which a vmapped "
            "batch does not have. Instead fold the vmapped dim into the tokens (x of shape [B*T, D]), "
            "loop over the examples in Python, or run with ep=1 (tp-only meshes vmap)")
    e_local = experts.num_local
    # ---- this TP rank's disjoint slice of the rows
    sizes = [b - a for a, b in (tp_slice_bounds(T, tp, r) for r in range(tp))]
    start, stop = tp_slice_bounds(T, tp, mesh.rank_in("tp") % tp)
    ids = expert_ids[start:stop]                                                # [Ts, K]
    Ts, K = ids.shape
    # ---- one row per token [x | K weights | K global ids], this TP rank's slice of them
    if tp > 1:  # own slice; backward all-gathers the slices' gradients (half grad_sum's bytes)
        xw = local_slice(torch.cat([x, weights.to(x.dtype)], dim=1), tp_group, sizes)
        tok = torch.cat([xw, pack_ids(ids, x.dtype)], dim=1)                    # [Ts, D+2K]
    else:
        tok = torch.cat([x, weights.to(x.dtype), pack_ids(ids, x.dtype)], dim=1)
    # ---- (token, destination rank) pairs, once per rank, grouped by rank (no sort): one gather;
    # an inactive slot (id -1) needs no rank and counts no slot
    on = (ids >= 0).long()                                                      # [Ts, K]
    dest = torch.div(ids.clamp(min=0), e_local, rounding_mode="floor")          # [Ts, K]
    need = torch.zeros(Ts, ep, dtype=torch.int64, device=x.device).scatter_add(1, dest, on) > 0   # out of place: vmap
    slots = torch.zeros(ep, dtype=torch.int64, device=x.device).scatter_add(0, dest.reshape(-1), on.reshape(-1))
    counts = torch.stack([need.sum(0), slots], dim=1)                           # [ep, 2]: rows, slots to each rank
    # ---- split sizes (the layer's one host sync; routing statistics ride along)
    out_s, in_s, num_used, stats_sum = _exchange_splits(counts, stats, ep_group, mesh, (sizes, K))
    pair_rank, pair_tok = torch.nonzero_static(need.t(), size=sum(in_s)).unbind(1)   # Pn pairs, grouped by rank
    payload = tok.index_select(0, pair_tok)                                     # [Pn, D+2K]
    # ---- one exchange of rows + weights + ids
    recv = all_to_all(payload, out_s, in_s, ep_group)                           # [Nr, D + 2K]
    rows, recv_w, recv_bits = recv.split([D, K, K], dim=1)                      # backward: one cat
    gids = unpack_ids(recv_bits)                                                # [Nr, K] global ids
    recv_ids = torch.where(torch.div(gids, e_local, rounding_mode="floor") == me, gids - me * e_local, -1)
    return Dispatch(rows, recv_w, recv_ids, torch.tensor(sum(in_s) - in_s[me]), stats_sum, num_used,
                    _Sent(out_s, in_s, pair_tok, Ts, sizes))


def _token_combine(combined: torch.Tensor, d: Dispatch, mesh) -> torch.Tensor:
    """One weighted row per (token, rank) back to its token, summed; TP slices reassembled."""
    st = d.state
    back = all_to_all(combined, st.in_s, st.out_s, mesh.group("ep"))            # [Pn, D]
    ys = back.new_zeros(st.Ts, combined.shape[1]).index_add(0, st.pair_tok, back)
    if len(st.sizes) == 1:                                                       # sp: no tp slices
        return ys
    return gather_slices(ys, mesh.group("tp"), dim=0, sizes=st.sizes)          # each rank keeps its slice's grad


ALL_TO_ALL = ExpertParallel(_token_dispatch, _token_combine, folds_stats)
