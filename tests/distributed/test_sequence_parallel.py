"""Sequence parallelism (``fmoe.Mesh(tp=n, sp=True)``, ``fmoe train --sp``): the same numbers.

Between tensor-parallel layers each tp rank holds ``S / tp`` positions of the residual stream;
the layer functions all-gather before a colwise layer, reduce-scatter after a rowwise one and the
vocabulary-parallel embedding, and ``fmoe.moe`` routes the rank's own tokens. Shown here, fp32:

- forward logits and the gathered gradient of every parameter with ``Mesh(tp=2, sp=True)`` equal
  the one-process result and the ``Mesh(tp=2)`` result, for llama (dense), qwen3_moe and gpt_oss
  (biases, sinks, router bias), with the router's load-balance loss in the loss (its statistics
  summed over the tp ranks' tokens); the routed load equals the one-process load;
- the classic sequence-parallel gradient-scale bug cannot happen: a norm weight's gradient on a
  rank is a *part* (its own tokens), marked ``Partial`` over tp, and only the sum is the gradient;
- tp2 x ep2 and tp2 x ep4 (the statistics folded into the dispatch) on 4 ranks with the trainer's
  data-parallel splits, against one process over both batches;
- the job: ``--tp 2 --sp`` losses step by step equal ``--tp 2``;
- bad input: ``--sp`` without tp and ``Mesh(sp=True)`` with tp=1, a sequence tp does not divide,
  ``impl="all_reduce"`` and params sharded for another mesh: clear errors before any collective;
  DeepSeek-V3 (MLA rotates a key computed on the sequence piece): a clear error on every rank.

The comparisons use :func:`helpers.close` (rtol from the dtype, 1e-5 in fp32) with an atol of
2e-6 of each tensor's scale: the tp ranks' partial sums add in another order than one process.
"""

import pytest
import torch

import fmoe
import fmoe.nn as nn
import fmoe.training
from fmoe.models import deepseek_v3, gpt_oss, llama, qwen3_moe
from fmoe.training import JobConfig
from helpers import close, on_ranks
from train_cases import read_log

B, S = 2, 8
MODELS = {"llama": llama, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss, "deepseek_v3": deepseek_v3}
CFGS = {  # initializer_range 0.2: routing far from uniform; the load-balance loss is in the loss
    "llama": llama.Config.tiny(initializer_range=0.2),
    "qwen3_moe": qwen3_moe.Config.tiny(initializer_range=0.2, output_router_logits=True),
    "gpt_oss": gpt_oss.Config.tiny(initializer_range=0.2, swiglu_limit=1.0, output_router_logits=True),
    "deepseek_v3": deepseek_v3.Config.tiny(initializer_range=0.2),   # MLA: the rope key gathered by shared_by_heads
}
ATOL = 2e-6


def tokens_of(b: int) -> torch.Tensor:
    return torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(100 + b))


def full_params(name: str) -> dict:
    """Random parameters with every bias, sink and norm away from its init value."""
    g = torch.Generator().manual_seed(7)
    return fmoe.tree.map_with_path(lambda _, t: t + 0.1 * torch.randn(t.shape, generator=g),
                                   MODELS[name].init(CFGS[name], 0))


def forward(name: str, params: dict, tokens: torch.Tensor, mesh) -> tuple:
    """``(logits, the routers' summed load-balance loss, routed load of each MoE layer)``."""
    model, cfg = MODELS[name], CFGS[name]
    if name == "llama":
        return model.forward(params, tokens, cfg, mesh), 0.0, []
    logits, aux = model.forward(params, tokens, cfg, mesh, return_aux=True)
    return logits, sum(a.get("load_balance_loss", 0.0) for a in aux["moe"]), [a["load"] for a in aux["moe"]]


def cross_entropy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.cross_entropy(logits[:, :-1], tokens[:, 1:])


def reference(name: str, batches: int) -> tuple:
    """One process over all the batches' rows at once: each batch's logits, the loads, and the
    gradient of ``sum_b cross_entropy(batch b) + balance loss(all rows)``, what the ranks' gathered
    gradients are (each rank's loss is its batch's cross entropy plus the global balance loss)."""
    params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), full_params(name))
    tokens = [tokens_of(b) for b in range(batches)]
    logits, balance, loads = forward(name, params, torch.cat(tokens), None)
    logits = list(logits.split(B))
    (sum(cross_entropy(lg, t) for lg, t in zip(logits, tokens)) + balance).backward()
    return [lg.detach() for lg in logits], loads, fmoe.tree.flatten(fmoe.tree.map_with_path(lambda _, t: t.grad, params))


