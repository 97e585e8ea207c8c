import pytest
import torch.distributed as dist

import fmoe
from helpers import on_ranks

REFERENCE_EP_TP2 = {  # expert ranges per rank, from reference/ep-tp-behaviour.md
    2: [range(0, 4), range(4, 8)] * 4,
    4: [range(0, 2), range(2, 4), range(4, 6), range(6, 8)] * 2,
    8: [range(i, i + 1) for i in range(8)],
}


def test_single_process_mesh():
    m = fmoe.Mesh()
    assert (m.tp, m.fsdp, m.ep, m.efsdp, m.dp_replicate) == (1, 1, 1, 1, 1)
    assert m.group("tp") is None and m.expert_range(6) == range(0, 6) and m.rank_in("ep") == 0
    with pytest.raises(ValueError, match="requires dp_replicate \\* fsdp \\* tp = 1 \\* 1 \\* 2 = 2 processes, but world_size is 1"):
        fmoe.Mesh(tp=2, fsdp=1)
    with pytest.raises(ValueError, match="unknown mesh axis 'seq'"):
        m.group("seq")
    assert m.cp == 1 and m.group("cp") is None and m.size("cp") == 1


@pytest.mark.parametrize("kw,match", [
    (dict(tp=0), "tp must be >= 1, got tp=0"),
    (dict(ep=-1), "ep must be >= 1"),
    (dict(dp_replicate=0), "dp_replicate must be >= 1"),
    (dict(fsdp=0), "fsdp must be >= 1"),
])
def test_sizes_below_one(kw, match):
    with pytest.raises(ValueError, match=match):
        fmoe.Mesh(**kw)


def test_check_layout_is_the_one_set_of_rules():
    """The rules Mesh enforces, as a pure function of the sizes (no process group needed)."""
    from fmoe.mesh import Layout, check_layout
    assert check_layout(8, tp=2, ep=4) == Layout(world=8, tp=2, ep=4, fsdp=4, dp_replicate=1)
    assert check_layout(8, tp=2, ep=4).efsdp == 2 and check_layout(8, tp=2).ep == 2        # ep default: tp
    assert check_layout(8, tp=2, ep=2, dp_replicate=2) == Layout(8, 2, 2, 2, 2)
    bad = [
        (dict(world=8, tp=3), ValueError, "world_size=8 must be divisible by tp * dp_replicate = 3 (tp=3, dp_replicate=1)"),
        (dict(world=8, tp=2, dp_replicate=3), ValueError, "must be divisible by tp * dp_replicate = 6"),
        (dict(world=8, tp=2, ep=3), ValueError, "ep=3 must be a multiple of tp=2 (a tensor-parallel group never "
                                                "straddles two expert groups); valid ep: 2, 4, 8"),
        (dict(world=8, tp=2, ep=16), ValueError, "ep=16 must divide fsdp * tp = 4 * 2 = 8 (the ranks of one "
                                                 "data-parallel replica); valid ep: 2, 4, 8"),
        (dict(world=8, tp=2, ep=8, dp_replicate=2), ValueError, "ep=8 must divide fsdp * tp = 2 * 2 = 4 (the ranks "
                                                                "of one data-parallel replica); valid ep: 2, 4"),
        (dict(world=8, tp=1, fsdp=4), ValueError, "requires dp_replicate * fsdp * tp = 1 * 4 * 1 = 4 processes, "
                                                  "but world_size is 8"),
        (dict(world=8, tp=0), ValueError, "tp must be >= 1, got tp=0"),
        (dict(world=8, fsdp=0), ValueError, "fsdp must be >= 1, got fsdp=0"),
        (dict(world=8, tp=2.0), TypeError, "tp must be an int >= 1, got 2.0 (float)"),
        (dict(world=8, ep=True), TypeError, "ep must be an int >= 1, got True (bool)"),
    ]
    for kw, kind, match in bad:
        with pytest.raises(kind) as e:
            check_layout(kw.pop("world"), **kw)
        assert match in str(e.value), (kw, str(e.value))

    # the same rule, spelled as the caller's user spells the fields
    flags = {"world": "--nproc", "tp": "--tp", "ep": "--ep", "dp_replicate": "--dp-replicate"}
    with pytest.raises(ValueError, match=r"^--ep 3 must be a multiple of --tp 2 .*; valid --ep: 2, 4$"):
        check_layout(4, tp=2, ep=3, names=flags)
    with pytest.raises(ValueError, match=r"^--nproc 4 must be divisible by --tp \* --dp-replicate = 3 "):
        check_layout(4, tp=3, names=flags)
    # Mesh raises exactly these errors (single process: world 1)
    with pytest.raises(ValueError) as e:
        fmoe.Mesh(tp=2)
    with pytest.raises(ValueError) as want:
        check_layout(1, tp=2)
    assert str(e.value) == f"Mesh: {want.value}"


def test_rank_layout_is_mesh_without_processes():
    """``RankLayout``: one rank's sizes and coordinates (the memory plan's virtual mesh), the
    same numbers as the reference picture in fmoe/mesh.py; a rank outside the world is refused."""
    from fmoe.mesh import RankLayout
    m = RankLayout(8, 5, tp=2, ep=4)
    assert (m.fsdp, m.efsdp, m.rank_in("tp"), m.rank_in("fsdp"), m.rank_in("ep"), m.batch_index) == (4, 2, 1, 2, 1, 2)
    assert m.ranks("ep") == [4, 5, 6, 7] and m.ranks("fsdp") == [1, 3, 5, 7] and m.expert_range(8) == range(2, 4)
    for rank in (8, -1, 1.0):
        with pytest.raises(ValueError, match=r"rank must be an int in \[0, 8\) for 8 ranks"):
            RankLayout(8, rank, tp=2)


