import pytest
import torch
from torch.distributed.tensor import DTensor

import fmoe
from fmoe import P, Plan
from helpers import on_ranks


def full_params():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"colwise": r(8, 6), "rowwise": r(6, 8), "experts": r(8, 3, 2), "rep": r(5),
            "packed": r(8, 3), "nested": r(8, 2), "bias": r(4), "packed_fsdp": r(8, 4)}


PLAN = {"colwise": P("tp", None), "rowwise": P(None, "tp"), "experts": P("ep", None, None),
        "rep": P(), "packed": P("tp", None, packed=2), "nested": P(("fsdp", "tp"), None),
        "bias": P("fsdp"), "packed_fsdp": P("tp", "fsdp", packed=2)}


def _shard_gather(rank, world):
    mesh = fmoe.Mesh(tp=2, ep=4)          # fsdp=2, efsdp=1
    full = full_params()
    for v in full.values():
        v.requires_grad_(True)
    sh = fmoe.shard(full, Plan(PLAN), mesh)
    t, f, e = mesh.rank_in("tp"), mesh.rank_in("fsdp"), mesh.rank_in("ep")
    local = {k: fmoe.to_local(v) for k, v in sh.items()}
    want = {"colwise": full["colwise"][4 * t:4 * t + 4], "rowwise": full["rowwise"][:, 4 * t:4 * t + 4],
            "experts": full["experts"][2 * e:2 * e + 2], "rep": full["rep"],
            "packed": torch.cat([full["packed"][2 * t:2 * t + 2], full["packed"][4 + 2 * t:4 + 2 * t + 2]]),
            "nested": full["nested"][4 * f + 2 * t:4 * f + 2 * t + 2], "bias": full["bias"][2 * f:2 * f + 2],
            "packed_fsdp": torch.cat([full["packed_fsdp"][2 * t:2 * t + 2], full["packed_fsdp"][4 + 2 * t:4 + 2 * t + 2]])[:, 2 * f:2 * f + 2]}
    slices_ok = {k: torch.equal(local[k], want[k]) for k in want}
    all_dtensor = all(isinstance(v, DTensor) and v.requires_grad and v.is_leaf for v in sh.values())
    gathered = fmoe.gather(sh)
    round_trip = {k: torch.equal(gathered[k], full[k].detach()) for k in full}
    # gradient trees: loss = sum(local * coef) gives grad == coef on every element of each rank's
    # slice; leaves replicated over fsdp (2 ranks, 2 batches) gather the sum of both: 2 * coef
    coef = {k: torch.arange(v.numel(), dtype=torch.float32).view_as(v) for k, v in full.items()}
    loss = sum((local[k] * fmoe.sharding.slice_for_rank(coef[k], PLAN[k], mesh)).sum() for k in full if k != "rep")
    rep = fmoe.to_local(sh["rep"], partial_grad=("tp",))
    loss = loss + (rep * (t + 1)).sum()
    loss.backward()
    grads = fmoe.gather({k: v.grad for k, v in sh.items()})
    copies = {k: 2 if "fsdp" not in PLAN[k].mesh_axes() and "ep" not in PLAN[k].mesh_axes() else 1 for k in full}
    grads_ok = {k: torch.equal(grads[k], copies[k] * coef[k]) for k in full if k != "rep"}
    rep_grad = grads["rep"]
    placements = {k: fmoe.placement_of(v.grad) for k, v in sh.items()}
    odd = torch.arange(10.0).view(5, 2)            # uneven over tp: torch.chunk pieces 3 / 2
    placed = fmoe.shard({"odd": odd}, {"odd": P("tp", None)}, mesh)["odd"]
    uneven = [torch.equal(fmoe.to_local(placed), odd[3 * t:3 + 2 * t]), torch.equal(fmoe.gather(placed), odd)]
    try:
        fmoe.shard({"experts": torch.zeros(6, 2)}, {"experts": P("ep", None)}, mesh)
    except ValueError as err:
        uneven.append(str(err))
    # unshard: fsdp-split weight gathered for compute, grad = sum over fsdp copies
    w = fmoe.shard({"w": torch.arange(8.0).view(4, 2).requires_grad_(True)}, {"w": P("fsdp", "tp")}, mesh)["w"]
    m = fmoe.unshard(w, keep=("tp",))
    mat_fwd = torch.equal(m, torch.arange(8.0).view(4, 2)[:, t:t + 1])
    (m * (f + 1)).sum().backward()
    mat_grad = fmoe.gather(w.grad)
    return slices_ok, all_dtensor, round_trip, grads_ok, rep_grad, placements, uneven, (mat_fwd, mat_grad)


def test_shard_gather_round_trip_four_ranks():
    for slices_ok, all_dtensor, round_trip, grads_ok, rep_grad, placements, uneven, mat in on_ranks(_shard_gather, 4):
        assert mat[0] and torch.equal(mat[1], torch.full((4, 2), 3.0))   # (0+1) + (1+1) over fsdp
        assert all(slices_ok.values()), slices_ok
        assert all_dtensor
        assert all(round_trip.values()), round_trip
        assert all(grads_ok.values()), grads_ok
        assert torch.equal(rep_grad, torch.full((5,), 6.0))      # ((0 + 1) + (1 + 1)) over tp, twice over fsdp
        assert placements["packed"] == P("tp", None, packed=2)
        assert placements["packed_fsdp"] == P("tp", "fsdp", packed=2)
        assert placements["experts"] == P("ep", None, None) and placements["rowwise"] == P(None, "tp")
        assert uneven[:2] == [True, True], uneven
        assert "'experts'" in uneven[2] and "dim 0 of size 6 is not divisible by ep=4" in uneven[2]


def test_single_process_shard_is_identity_and_validates():
    p = full_params()
    out = fmoe.shard(p, Plan(PLAN), fmoe.Mesh())
    assert all(out[k] is p[k] for k in p)
    assert fmoe.gather(out) == out
    with pytest.raises(ValueError, match="matches no parameter"):
        fmoe.shard(p, Plan({**PLAN, "missing": P()}))