def _rank(rank: int, world: int, name: str, meshes: list, data_parallel: bool) -> list:
    out = []
    for kw in meshes:
        mesh = fmoe.Mesh(**kw)
        model, cfg, full = MODELS[name], CFGS[name], full_params(name)
        plan = model.MODEL.build_plan(cfg, mesh=mesh, params=full, data_parallel=data_parallel)
        params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), fmoe.shard(full, plan, mesh))
        tokens = tokens_of(mesh.batch_index)
        logits, balance, loads = forward(name, params, tokens, mesh)
        (cross_entropy(logits, tokens) + balance).backward()
        grads = fmoe.tree.map_with_path(lambda _, t: t.grad, params)
        norm = grads["layers"][0]["attn_norm"]
        out.append({"mesh": repr(mesh), "batch": mesh.batch_index, "logits": logits.detach(), "loads": loads,
                    "grads": fmoe.tree.flatten(fmoe.gather(grads)), "norm_placements": tuple(map(repr, norm.placements)),
                    "norm_local": norm.to_local().clone()})
    return out


def _check_against(results: list, refs: tuple, what: str) -> None:
    logits, loads, grads = refs
    for rank, r in enumerate(results):
        w = f"{what} {r['mesh']} rank {rank}"
        close(r["logits"], logits[r["batch"]], f"{w} logits", atol=ATOL)
        assert all(torch.equal(a, b) for a, b in zip(r["loads"], loads)), f"{w}: routed load"
        assert sorted(r["grads"]) == sorted(grads)
        for path, g in r["grads"].items():
            close(g, grads[path], f"{w} grad {path}", atol=ATOL)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_tp2_sp_equals_one_process_and_tp2(name):
    results = on_ranks(_rank, 2, name, [dict(tp=2), dict(tp=2, sp=True)], False, timeout=300)
    refs = reference(name, 1)
    tp, sp = [[per_rank[i] for per_rank in results] for i in range(2)]
    _check_against(tp, refs, name)
    _check_against(sp, refs, name)
    for a, b in zip(tp, sp):                                   # and the two meshes agree with each other
        close(b["logits"], a["logits"], f"{name} sp vs tp logits", atol=ATOL)
        for path in a["grads"]:
            close(b["grads"][path], a["grads"][path], f"{name} sp vs tp grad {path}", atol=ATOL)
    # the gradient-scale bug: under sp a norm weight's local gradient is each rank's own tokens' part,
    # marked Partial over tp (summed by fmoe.gather and the trainer), not the gradient itself
    assert "Partial(sum)" not in tp[0]["norm_placements"]
    assert sp[0]["norm_placements"][-1] == "Partial(sum)"      # the mesh's last dim is tp
    full = refs[2]["layers.0.attn_norm"]
    close(sp[0]["norm_local"] + sp[1]["norm_local"], full, f"{name} norm parts sum", atol=ATOL)
    assert not torch.allclose(sp[0]["norm_local"], full, rtol=1e-3), "a rank's part alone is not the gradient"


@pytest.mark.parametrize("ep", [2, 4])
def test_tp2_ep_sp_four_ranks_with_data_parallel_splits(ep):
    """4 ranks = 2 batches of a tp pair; ep=4 folds the statistics into the dispatch's exchange."""
    results = on_ranks(_rank, 4, "qwen3_moe", [dict(tp=2, ep=ep, sp=True)], True, timeout=300)
    _check_against([r[0] for r in results], reference("qwen3_moe", 2), f"qwen3_moe ep={ep}")


def _bad_inputs(rank: int, world: int) -> list:
    errors = []
    with pytest.raises(ValueError, match="sp .sequence parallelism. splits the sequence over tp and needs tp > 1"):
        fmoe.Mesh(tp=1, sp=True)
    mesh, tp_mesh = fmoe.Mesh(tp=2, sp=True), fmoe.Mesh(tp=2)
    cfg = CFGS["qwen3_moe"]
    params = qwen3_moe.shard(qwen3_moe.init(cfg, 0), cfg, mesh)
    with pytest.raises(ValueError, match="tp must divide the sequence length, got tokens of shape .2, 7."):
        qwen3_moe.forward(params, torch.zeros(2, 7, dtype=torch.long), cfg, mesh)
    moe_params, x = params["layers"][0]["moe"], torch.zeros(4, cfg.hidden_size)
    with pytest.raises(ValueError, match="impl='all_reduce' requires the expert group to share one batch"):
        fmoe.moe(moe_params, x, router=fmoe.routing.topk(2), mesh=mesh, impl="all_reduce")
    with pytest.raises(ValueError, match="mesh has sp=False but params were sharded on a mesh with sp=True"):
        fmoe.moe(moe_params, x, router=fmoe.routing.topk(2), mesh=tp_mesh)
    with torch.no_grad():   # inference under sp: "auto" takes the token dispatch, not all_reduce
        y, _ = fmoe.moe(moe_params, torch.randn(4, cfg.hidden_size), router=fmoe.routing.topk(2), mesh=mesh)
    errors.append(tuple(y.shape))
    return errors


