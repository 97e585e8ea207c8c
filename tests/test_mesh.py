import pytest
import torch.distributed as dist

import fmoe
from fmoe.testing import spawn

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
    with pytest.raises(ValueError, match="unknown mesh axis 'pp'"):
        m.group("pp")


@pytest.mark.parametrize("kw,match", [
    (dict(tp=0), "tp must be >= 1, got tp=0"),
    (dict(ep=-1), "ep must be >= 1"),
    (dict(dp_replicate=0), "dp_replicate must be >= 1"),
    (dict(fsdp=0), "fsdp must be >= 1"),
])
def test_sizes_below_one(kw, match):
    with pytest.raises(ValueError, match=match):
        fmoe.Mesh(**kw)


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
    results = spawn(_eight_rank_layouts, 8, timeout=240)
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
        assert "world_size 8 is not divisible by tp * dp_replicate = 3 * 1" in errors[0]
        assert "ep must be a multiple of tp, got ep=3, tp=2" in errors[1]
        assert "ep must divide fsdp * tp, got ep=6" in errors[2]
        assert "requires dp_replicate * fsdp * tp = 1 * 4 * 1 = 4 processes, but world_size is 8" in errors[3]
        assert "ep must divide fsdp * tp, got ep=16" in errors[4]
        assert "= 12 processes, but world_size is 8" in errors[5]
