"""Expert parallelism: how routed tokens reach the experts and come back.

An *implementation* is a function with the contract::

    impl(x[T, D], weights[T, K], expert_ids[T, K], experts: LocalExperts, mesh) -> y[T, D]

``x`` are this rank's tokens, ``expert_ids`` global ids, ``weights`` their mixing weights and
``experts`` this rank's block of experts (``experts.range`` global ids,
``experts(rows, local_ids) -> outputs`` runs them). It returns the weighted sum of expert
outputs per token and must be differentiable w.r.t. ``x``, ``weights`` and the expert weights.
Register one with :func:`register` and select it by name in ``fmoe.moe(..., impl=name)``.

Built in:

``all_to_all`` (token dispatch). With ``tp > 1`` the ranks of a TP group hold the same tokens,
so each dispatches a disjoint ``1/tp`` slice of the rows (uneven or empty slices are fine).
Every token of the slice goes **once to each rank** that owns at least one of its experts,
carrying its ``K`` weights (zeroed for slots owned elsewhere) and local expert ids. The expert
rank runs its experts on the received rows (one sort by expert), applies the weights and sums
per row, so the combine returns **one already-weighted row per (token, rank)**; the source adds
them up. Both exchanges are differentiable all-to-alls, so gradients of the routing weights
travel back to the token's rank. The TP slices are reassembled with an all-gather whose
backward keeps each rank's slice, and the inputs (tokens and weights) enter through
``copy_to`` over tp, so every TP rank ends with the full-batch gradient of ``x`` and the router.

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

from typing import Callable

import torch

from .collectives import all_reduce, all_to_all, copy_to, gather_replicated
from .experts import Activation, expert_mlp, swiglu

__all__ = ["LocalExperts", "register", "get", "registered", "local", "all_to_all_impl",
           "all_reduce_impl", "sorted_by_expert"]


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
        self.weights, self.first, self.num_experts = weights, first, num_experts
        self.num_local = weights["w_gate_up"].shape[0]
        self.range = range(first, first + self.num_local)
        self.act, self.matmul = act, matmul

    def __call__(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Outputs ``[N, D]`` (unweighted) of expert ``local_ids[n]`` on ``rows[n]``."""
        order, counts = sorted_by_expert(local_ids, self.num_local)
        out = self.run_sorted(rows.index_select(0, order), counts)
        return torch.empty_like(out).index_copy(0, order, out)

    def run_sorted(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Outputs for rows already grouped by local expert (``counts[e]`` rows each)."""
        w = self.weights
        return expert_mlp(rows, counts, w["w_gate_up"], w["w_down"], w.get("b_gate_up"),
                          w.get("b_down"), act=self.act, impl=self.matmul)


def sorted_by_expert(local_ids: torch.Tensor, num_local: int) -> tuple[torch.Tensor, list[int]]:
    """Stable order grouping ``local_ids`` by expert, and the count per expert (one host sync)."""
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=num_local).tolist()
    return order, counts


def _weighted_sum_per_row(rows, slot_w, slot_ids, experts: LocalExperts) -> torch.Tensor:
    """``out[n] = sum_k slot_w[n, k] * expert(slot_ids[n, k])(rows[n])`` over slots with id >= 0."""
    n, k = slot_ids.shape
    row_of, slot = torch.nonzero(slot_ids >= 0, as_tuple=True)                  # assignments A
    local_ids = slot_ids[row_of, slot]
    order, counts = sorted_by_expert(local_ids, experts.num_local)              # one sort
    row_of, slot = row_of.index_select(0, order), slot.index_select(0, order)
    out = experts.run_sorted(rows.index_select(0, row_of), counts)             # [A, D]
    w = slot_w[row_of, slot].unsqueeze(-1).to(out.dtype)                        # [A, 1]
    return torch.zeros(n, out.shape[-1], dtype=out.dtype, device=out.device).index_add(0, row_of, out * w)


def local(x, weights, expert_ids, experts: LocalExperts, mesh) -> torch.Tensor:
    """All experts on this rank: no communication (single process, or ep == 1)."""
    return _weighted_sum_per_row(x, weights, expert_ids - experts.first, experts)


def all_reduce_impl(x, weights, expert_ids, experts: LocalExperts, mesh) -> torch.Tensor:
    """Masking + all-reduce over the expert group (requires ep == tp)."""
    group = mesh.group("ep")
    x, weights = copy_to(x, group), copy_to(weights, group)
    mine = (expert_ids >= experts.first) & (expert_ids < experts.first + experts.num_local)
    slot_ids = torch.where(mine, expert_ids - experts.first, -1)
    return all_reduce(_weighted_sum_per_row(x, weights, slot_ids, experts), group)


def tp_slice_bounds(num_tokens: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` that TP rank ``rank`` dispatches (``tensor_split`` sizes)."""
    base, extra = divmod(num_tokens, tp)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def all_to_all_impl(x, weights, expert_ids, experts: LocalExperts, mesh) -> torch.Tensor:
    """Token dispatch: once per (token, expert rank), weighted combine on the expert rank."""
    T, D = x.shape
    ep_group, tp_group = mesh.group("ep"), mesh.group("tp")
    ep, tp = mesh.ep, mesh.tp
    e_local = experts.num_local
    # ---- this TP rank's disjoint slice of the rows
    start, stop = tp_slice_bounds(T, tp, mesh.rank_in("tp"))
    xs = copy_to(x, tp_group)[start:stop]                                       # [Ts, D]
    ws = copy_to(weights, tp_group)[start:stop].to(x.dtype)                     # [Ts, K]
    ids = expert_ids[start:stop]                                                # [Ts, K]
    Ts, K = ids.shape
    # ---- (token, destination rank) pairs, once per rank, sorted by rank
    dest = ids // e_local                                                       # [Ts, K]
    need = torch.zeros(Ts, ep, dtype=torch.bool, device=x.device)
    need[torch.arange(Ts, device=x.device).unsqueeze(1).expand(Ts, K), dest] = True
    pair_rank, pair_tok = torch.nonzero(need.t(), as_tuple=True)                # sorted by rank
    on_rank = dest[pair_tok] == pair_rank.unsqueeze(1)                          # [Pn, K]
    send_ids = torch.where(on_rank, ids[pair_tok] - pair_rank.unsqueeze(1) * e_local, -1)
    send_w = torch.where(on_rank, ws.index_select(0, pair_tok), 0)              # [Pn, K]
    payload = torch.cat([xs.index_select(0, pair_tok), send_w], dim=1)          # [Pn, D + K]
    in_splits = torch.bincount(pair_rank, minlength=ep)
    # ---- exchange split sizes (host sync), then rows + weights, then local expert ids
    out_splits = torch.empty_like(in_splits)
    torch.distributed.all_to_all_single(out_splits, in_splits, group=ep_group)
    in_s, out_s = in_splits.tolist(), out_splits.tolist()
    recv = all_to_all(payload, out_s, in_s, ep_group)                           # [Nr, D + K]
    recv_ids = all_to_all(send_ids, out_s, in_s, ep_group)                      # [Nr, K]
    rows, recv_w = recv.split([D, K], dim=1)
    # ---- experts: one weighted row per received (token, rank)
    combined = _weighted_sum_per_row(rows, recv_w, recv_ids, experts)           # [Nr, D]
    back = all_to_all(combined, in_s, out_s, ep_group)                          # [Pn, D]
    ys = torch.zeros(Ts, D, dtype=back.dtype, device=x.device).index_add(0, pair_tok, back)
    # ---- reassemble the TP slices (each rank keeps its own slice's gradient)
    sizes = [b - a for a, b in (tp_slice_bounds(T, tp, r) for r in range(tp))]
    return gather_replicated(ys, tp_group, dim=0, sizes=sizes)


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
