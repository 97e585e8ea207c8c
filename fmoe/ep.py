"""Expert parallelism: how routed tokens reach the experts and come back.

An *implementation* is a function with the contract::

    impl(x[T, D], weights[T, K], expert_ids[T, K], experts: LocalExperts, mesh) -> y[T, D]

``x`` are this rank's tokens, ``expert_ids`` global ids, ``weights`` their mixing weights and
``experts`` this rank's block of experts (``experts.range`` global ids,
``experts(rows, local_ids) -> outputs`` runs them). It returns the weighted sum of expert
outputs per token and must be differentiable w.r.t. ``x``, ``weights`` and the expert weights.
It may instead return ``(y, extra)``, a dict merged into the layer's aux.
Register one with :func:`register` and select it by name in ``fmoe.moe(..., impl=name)``.

Built in:

``all_to_all`` (token dispatch). With ``tp > 1`` the ranks of a TP group hold the same tokens,
so each dispatches a disjoint ``1/tp`` slice of the rows (uneven or empty slices are fine).
Every token of the slice goes **once to each rank** that owns at least one of its experts, as
one payload row ``[x (D) | K weights | K global expert ids]``, gathered once from a per-token
row (the ids ride bit-cast in the payload dtype, so one exchange carries all three; the expert
rank keeps the slots it owns, whose unused weights get a zero gradient). The expert rank
sorts the received (row, slot) assignments by expert once (the layer's only sort), runs its
experts with the routing weight folded into the hidden activation and sums per row, so the
combine returns **one already-weighted row per (token, rank)**; the source adds them up. Per
layer that is three collectives forward (split sizes, payload, combine; the split-size exchange
is the one host sync) and two backward. When the expert group holds the whole ``fsdp``
group (``efsdp == 1``) the layer's routing statistics ride in the split-size exchange
(:func:`folds_stats`), so they need no all-reduce. Both data exchanges are differentiable
all-to-alls, so gradients of the routing weights travel back to the token's rank. The TP
slices are reassembled with an all-gather whose backward keeps each rank's slice, and each rank
takes its slice of the inputs (tokens and weights, concatenated) with ``local_slice``, whose
backward all-gathers the slices' gradients, so every TP rank ends with the full-batch gradient
of ``x`` and the router. It also returns ``{"dispatch_rows": ...}`` (rows sent to other ranks)
for the layer's aux.

``all_reduce`` (masking; needs ``ep == tp``, i.e. the expert group shares one batch). Each rank
runs its own experts on every token routed to them and the partial outputs are summed with an
all-reduce; gradients of the shared inputs are summed over the group. No tokens move and no host
sync is needed for the exchange.

Gradient semantics after each rank calls ``backward()`` on a loss of its own output: ``x`` and
the router get the gradient of the rank's own batch (TP ranks share a batch and all get the
full-batch gradient); each local expert gets the sum over the distinct batches of its EP group
(``ep / tp`` batches) of that batch's gradient, every token counted once.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .collectives import all_reduce, all_to_all, all_to_all_rows, grad_sum, gather_slices, group_size, local_slice
from .expert_blocks import weighted_expert_sum
from .experts import Activation, check_matmul, expert_mlp, swiglu
from .grouped_mm import expert_mlp_offs, offsets
from .transforms import active as transforms_active
from .transforms import vmapping

__all__ = ["LocalExperts", "BLOCKED_MIN_ROWS", "register", "get", "registered", "local", "all_to_all_impl",
           "folds_stats", "all_reduce_impl", "sorted_by_expert", "pack_ids", "unpack_ids"]


BLOCKED_MIN_ROWS = 256   # mean rows per local expert from which "auto" takes the blocked CPU path


class LocalExperts:
    """This rank's block of experts, callable on rows.

    Args:
        weights: dict with local ``w_gate_up [El, 2I, D]``, ``w_down [El, D, I]`` and optional
            ``b_gate_up``, ``b_down``.
        first: global id of the first local expert.
        num_experts: E, the global number of experts.
        act: activation ``act(gate, up)``.
        matmul: ``"auto"``, ``"grouped"`` or ``"loop"`` (see :mod:`fmoe.experts`).
    """

    def __init__(self, weights: dict, first: int, num_experts: int, act: Activation = swiglu,
                 matmul: str = "auto"):
        check_matmul("LocalExperts", "matmul", matmul)
        self.weights, self.first, self.num_experts = weights, first, num_experts
        self.num_local = weights["w_gate_up"].shape[0]
        self.range = range(first, first + self.num_local)
        self.act, self.matmul = act, matmul

    def __call__(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Outputs ``[N, D]`` (unweighted) of expert ``local_ids[n]`` on ``rows[n]``."""
        order, counts = sorted_by_expert(local_ids, self.num_local)
        out = self.run_sorted(rows.index_select(0, order), counts)
        return torch.empty_like(out).index_copy(0, order, out)

    def blocked(self, rows: torch.Tensor, num_assignments: int) -> bool:
        """Whether :meth:`weighted_sum` runs :func:`fmoe.expert_blocks.weighted_expert_sum`:
        plain SwiGLU experts without biases on CPU, with ``matmul="loop"``, or ``"auto"`` and
        at least ``BLOCKED_MIN_ROWS`` assignments per local expert on average (below that the
        whole-tensor grouped GEMMs cost less than a Python loop over experts)."""
        plain = (self.act is swiglu and rows.device.type == "cpu"
                 and "b_gate_up" not in self.weights and "b_down" not in self.weights)
        return plain and (self.matmul == "loop" or
                          (self.matmul == "auto" and num_assignments >= BLOCKED_MIN_ROWS * self.num_local))

    def weighted_sum(self, rows: torch.Tensor, row_of: torch.Tensor, counts: list[int],
                     scale: torch.Tensor) -> torch.Tensor:
        """``out[n] = sum of scale[a] * expert(rows[n])`` over the assignments ``a`` of row ``n``
        (``row_of [A]`` sorted by local expert, ``counts[e]`` each); ``[N, D]``."""
        w = self.weights
        if self.blocked(rows, row_of.shape[0]):
            return weighted_expert_sum(rows, row_of, counts, w["w_gate_up"], w["w_down"], scale=scale)
        out = self.run_sorted(rows.index_select(0, row_of), counts, scale=scale)   # [A, D], weighted
        return out.new_zeros(rows.shape[0], out.shape[-1]).index_add(0, row_of, out)

    def run_sorted(self, rows: torch.Tensor, counts: list[int], scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Outputs (times ``scale [N]`` if given) for rows already grouped by local expert
        (``counts[e]`` rows each)."""
        w = self.weights
        return expert_mlp(rows, counts, w["w_gate_up"], w["w_down"], w.get("b_gate_up"),
                          w.get("b_down"), act=self.act, impl=self.matmul, scale=scale)


def sorted_by_expert(local_ids: torch.Tensor, num_local: int) -> tuple[torch.Tensor, list[int]]:
    """Stable order grouping ``local_ids`` by expert, and the count per expert (one host sync)."""
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=num_local).tolist()
    return order, counts


def _weighted_sum_per_row(rows, slot_w, slot_ids, experts: LocalExperts,
                          num_used: Optional[int] = None) -> torch.Tensor:
    """``out[n] = sum_k slot_w[n, k] * expert(slot_ids[n, k])(rows[n])`` over slots with id >= 0.

    One stable sort of the ``[N * K]`` slots (unused slots keyed last), then the experts with the
    weights folded in over the gathered rows, added back per row (:meth:`LocalExperts.weighted_sum`).
    ``num_used``: the number of slots with id >= 0 when the caller knows it on the host.
    """
    if transforms_active():                # torch.func / torch.compile: the grouped ops (fmoe.transforms)
        return _weighted_sum_traced(rows, slot_w, slot_ids, experts, num_used)
    k = slot_ids.shape[1]
    e = experts.num_local
    flat = slot_ids.reshape(-1)
    keyed = torch.where(flat >= 0, flat, e)                                     # [N*K], unused -> e
    order = torch.argsort(keyed, stable=True)
    counts = torch.bincount(keyed, minlength=e + 1).tolist()[:e]               # one host sync
    order = order[:sum(counts)]                                                 # assignments A
    row_of = torch.div(order, k, rounding_mode="floor")
    w = slot_w.reshape(-1).index_select(0, order).to(rows.dtype)               # [A]
    return experts.weighted_sum(rows, row_of, counts, w)                        # [N, D]


def _weighted_sum_traced(rows, slot_w, slot_ids, experts: LocalExperts, num_used: Optional[int]) -> torch.Tensor:
    """:func:`_weighted_sum_per_row` with the group sizes kept on the device (offsets for
    :func:`fmoe.grouped_mm.expert_mlp_offs`): no host sync when ``num_used`` is given (the
    dispatch learns it in its split-size exchange; every slot in one process). Otherwise one
    ``int()`` (the ``all_reduce`` dispatch under compile), or under ``vmap``, where no host value
    exists, unused slots ride along on local expert 0 with weight 0 (adding nothing)."""
    k, e = slot_ids.shape[1], experts.num_local
    flat = slot_ids.reshape(-1)                                                 # [N*K]
    used = flat >= 0
    if num_used is None and vmapping():
        keyed, num_used = torch.where(used, flat, 0), flat.shape[0]
    else:
        keyed = torch.where(used, flat, e)                                      # unused slots sorted last, cut
        num_used = int(used.sum()) if num_used is None else num_used
    order = torch.argsort(keyed, stable=True)[:num_used]                       # [A]
    ones = torch.ones_like(keyed)
    counts = torch.zeros(e + 1, dtype=torch.int64, device=flat.device).scatter_add(0, keyed, ones)[:e]
    row_of = torch.div(order, k, rounding_mode="floor")
    w = torch.where(used, slot_w.reshape(-1), 0).index_select(0, order).to(rows.dtype)   # [A]
    ew = experts.weights
    out = expert_mlp_offs(rows.index_select(0, row_of), offsets(counts), ew["w_gate_up"], ew["w_down"],
                          ew.get("b_gate_up"), ew.get("b_down"), act=None if experts.act is swiglu else experts.act,
                          scale=w, impl="loop" if experts.matmul == "loop" else "auto")
    return out.new_zeros(rows.shape[0], out.shape[-1]).index_add(0, row_of, out)


def local(x, weights, expert_ids, experts: LocalExperts, mesh) -> torch.Tensor:
    """All experts on this rank: no communication (single process, or ep == 1)."""
    return _weighted_sum_per_row(x, weights, expert_ids - experts.first, experts, num_used=expert_ids.numel())


def _replicated_inputs(x: torch.Tensor, weights: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_sum`` of tokens and weights as one tensor: one all-reduce of both gradients."""
    if group_size(group) == 1:
        return x, weights.to(x.dtype)
    xw = grad_sum(torch.cat([x, weights.to(x.dtype)], dim=1), group)            # [T, D + K]
    return xw.split([x.shape[1], weights.shape[1]], dim=1)


def all_reduce_impl(x, weights, expert_ids, experts: LocalExperts, mesh) -> torch.Tensor:
    """Masking + all-reduce over the expert group (requires ep == tp)."""
    group = mesh.group("ep")
    x, weights = _replicated_inputs(x, weights, group)
    mine = (expert_ids >= experts.first) & (expert_ids < experts.first + experts.num_local)
    slot_ids = torch.where(mine, expert_ids - experts.first, -1)
    return all_reduce(_weighted_sum_per_row(x, weights, slot_ids, experts), group)


def tp_slice_bounds(num_tokens: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` that TP rank ``rank`` dispatches (``tensor_split`` sizes)."""
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
    """Whether :func:`all_to_all_impl` can sum the layer's routing statistics in its split-size
    exchange: with ``efsdp == 1`` the expert group holds every rank of this rank's ``fsdp``
    group (each batch once per tp rank), so the statistics' sum over batches is the sum of the
    rows received from those ranks."""
    return mesh is not None and mesh.efsdp == 1 and mesh.ep > 1


def _exchange_splits(sizes: torch.Tensor, stats: Optional[torch.Tensor], group, mesh):
    """Exchange ``sizes [ep, 2]`` (rows and routing slots this rank sends to each rank) and
    bring to the host, in the layer's one sync: rows received from each rank, rows sent to each
    rank, and the total slots received (the expert assignments this rank computes). With
    ``stats`` (fp64 ``[S]``, differentiable) also their sum over this rank's ``fsdp`` group in
    the same exchange: the value every rank of the group computes identically (same rows, same
    order), the gradient passed straight to this rank's own stats (``all_reduce``'s backward)."""
    n = sizes.shape[0]
    if stats is None:
        recv = all_to_all_rows(sizes, group)
        total = None
    else:
        send = torch.cat([sizes.to(torch.float64), stats.detach().expand(n, -1)], dim=1)   # [ep, 2+S]
        recv = all_to_all_rows(send, group)
        batch_peers = set(mesh.ranks("fsdp"))                      # one rank per batch, my tp index
        rows = [j for j, r in enumerate(mesh.ranks("ep")) if r in batch_peers]
        total = recv[rows, 2:].sum(0) + (stats - stats.detach())   # ep-group order: the same bits everywhere
    host = torch.cat([recv[:, :2].long().reshape(-1), sizes[:, 0]]).tolist()       # the host sync
    return host[0:2 * n:2], host[2 * n:], sum(host[1:2 * n:2]), total


def all_to_all_impl(x, weights, expert_ids, experts: LocalExperts, mesh, stats: Optional[torch.Tensor] = None):
    """Token dispatch: once per (token, expert rank), weighted combine on the expert rank.

    ``stats`` (optional, see :func:`folds_stats`): the layer's packed routing statistics, summed
    over the expert group inside the split-size exchange and returned as
    ``extra["stats_over_ep"]`` (one collective fewer per layer)."""
    T, D = x.shape
    ep_group, tp_group = mesh.group("ep"), mesh.group("tp")
    ep, tp, me = mesh.ep, mesh.tp, mesh.rank_in("ep")
    e_local = experts.num_local
    # ---- this TP rank's disjoint slice of the rows
    sizes = [b - a for a, b in (tp_slice_bounds(T, tp, r) for r in range(tp))]
    start, stop = tp_slice_bounds(T, tp, mesh.rank_in("tp"))
    ids = expert_ids[start:stop]                                                # [Ts, K]
    Ts, K = ids.shape
    # ---- one row per token [x | K weights | K global ids], this TP rank's slice of them
    if tp > 1:  # own slice; backward all-gathers the slices' gradients (half grad_sum's bytes)
        xw = local_slice(torch.cat([x, weights.to(x.dtype)], dim=1), tp_group, sizes)
        tok = torch.cat([xw, pack_ids(ids, x.dtype)], dim=1)                    # [Ts, D+2K]
    else:
        tok = torch.cat([x, weights.to(x.dtype), pack_ids(ids, x.dtype)], dim=1)
    # ---- (token, destination rank) pairs, once per rank, grouped by rank (no sort): one gather
    dest = torch.div(ids, e_local, rounding_mode="floor")                       # [Ts, K]
    need = torch.zeros(Ts, ep, dtype=torch.bool, device=x.device).scatter_(1, dest, True)
    flat = dest.reshape(-1)
    slots = torch.zeros(ep, dtype=torch.int64, device=x.device).scatter_add(0, flat, torch.ones_like(flat))
    counts = torch.stack([need.sum(0), slots], dim=1)                           # [ep, 2]: rows, slots to each rank
    # ---- split sizes (the layer's one host sync; routing statistics ride along)
    out_s, in_s, num_used, stats_sum = _exchange_splits(counts, stats, ep_group, mesh)
    pair_rank, pair_tok = torch.nonzero_static(need.t(), size=sum(in_s)).unbind(1)   # Pn pairs, grouped by rank
    payload = tok.index_select(0, pair_tok)                                     # [Pn, D+2K]
    # ---- one exchange of rows + weights + ids
    recv = all_to_all(payload, out_s, in_s, ep_group)                           # [Nr, D + 2K]
    rows, recv_w, recv_bits = recv.split([D, K, K], dim=1)                      # backward: one cat
    gids = unpack_ids(recv_bits)                                                # [Nr, K] global ids
    recv_ids = torch.where(torch.div(gids, e_local, rounding_mode="floor") == me, gids - me * e_local, -1)
    # ---- experts: one weighted row per received (token, rank)
    combined = _weighted_sum_per_row(rows, recv_w, recv_ids, experts, num_used)  # [Nr, D]
    back = all_to_all(combined, in_s, out_s, ep_group)                          # [Pn, D]
    ys = back.new_zeros(Ts, D).index_add(0, pair_tok, back)
    # ---- reassemble the TP slices (each rank keeps its own slice's gradient)
    y = gather_slices(ys, tp_group, dim=0, sizes=sizes)
    extra = {"dispatch_rows": torch.tensor(sum(in_s) - in_s[me])}
    if stats_sum is not None:
        extra["stats_over_ep"] = stats_sum
    return y, extra


_REGISTRY: dict[str, Callable] = {}


def register(name: str, fn: Callable) -> Callable:
    """Make ``fn`` selectable as ``fmoe.moe(..., impl=name)`` (see the module docstring for
    the contract). Returns ``fn``; usable as a decorator via ``functools.partial``.

    Example:
        >>> register("my_local", local) is local
        True
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"ep.register: name must be a non-empty string other than 'auto', got {name!r}")
    if not callable(fn):
        raise TypeError(f"ep.register: fn must be callable, got {type(fn).__name__}")
    _REGISTRY[name] = fn
    return fn


def registered() -> list[str]:
    """Names usable as ``impl`` (plus ``"auto"``)."""
    return sorted(_REGISTRY)


def get(name: str) -> Callable:
    """The implementation registered as ``name``; ``ValueError`` listing the known names."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown MoE impl {name!r}; registered: {['auto'] + registered()}")
    return _REGISTRY[name]


register("all_to_all", all_to_all_impl)
register("all_reduce", all_reduce_impl)
register("local", local)
