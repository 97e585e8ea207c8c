"""Two layers a model author needs, on every placement, against plain torch on one process:

- ``nn.embedding(..., padding_idx=)``: the pad row gets no gradient (as ``torch.nn.Embedding``
  and so transformers), forward unchanged, with the table replicated, vocabulary-parallel,
  split on D, split over fsdp, and under sequence parallelism (``Mesh(tp=2, sp=True)``);
- ``nn.rms_norm`` over a tp-split weight (OLMoE's q norm ``[H*hd]`` on a colwise projection):
  the mean of squares over the full width (partial sums all-reduced over the weight's tp group),
  and with a gathered colwise output (full width) the weight gathered instead.

The layer is ``embed -> colwise q (-> norm over the projection) -> rowwise o``; the reference is
``F.embedding(padding_idx=)`` and the norm written out, one process over every rank's batch.
fp32, :func:`helpers.close` (rtol 1e-5) with an atol of 2e-6 of the scale (tp partial sums).
"""

import pytest
import torch
import torch.nn.functional as F

import fmoe
import fmoe.nn as nn
from fmoe import P, Plan
from helpers import close, on_ranks

V, D, Q, B, S, PAD = 16, 8, 12, 2, 6, 1
MESHES = {  # name -> (mesh kwargs, plan rules)
    "tp2-vocab": ({"tp": 2}, {"embed": "vocab", "wq": "colwise", "q_norm": P("tp"), "wo": "rowwise"}),
    "tp2-dsplit": ({"tp": 2}, {"embed": P(None, "tp"), "wq": "colwise", "q_norm": P("tp"), "wo": "rowwise"}),
    "tp2-gathered-q": ({"tp": 2}, {"embed": "vocab", "wq": "colwise_gather", "q_norm": P("tp"), "wo": "replicate"}),
    "tp2-sp-vocab": ({"tp": 2, "sp": True}, {"embed": "vocab", "wq": "colwise", "q_norm": P("tp"), "wo": "rowwise"}),
    "tp2-sp-dsplit": ({"tp": 2, "sp": True}, {"embed": P(None, "tp"), "wq": "colwise", "q_norm": P("tp"),
                                              "wo": "rowwise"}),
    "fsdp2": ({"tp": 1}, {"embed": P("fsdp", None), "wq": P("fsdp", None), "q_norm": P("fsdp"), "wo": "replicate"}),
}


def params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(V, D, generator=g), "wq": torch.randn(Q, D, generator=g),
            "q_norm": 1 + 0.2 * torch.randn(Q, generator=g), "wo": torch.randn(D, Q, generator=g)}


def tokens(b: int) -> torch.Tensor:
    t = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(10 + b))
    t[:, ::3] = PAD                           # the pad token in every batch, at several positions
    return t


def layer(p: dict, t: torch.Tensor) -> torch.Tensor:
    q = nn.rms_norm(nn.linear(nn.embedding(t, p["embed"], padding_idx=PAD), p["wq"]), p["q_norm"], 1e-6)
    return nn.linear(q, p["wo"])              # [B, S, D] (sequence parallel: [B, S / tp, D])


def reference(p: dict, t: torch.Tensor) -> torch.Tensor:
    q = F.linear(F.embedding(t, p["embed"], padding_idx=PAD), p["wq"])
    q = p["q_norm"] * (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6))
    return F.linear(q, p["wo"])


def probe(b: int) -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(20 + b))


def _rank(rank: int, world: int) -> dict:
    out = {}
    for name, (sizes, rules) in MESHES.items():
        mesh = fmoe.Mesh(**sizes)
        sharded = fmoe.shard(fmoe.tree.map_with_path(lambda _, x: x.requires_grad_(), params()), Plan(rules), mesh)
        b = mesh.batch_index
        y = layer(sharded, tokens(b))
        own = slice(None) if not mesh.sp else slice(mesh.rank_in("tp") * S // 2, (mesh.rank_in("tp") + 1) * S // 2)
        (y * probe(b)[:, own]).sum().backward()
        grads = fmoe.gather(fmoe.tree.map_with_path(lambda _, x: x.grad, sharded))
        out[name] = {"y": y.detach(), "own": own, "batch": b, "batches": mesh.num_batches, "grads": grads}
    return out


def test_pad_row_and_split_norm_equal_one_process_on_every_placement():
    results = on_ranks(_rank, 2, timeout=300)
    p = fmoe.tree.map_with_path(lambda _, x: x.requires_grad_(), params())
    outs = [reference(p, tokens(b)) for b in range(2)]
    refs = {}
    for n in (1, 2):                          # gradients of the sum over the distinct batches
        for x in p.values():
            x.grad = None
        sum((reference(p, tokens(b)) * probe(b)).sum() for b in range(n)).backward()
        refs[n] = {k: x.grad.clone() for k, x in p.items()}
    assert refs[1]["embed"][PAD].abs().max() == 0 and refs[1]["embed"].abs().max() > 0
    for rank, result in enumerate(results):
        for name, r in result.items():
            what = f"{name} rank {rank}"
            close(r["y"], outs[r["batch"]][:, r["own"]].detach(), f"{what} output", atol=2e-6)
            for k, g in r["grads"].items():
                close(g, refs[r["batches"]][k], f"{what} grad {k}", atol=2e-6)
            assert r["grads"]["embed"][PAD].abs().max() == 0, f"{what}: the pad row got a gradient"


def test_bad_padding_idx_and_split_norm_width_are_named():
    with pytest.raises(ValueError, match=r"padding_idx must be None or an int in \[0, 16\), got 16"):
        nn.embedding(tokens(0), params()["embed"], padding_idx=V)
    with pytest.raises(ValueError, match="x has last dim 5 but w has 12 entries"):
        nn.rms_norm(torch.ones(2, 5), torch.ones(Q))
