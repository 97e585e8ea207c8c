"""Differentiable collectives: ``torch.autograd.Function``s over torch.distributed.

Each function is a new-style autograd Function (``forward`` + ``setup_context``), so it works
under ``torch.autograd`` and ``torch.func.grad`` alike. Every collective is linear, so its
``jvp`` is the same exchange applied to the tangent; its vmap rule moves the batch dim out of
the way of the exchanged dim (next to the rows for ``all_to_all``, first otherwise) and runs
the collective once for the whole batch. Every one takes a process group and is a
no-op when the group is None or has one rank (single process).

=================  =========================  ==========================================
function           forward                    backward
=================  =========================  ==========================================
all_to_all         rows to ranks by splits    the reverse exchange
all_reduce         sum over the group         identity (grads of a replicated output)
grad_sum           identity                   sum over the group
all_gather         concat slices (uneven ok)  reduce-scatter: sum, keep own slice
gather_slices      concat slices (uneven ok)  keep own slice (output used identically)
reduce_scatter     sum, keep own slice        all-gather
local_slice        keep own slice             all-gather of the slices' gradients
gathered_linear    all-gather, then a linear  dx reduce-scattered; x gathered again for dw
send_forward       send to the next stage     receive the gradient from it
recv_forward       receive from the previous  send the gradient to it
=================  =========================  ==========================================

``send_forward`` / ``recv_forward`` (:mod:`~fmoe.collectives.p2p`) are the pipeline stages'
point-to-point pair; a :class:`~fmoe.collectives.p2p.Pipe` holds a step's pending sends.

Not differentiable (bookkeeping and buffers that autograd never sees): ``all_gather_rows``,
``reduce_scatter_rows``, ``all_to_all_rows`` (one equal row per rank, e.g. split sizes),
``all_gather_sizes``, ``all_reduce_coalesced``, ``broadcast_from``, and the world-level
``sum_over_world``, ``barrier``, ``broadcast_object`` and ``all_gather_objects``.

``with counting() as sent:`` measures the bytes this rank's collectives send inside the block, by
kind (:mod:`~fmoe.collectives.counting`); the job logs them per step as ``sent_bytes``.

This package (:mod:`~fmoe.collectives.exchange`, :mod:`~fmoe.collectives.slices` and
:mod:`~fmoe.collectives.p2p`: the differentiable ones; :mod:`~fmoe.collectives.buffers`: the rest) is the only place that calls ``torch.distributed`` collectives
(``tests/unit/test_architecture.py`` checks it); process-group bookkeeping (``get_rank``,
``get_world_size``, ``new_group``) may live elsewhere.

``all_gather`` is the exact adjoint for a gathered tensor that each rank uses in a *different*
loss; ``gather_slices`` is for the usual tensor-parallel case where every rank of the group
computes the *same* loss on the replicated result (summing would multiply gradients by the
group size). ``local_slice`` is for a replicated input of which each rank of the group processes
a disjoint slice (token dispatch with ``tp > 1``): its gradient lives on the slice only, so
gathering the slices gives every rank the full gradient at half the bytes of ``grad_sum``'s
all-reduce.
"""

from .buffers import (all_gather_objects, all_gather_rows, all_gather_sizes, all_reduce_coalesced, all_to_all_rows,
                      barrier, broadcast_from, broadcast_object, group_size, reduce_scatter_rows, sum_over_world)
from .counting import SentBytes, counting
from .exchange import all_reduce, all_to_all, grad_sum
from .p2p import Pipe, recv_forward, send_forward
from .slices import all_gather, gather_slices, gathered_linear, local_slice, reduce_scatter

__all__ = ["all_to_all", "all_reduce", "grad_sum", "all_gather", "gather_slices",
           "reduce_scatter", "local_slice", "gathered_linear", "group_size", "all_gather_sizes", "all_reduce_coalesced",
           "all_gather_rows", "reduce_scatter_rows", "all_to_all_rows", "sum_over_world", "barrier",
           "broadcast_object", "broadcast_from", "all_gather_objects", "counting", "SentBytes",
           "Pipe", "send_forward", "recv_forward"]
