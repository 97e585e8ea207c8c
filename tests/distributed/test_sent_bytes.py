"""Bytes sent, measured by the collectives (fmoe.collectives.counting): on gloo ranks each kind
counts what this rank sends to the others (an all-to-all's own rows stay), backward exchanges
count inside the same block, nothing is counted outside a block."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import on_ranks

from fmoe import collectives as C


def _measure(rank, world):
    g = dist.group.WORLD
    sends = [[1, 2, 3, 4], [0, 0, 5, 1], [2, 2, 2, 2], [3, 0, 0, 1]]        # rows rank r sends to each rank
    in_splits = sends[rank]
    out_splits = [sends[s][rank] for s in range(world)]
    x = torch.randn(sum(in_splits), 3, requires_grad=True)                  # fp32 rows of 12 bytes
    out = {}
    C.all_reduce(torch.ones(5), g)                                          # outside: not counted
    with C.counting() as sent:
        y = C.all_to_all(x, out_splits, in_splits, g)
    out["a2a"] = dict(sent.by_kind)
    with C.counting() as sent:
        y.sum().backward()                                                  # the reverse exchange
    out["a2a_backward"] = dict(sent.by_kind)
    with C.counting() as sent:
        C.all_reduce(torch.ones(8), g)
        C.all_gather_rows(torch.ones(2, 4), g)
        C.reduce_scatter_rows(torch.ones(world, 6), g)
        C.all_gather_objects(rank)                                          # bookkeeping: not counted
    out["rest"] = dict(sent.by_kind)
    out["total"] = sent.total
    return out


def test_each_kind_counts_the_bytes_this_rank_sends():
    sends = [[1, 2, 3, 4], [0, 0, 5, 1], [2, 2, 2, 2], [3, 0, 0, 1]]
    n = 4
    for rank, got in enumerate(on_ranks(_measure, n)):
        assert got["a2a"] == {"all_to_all": (sum(sends[rank]) - sends[rank][rank]) * 12}
        received_from_others = sum(sends[s][rank] for s in range(n) if s != rank)
        assert got["a2a_backward"] == {"all_to_all": received_from_others * 12}
        want = {"all_reduce": round(2 * (n - 1) / n * 32), "all_gather": (n - 1) * 32,
                "reduce_scatter": round((n - 1) / n * n * 6 * 4)}
        assert got["rest"] == want and got["total"] == sum(want.values())


def test_one_process_sends_nothing():
    with C.counting() as sent:
        C.all_reduce(torch.ones(3), None)
    assert sent.by_kind == {} and sent.total == 0
