"""The two built-ins that move no tokens: ``local`` and ``all_reduce`` (masking).

``local``: every expert is on this rank (one process, or ``ep == 1``): the dispatch passes the
tokens through with local expert ids, the combine is the identity. No communication.

``all_reduce`` (needs ``ep == tp``: the expert group shares one batch). Each rank runs its own
experts on every token routed to them (the other slots masked to ``-1``) and the combine sums the
partial outputs with an all-reduce; the inputs enter through ``grad_sum`` (tokens and weights as
one tensor, so one all-reduce of both gradients), so the gradients of the shared inputs are
summed over the group. No host sync is needed: the natural choice for inference.
"""

from __future__ import annotations

import torch

from ..collectives import all_reduce, grad_sum, group_size
from ..experts import LocalExperts
from .contract import Dispatch, ExpertParallel

__all__ = ["LOCAL", "ALL_REDUCE"]


def _local_dispatch(x, weights, expert_ids, experts: LocalExperts, mesh, stats=None) -> Dispatch:
    local = torch.where(expert_ids >= 0, expert_ids - experts.first, -1)     # inactive slots stay -1
    return Dispatch(x, weights, local, torch.tensor(0), num_slots=None)      # the experts count the active slots


def _identity_combine(out: torch.Tensor, d: Dispatch, mesh) -> torch.Tensor:
    return out


LOCAL = ExpertParallel(_local_dispatch, _identity_combine)


def _replicated_inputs(x: torch.Tensor, weights: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_sum`` of tokens and weights as one tensor: one all-reduce of both gradients."""
    if group_size(group) == 1:
        return x, weights.to(x.dtype)
    xw = grad_sum(torch.cat([x, weights.to(x.dtype)], dim=1), group)            # [T, D + K]
    return xw.split([x.shape[1], weights.shape[1]], dim=1)


def _masked_dispatch(x, weights, expert_ids, experts: LocalExperts, mesh, stats=None) -> Dispatch:
    x, weights = _replicated_inputs(x, weights, mesh.group("ep"))
    mine = (expert_ids >= experts.first) & (expert_ids < experts.first + experts.num_local)
    return Dispatch(x, weights, torch.where(mine, expert_ids - experts.first, -1), torch.tensor(0))


def _all_reduce_combine(out: torch.Tensor, d: Dispatch, mesh) -> torch.Tensor:
    return all_reduce(out, mesh.group("ep"))


ALL_REDUCE = ExpertParallel(_masked_dispatch, _all_reduce_combine)