def _eight_rank_layouts(rank, world):
    out = {}
    for ep in (2, 4, 8):
        m = fmoe.Mesh(tp=2, ep=ep)
        groups = {a: dist.get_process_group_ranks(m.group(a)) for a in ("tp", "fsdp", "ep", "efsdp", "dp_replicate")}
        assert all(groups[a] == m.ranks(a) for a in groups), (groups, {a: m.ranks(a) for a in groups})
        out[ep] = dict(range=m.expert_range(8), efsdp=m.efsdp, fsdp=m.fsdp, batch=m.batch_index,
                       groups=groups, ep_rank=m.rank_in("ep"), tp_rank=m.rank_in("tp"))
    configs = []
    for tp, fsdp, ep in [(4, 2, 4), (1, 8, 4), (2, 4, 4), (8, 1, 8)]:
        m = fmoe.Mesh(tp=tp, ep=ep)
        configs.append((m.tp, m.fsdp, m.ep, m.efsdp, m.expert_range(8)))
    h = fmoe.Mesh(tp=2, ep=2, dp_replicate=2)
    configs.append((h.dp_replicate, h.fsdp, h.efsdp, h.batch_index, h.ranks("dp_replicate"), h.ranks("efsdp")))
    errors = []
    for kw in [dict(tp=3), dict(tp=2, ep=3), dict(tp=2, ep=6), dict(tp=1, fsdp=4), dict(ep=16),
               dict(tp=2, fsdp=2, dp_replicate=3)]:
        try:
            fmoe.Mesh(**kw)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return out, configs, errors


@pytest.mark.slow
def test_eight_rank_layouts_match_reference():
    results = on_ranks(_eight_rank_layouts, 8, timeout=240)
    for rank, (out, configs, errors) in enumerate(results):
        for ep, want in REFERENCE_EP_TP2.items():
            assert out[ep]["range"] == want[rank]
            assert out[ep]["efsdp"] == 8 // ep and out[ep]["fsdp"] == 4
            assert out[ep]["batch"] == rank // 2                      # TP pairs share a batch
            assert out[ep]["groups"]["tp"] == [rank - rank % 2, rank - rank % 2 + 1]
            start = rank - rank % ep
            assert out[ep]["groups"]["ep"] == list(range(start, start + ep))
            assert out[ep]["groups"]["efsdp"] == list(range(rank % ep, 8, ep))
        assert [c[:4] for c in configs[:4]] == [(4, 2, 4, 2), (1, 8, 4, 2), (2, 4, 4, 2), (8, 1, 8, 1)]
        assert configs[3][4] == range(rank, rank + 1)
        dpr, fsdp, efsdp, batch, dpr_ranks, efsdp_ranks = configs[4]
        assert (dpr, fsdp, efsdp, batch) == (2, 2, 2, rank // 2)
        assert dpr_ranks == [rank % 4, rank % 4 + 4] and efsdp_ranks == [rank - rank % 4 + rank % 2, rank - rank % 4 + rank % 2 + 2]
        assert "Mesh: world_size=8 must be divisible by tp * dp_replicate = 3 (tp=3, dp_replicate=1)" in errors[0]
        assert "Mesh: ep=3 must be a multiple of tp=2" in errors[1] and "valid ep: 2, 4, 8" in errors[1]
        assert "Mesh: ep=6 must divide fsdp * tp = 4 * 2 = 8" in errors[2] and "valid ep: 2, 4, 8" in errors[2]
        assert "requires dp_replicate * fsdp * tp = 1 * 4 * 1 = 4 processes, but world_size is 8" in errors[3]
        assert "Mesh: ep=16 must divide fsdp * tp = 8 * 1 = 8" in errors[4] and "valid ep: 1, 2, 4, 8" in errors[4]
        assert "= 12 processes, but world_size is 8" in errors[5]


def test_pipeline_stages_are_the_outermost_axis():
    """``pp`` splits the world into equal stages of consecutive ranks; every other axis lives
    inside a stage; the ``pp`` group is the ranks at the same place in every stage."""
    from fmoe.mesh import Layout, RankLayout, check_layout

    assert check_layout(8, tp=2, ep=2, pp=2) == Layout(world=8, tp=2, ep=2, fsdp=2, dp_replicate=1, pp=2)
    m = RankLayout(8, 6, tp=2, ep=2, pp=2)
    assert (m.stage, m.stage_world, m.rank_in("tp"), m.rank_in("fsdp"), m.batch_index, m.num_batches) == (1, 4, 0, 1, 1, 2)
    assert m.ranks("pp") == [2, 6] and m.ranks("tp") == [6, 7] and m.ranks("fsdp") == [4, 6] and m.size("pp") == 2
    with pytest.raises(ValueError, match="world_size=6 must be divisible by pp=4"):
        check_layout(6, pp=4)
    with pytest.raises(ValueError, match=r"world_size/pp=3 must be divisible by tp \* dp_replicate = 2"):
        check_layout(6, tp=2, pp=2)
    with pytest.raises(ValueError, match="needs tp > 1"):
        RankLayout(2, 0, sp=True)