def test_bad_input_is_refused_before_any_collective():
    assert on_ranks(_bad_inputs, 2) == [[(4, 64)], [(4, 64)]]


def test_sp_without_tp_fails_before_any_rank_starts(tmp_path):
    with pytest.raises(ValueError, match=r"--sp \(sequence parallelism\) splits the sequence over the "
                                         r"tensor-parallel ranks; it needs --tp > 1, got --tp 1"):
        fmoe.training.run(JobConfig(model="qwen3_moe", preset="tiny", nproc=2, sp=True, out=str(tmp_path / "x")))
    assert not (tmp_path / "x").exists()          # nothing started: no run directory


JOB = dict(model="qwen3_moe", preset="tiny", steps=3, batch=2, seq=16, warmup=1, quiet=True, nproc=2, tp=2)


def test_job_tp2_sp_losses_equal_tp2(tmp_path):
    fmoe.training.run(JobConfig(out=str(tmp_path / "tp"), **JOB))
    fmoe.training.run(JobConfig(out=str(tmp_path / "sp"), sp=True, **JOB))
    tp, sp = read_log(tmp_path / "tp"), read_log(tmp_path / "sp")
    assert [r["step"] for r in sp] == [1, 2, 3]
    assert sp[0]["loss"] == pytest.approx(tp[0]["loss"], rel=1e-6, abs=0)      # step 1: same weights, same batch
    for a, b in zip(tp, sp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["load_balance_loss"] == pytest.approx(a["load_balance_loss"], rel=1e-5)
        assert b["expert_load"] == a["expert_load"]


def _gathered_linear_transforms(rank: int, world: int) -> list:
    """``gathered_linear`` (x's slice kept, gathered again in backward) against the composite
    ``F.linear(all_gather(x), w, b)`` under backward, double backward, jvp and vmap."""
    from torch.func import jvp, vmap
    from fmoe.collectives import all_gather, gathered_linear

    group = torch.distributed.new_group([0, 1])
    g = torch.Generator().manual_seed(rank)
    x, w, b = torch.randn(2, 3, 5, generator=g), torch.randn(4, 5, generator=g), torch.randn(4, generator=g)
    fused = lambda x, w, b: gathered_linear(x, w, b, group, dim=-2)                     # noqa: E731
    plain = lambda x, w, b: torch.nn.functional.linear(all_gather(x, group, dim=-2), w, b)  # noqa: E731
    out = []
    for f in (fused, plain):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = f(xs, ws, bs)
        grads = torch.autograd.grad((y ** 3).sum(), (xs, ws, bs), create_graph=True)
        second = torch.autograd.grad(sum((gr ** 2).sum() for gr in grads), (xs, ws, bs))   # double backward
        tangent = jvp(f, (x, w, b), (torch.ones_like(x), torch.full_like(w, 0.5), torch.ones_like(b)))[1]
        batched = vmap(f, in_dims=(0, None, None))(torch.stack([x, 2 * x]), w, b)
        per_weight = vmap(f, in_dims=(None, 0, None))(x, torch.stack([w, -w]), b)
        out.append([y.detach(), *[t.detach() for t in grads], *second, tangent, batched, per_weight])
    return out


def test_gathered_linear_under_transforms():
    for rank, (fused, plain) in enumerate(on_ranks(_gathered_linear_transforms, 2)):
        for i, (a, b) in enumerate(zip(fused, plain)):
            close(a, b, f"rank {rank} output {i}")


@pytest.mark.parametrize("rules", [{"layers.*.attn.wq": "replicate"}, {"layers.*.attn.wo": "replicate"},
                                   {"layers.*.attn.wq": "colwise_gather", "layers.*.attn.wo": "replicate"}])
def test_a_plan_that_leaves_the_sequence_piece_is_refused_under_sp(rules):
    """Replicated attention would attend within the piece only; a gathered block end would add a
    full sequence to the piece (broadcast silently when S == tp): refused, naming path and rule."""
    from fmoe.mesh.layout import RankLayout
    from fmoe.models import qwen3_moe

    cfg = qwen3_moe.Config.tiny()
    model = qwen3_moe.MODEL
    with pytest.raises(ValueError, match=r"with sequence parallelism \(mesh sp=True\) layers\.0\.attn\.w[qo] must "
                                         r"keep the default tensor-parallel split"):
        model.build_plan(cfg, rules, RankLayout(2, tp=2, sp=True))
    model.build_plan(cfg, rules, RankLayout(2, tp=2))                    # the same plan without sp is fine
    model.build_plan(cfg, {"layers.*.moe.router": "replicate"}, RankLayout(2, tp=2, sp=True))  # a rule that keeps it
