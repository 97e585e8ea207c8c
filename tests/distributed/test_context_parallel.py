"""Context parallelism (``fmoe.Mesh(cp=n)``): each sequence split over cp ranks in head + tail
chunks, K/V all-gathered; the same numbers as one process. Shown here, fp32:

- every rank's logits equal the one-process logits at its chunks' positions, the routed load of
  every MoE layer equals the one-process load, and the gathered gradient of every parameter
  equals the one-process gradient of ``sum over sequences of the mean cross entropy + the
  routers' load-balance loss``, each rank computing its chunks' share of the mean: qwen3_moe on
  cp2, cp4, cp2 x ep2 (cp ranks in one expert group), cp2 x tp2 with ``--sp``, and cp2 over two
  data-parallel batches with FSDP splits (fsdp2 x cp2 x ep4); DeepSeek-V3 (MLA) on cp2; gpt_oss on
  cp2 (a sliding window of 4 crossing the 4-token chunks' boundaries, sinks) through the blocked
  attention (its score budget lowered: blocks of 4 keys and 2 queries);
- the K/V exchange is counted by ``fmoe.collectives.counting`` (``sent_bytes``);
- a sequence not divisible by ``2 cp``, a cache and a bad ``cp`` are refused in one line.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fmoe
import fmoe.training
from fmoe.models import deepseek_v3, gpt_oss, qwen3_moe
from helpers import close, on_ranks
from train_cases import read_log

B, S = 2, 16
MODELS = {"qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss, "deepseek_v3": deepseek_v3}
CFGS = {
    "qwen3_moe": qwen3_moe.Config.tiny(initializer_range=0.2, output_router_logits=True),
    "gpt_oss": gpt_oss.Config.tiny(initializer_range=0.2, swiglu_limit=1.0, output_router_logits=True),
    "deepseek_v3": deepseek_v3.Config.tiny(initializer_range=0.2),
}
ATOL = 2e-6


def tokens_of(b: int) -> torch.Tensor:
    return torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(100 + b))


def targets_of(tokens: torch.Tensor) -> torch.Tensor:
    """Next tokens, the last position predicting the first (every position has a target)."""
    return torch.roll(tokens, -1, dims=1)


def full_params(name: str) -> dict:
    g = torch.Generator().manual_seed(7)
    return fmoe.tree.map_with_path(lambda _, t: t + 0.1 * torch.randn(t.shape, generator=g),
                                   MODELS[name].init(CFGS[name], 0))


def forward(name: str, params: dict, tokens: torch.Tensor, mesh) -> tuple:
    logits, aux = MODELS[name].forward(params, tokens, CFGS[name], mesh, return_aux=True)
    return logits, sum(a.get("load_balance_loss", 0.0) for a in aux["moe"]), [a["load"] for a in aux["moe"]]


def summed_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over the positions given, divided by one sequence batch's tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / (B * S)


def reference(name: str, batches: int) -> tuple:
    params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), full_params(name))
    tokens = [tokens_of(b) for b in range(batches)]
    logits, balance, loads = forward(name, params, torch.cat(tokens), None)
    logits = list(logits.split(B))
    (sum(summed_ce(lg, targets_of(t)) for lg, t in zip(logits, tokens)) + balance).backward()
    return [lg.detach() for lg in logits], loads, fmoe.tree.flatten(fmoe.tree.map_with_path(lambda _, t: t.grad, params))


def _rank(rank: int, world: int, name: str, meshes: list, budget) -> list:
    import importlib

    if budget is not None:      # the blocked attention at these tiny sizes, by blocks of 4 keys
        importlib.import_module("fmoe.nn.attention").SCORE_BUDGET = budget
        blocked = importlib.import_module("fmoe.nn.blocked_attention")
        blocked.SCORE_BUDGET, blocked.KEY_BLOCK = budget, 4
    out = []
    for kw in meshes:
        mesh = fmoe.Mesh(**kw)
        cp = fmoe.nn.ContextParallel.of(mesh)
        model, cfg, full = MODELS[name], CFGS[name], full_params(name)
        plan = model.MODEL.build_plan(cfg, mesh=mesh, params=full, data_parallel=kw.get("fsdp", 1) > 1)
        params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), fmoe.shard(full, plan, mesh))
        tokens = tokens_of(mesh.sequence_index)
        with fmoe.collectives.counting() as sent:
            logits, balance, loads = forward(name, params, tokens, mesh)
        (summed_ce(logits, cp.shard(targets_of(tokens))) + balance).backward()
        grads = fmoe.tree.map_with_path(lambda _, t: t.grad, params)
        out.append({"mesh": repr(mesh), "batch": mesh.sequence_index, "logits": logits.detach(), "loads": loads,
                    "positions": cp.positions(S), "sent": dict(sent.by_kind),
                    "grads": fmoe.tree.flatten(fmoe.gather(grads))})
    return out


def _check(results: list, refs: tuple, what: str) -> None:
    logits, loads, grads = refs
    for rank, r in enumerate(results):
        w = f"{what} {r['mesh']} rank {rank}"
        close(r["logits"], logits[r["batch"]][:, r["positions"]], f"{w} logits", atol=ATOL)
        for a, b in zip(r["loads"], loads):
            close(a.float(), b.float(), f"{w} routed load")
        assert sorted(r["grads"]) == sorted(grads)
        for path, g in r["grads"].items():
            close(g, grads[path], f"{w} grad {path}", atol=ATOL)


def test_qwen3_moe_cp2_and_cp2_ep2_equal_one_process():
    results = on_ranks(_rank, 2, "qwen3_moe", [dict(cp=2), dict(cp=2, ep=2)], None, timeout=300)
    refs = reference("qwen3_moe", 1)
    for i in range(2):
        _check([per_rank[i] for per_rank in results], refs, "qwen3_moe")
    cfg = CFGS["qwen3_moe"]      # the K/V all-gather is counted: per layer k and v, the other rank's half
    kv = cfg.num_hidden_layers * 2 * B * (S // 2) * cfg.num_key_value_heads * cfg.head_dim * 4
    assert results[0][0]["sent"]["all_gather"] == kv, results[0][0]["sent"]


def test_qwen3_moe_cp4_cp2_tp2_sp_and_fsdp2_cp2_equal_one_process():
    meshes = [dict(cp=4, ep=4), dict(cp=2, tp=2, sp=True, ep=4), dict(cp=2, fsdp=2, ep=4)]
    results = on_ranks(_rank, 4, "qwen3_moe", meshes, None, timeout=300)
    _check([r[0] for r in results], reference("qwen3_moe", 1), "qwen3_moe")
    _check([r[1] for r in results], reference("qwen3_moe", 1), "qwen3_moe")
    _check([r[2] for r in results], reference("qwen3_moe", 2), "qwen3_moe")


@pytest.mark.parametrize("name,budget", [("deepseek_v3", None), ("gpt_oss", 64)])
def test_mla_and_a_sliding_window_across_chunks_cp2(name, budget):
    results = on_ranks(_rank, 2, name, [dict(cp=2)], budget, timeout=300)
    _check([r[0] for r in results], reference(name, 1), name)


def _refusals(rank: int, world: int) -> list:
    mesh, out = fmoe.Mesh(cp=2), []
    cfg = qwen3_moe.Config.tiny()
    params = qwen3_moe.init(cfg, 0)
    for call in (lambda: qwen3_moe.forward(params, torch.zeros(1, 6, dtype=torch.long), cfg, mesh),
                 lambda: qwen3_moe.forward(params, torch.zeros(1, 8, dtype=torch.long), cfg, mesh,
                                           cache=qwen3_moe.init_cache(cfg, 1, 16))):
        try:
            call()
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_bad_input_is_refused_in_one_line():
    errors = on_ranks(_refusals, 2)[0]
    assert "sequence length 6 must be divisible by 2 * cp = 4" in errors[0], errors
    assert "decoding with a cache" in errors[1], errors
    with pytest.raises(ValueError, match=r"cp 3 times tp 1 must divide|cp=3"):
        fmoe.mesh.check_layout(4, cp=3)
    assert fmoe.mesh.RankLayout(8, 5, cp=2, tp=2).ranks("cp") == [5, 7]


JOB = dict(model="qwen3_moe", preset="tiny", steps=2, batch=2, seq=16, warmup=1, quiet=True, eval_every=2)


@pytest.mark.parametrize("base,cp", [(dict(nproc=1), dict(nproc=2, cp=2, ep=2)),
                                     (dict(nproc=2, pp=2), dict(nproc=4, pp=2, cp=2, ep=2))])
def test_job_cp_losses_equal_without_cp(tmp_path, base, cp):
    """``fmoe train --cp 2`` (and ``--pp 2 --cp 2``): the losses, gradient norms, balance loss, expert
    loads and held-out loss of each step equal the job without cp on the same sequences."""
    fmoe.training.run(fmoe.training.JobConfig(out=str(tmp_path / "a"), **JOB, **base))
    fmoe.training.run(fmoe.training.JobConfig(out=str(tmp_path / "b"), **JOB, **cp))
    a, b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    assert [r["step"] for r in b] == [r["step"] for r in a] and len(a) >= 2
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "load_balance_loss", "eval_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5), (x["step"], key, x[key], y[key])
        if "expert_load" in x:
            assert y["expert_load"] == x["expert_load"]


@pytest.mark.parametrize("kw,match", [
    (dict(nproc=4, cp=3), r"--cp 3 times --tp 1 must divide --nproc 4"),
    (dict(nproc=2, cp=2, seq=10), r"--cp 2: context parallelism: --seq 10 must be divisible by 2 \* cp = 4"),
    (dict(nproc=2, cp=2, model=dataclasses.replace(qwen3_moe.MODEL, name="qwen3_no_cp", context_parallel=False)),
     r"--cp 2: model .*qwen3_no_cp.* does not declare context_parallel"),
])
def test_job_refuses_bad_cp_before_any_rank_starts(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        fmoe.training.run(fmoe.training.JobConfig(**{**JOB, **kw, "out": str(tmp_path / "x")}))
    assert not (tmp_path / "x").exists()
