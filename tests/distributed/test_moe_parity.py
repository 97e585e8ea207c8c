"""Distributed fmoe.moe == single process: outputs, gradients of x, router and experts."""

import pytest

import fmoe
from helpers import on_ranks
from moe_cases import ROUTERS, check_case

ALL_ROUTERS = list(ROUTERS)


def _two_ranks(rank, world):
    mesh = fmoe.Mesh(tp=1, ep=2)
    fails = []
    for r in ALL_ROUTERS:
        fails += check_case(mesh, "all_to_all", r, sizes=[5, 0])          # rank 1 holds no tokens
    return fails


def _four_ranks(rank, world):
    fails = []
    cases = [((1, 4), "all_to_all", [5, 0, 3, 1]), ((2, 4), "all_to_all", [1, 4]),
             ((2, 2), "all_to_all", [3, 0]), ((2, 2), "all_reduce", [1, 6]),
             ((1, 2), "all_to_all", [2, 7, 0, 1])]
    for (tp, ep), impl, sizes in cases:
        mesh = fmoe.Mesh(tp=tp, ep=ep)
        for r in ALL_ROUTERS:
            fails += check_case(mesh, impl, r, sizes)
    for (tp, ep), impl, sizes in cases[:4]:           # the blocked CPU expert path, same checks
        mesh = fmoe.Mesh(tp=tp, ep=ep)
        for r in ("top2", "duplicate", "one_rank"):
            fails += [f"matmul=loop: {f}" for f in check_case(mesh, impl, r, sizes, matmul="loop")]
    return fails


def _eight_ranks(rank, world):
    fails = []
    for (tp, ep), sizes in [((2, 4), [3, 1, 0, 5]), ((1, 8), [2, 0, 1, 4, 3, 0, 6, 1])]:
        mesh = fmoe.Mesh(tp=tp, ep=ep)
        for r in ("top2", "one_rank", "duplicate", "topE"):
            fails += check_case(mesh, "all_to_all", r, sizes)
    return fails


def test_parity_two_ranks():
    fails = sum(on_ranks(_two_ranks, 2, timeout=300), [])
    assert not fails, "\n".join(fails)


def test_parity_four_ranks():
    fails = sum(on_ranks(_four_ranks, 4, timeout=600), [])
    assert not fails, "\n".join(fails)


@pytest.mark.slow
def test_parity_eight_ranks():
    fails = sum(on_ranks(_eight_ranks, 8, timeout=600), [])
    assert not fails, "\n".join(fails)
