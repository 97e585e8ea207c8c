"""Pipeline parallelism (``fmoe.Mesh(pp=n)``, ``fmoe train --pp N --microbatches M``): the same
numbers as the run without a pipeline that reads the same rows with the same micro-batching
(``--grad-accum M`` of ``--batch / M`` rows), step by step, on every mesh a stage can hold.

The step-level cases compare, after 2 AdamW steps (fp32, clipping active), the losses, the
gradient norms, every parameter and both moments: the first moment after a step is
``(1 - beta1) * grad``, so equal moments are equal gradients (a gradient-scale bug in the stage
exchange, a micro-batch counted twice, an aux loss added on two stages would all show here).
"""

import dataclasses

import pytest
import torch

import fmoe
from fmoe.fsdp import data_parallel_plan
from fmoe.optim import lr_at
from fmoe.optim.adamw import init as adamw_init
from fmoe.training import JobConfig
from fmoe.training.job import JobConfigError
from fmoe.mesh import stage_layers
from fmoe.training.pipeline import schedule, stage_plan, stage_tree
from fmoe.training.step import train_step
from helpers import close, on_ranks
from train_cases import LR, S, STEP_CFG, corpus, model_and_cfg, read_log

STEPS, ROWS = 2, 2            # rows per micro-batch


def _train(name, mesh, micro, schedule_name="1f1b", steps=STEPS, eps=None, router=None):
    """``steps`` steps of ``micro`` micro-batches of ``ROWS`` rows each on ``mesh`` (None: one
    process, ``grad_accum=micro``). Returns (losses, norms, this rank's gathered leaves and
    moments by path, the last step's metrics). ``eps``: AdamW's, for a mesh that sums in
    another order (sequence parallelism): with ``eps=1`` an update is ~``lr * m``, linear in the
    gradient, where the default eps turns a 1e-9 gradient's rounding into a whole ``lr`` step."""
    model, cfg = model_and_cfg(name)
    mesh_ = mesh or fmoe.Mesh()
    full = fmoe.tree.map_with_path(lambda p, t: t.detach().requires_grad_(not p.endswith("expert_bias")),
                                   model.init(cfg, seed=0))
    params = full
    if mesh is not None:
        plan = stage_plan(data_parallel_plan(model.plan(cfg), full, mesh), full, mesh.stage, mesh.pp)
        params = fmoe.shard(stage_tree(full, mesh.stage, mesh.pp), plan, mesh)
    step_cfg = dataclasses.replace(STEP_CFG, grad_accum=micro, pp_schedule=schedule_name, router=router)
    if eps is not None:
        step_cfg = dataclasses.replace(step_cfg, opt=dataclasses.replace(step_cfg.opt, eps=eps))
    state, data, losses, norms = adamw_init(params), corpus(), [], []
    for step in range(1, steps + 1):
        batch = data.batch(step, mesh_.sequence_index, ROWS * micro, S, seed=0)   # a cp group's sequences
        params, state, m = train_step(model, cfg, params, state, batch, mesh=mesh_, step_cfg=step_cfg,
                                      lr=lr_at(step, LR, 1, steps))
        losses.append(m["loss"] + m.get("load_balance_loss", 0.0))
        norms.append(m["grad_norm"])
    flat = lambda t: {k: v.detach() for k, v in fmoe.tree.flatten(fmoe.gather(t)).items()}  # noqa: E731
    return losses, norms, {**flat(params), **flat({"m": state["m"], "v": state["v"]})}, m


def _on_mesh(rank, world, name, micro, schedule_name, sizes, eps=None, router=None):
    return _train(name, fmoe.Mesh(**sizes), micro, schedule_name, eps=eps, router=router)


def _compare(ref, ranks, what, metrics=("expert_load",)):
    """Every rank's losses and norms equal the reference's; the ranks' leaves together are the
    reference's leaves, each equal; the log's routing entries cover every layer, equal."""
    losses, norms, leaves, last = ref
    seen = {}
    for r_losses, r_norms, r_leaves, r_last in ranks:
        close(torch.tensor(r_losses), torch.tensor(losses), f"{what}: losses")
        close(torch.tensor(r_norms), torch.tensor(norms), f"{what}: grad norms")
        for k in metrics:
            assert r_last.get(k) == last.get(k), (what, k, r_last.get(k), last.get(k))
        assert len(r_last["pp_idle"]) == 2 and all(0.0 <= f < 1.0 for f in r_last["pp_idle"]), r_last["pp_idle"]
        for k, v in r_leaves.items():
            close(v, leaves[k], f"{what}: {k}")
            seen[k] = True
    assert sorted(seen) == sorted(leaves), (what, sorted(set(leaves) - set(seen)))


@pytest.mark.parametrize("name,micro,schedule_name", [("qwen3_moe", 2, "1f1b"), ("qwen3_moe", 4, "gpipe"),
                                                      ("qwen3_moe", 3, "1f1b"), ("llama", 2, "gpipe")])
def test_pp2_equals_one_process_grad_accum(name, micro, schedule_name):
    """pp2 (one layer per stage) with 1F1B and GPipe, 2 to 4 micro-batches, MoE and dense:
    equal to one process with ``grad_accum`` = the micro-batches. AdamW's ``eps=1`` (see
    :func:`_train`): the stages sum the micro-batches in another order, and with the default eps
    one near-zero gradient's rounding became a whole ``lr`` step (qwen3_moe 1F1B, AMD EPYC:
    ``embed`` off by 3.9e-6 at scale 0.087, one element of 16384, on 8dd300a too)."""
    ref = _train(name, None, micro, eps=1.0)
    _compare(ref, on_ranks(_on_mesh, 2, name, micro, schedule_name, dict(pp=2), 1.0, timeout=300),
             f"{name} pp2 {schedule_name}")


def test_pp2_olmoe_equals_one_process_grad_accum():
    """OLMoE on pp2 (the conformance suite checks its other meshes), with AdamW's ``eps=1`` (see
    :func:`_train`): with the default eps the rounding of a near-zero gradient (micro-batches
    summed in another order) became a whole ``lr`` step, one element of 4096 of
    ``layers.0.attn.wq`` off by 2e-5 of its scale."""
    ref = _train("olmoe", None, 2, eps=1.0)
    _compare(ref, on_ranks(_on_mesh, 2, "olmoe", 2, "1f1b", dict(pp=2), 1.0, timeout=300), "olmoe pp2 1f1b")


def test_pp2_ep2_equals_the_ep2_run():
    """pp2 x ep2 on 4 ranks (each stage: fsdp2 with its experts on ep2): equal to the 2-rank
    ep2 run that reads the same two data-parallel batches with the same micro-batches."""
    ref = on_ranks(_on_mesh, 2, "qwen3_moe", 2, "1f1b", dict(ep=2), timeout=300)
    ranks = on_ranks(_on_mesh, 4, "qwen3_moe", 2, "1f1b", dict(pp=2, ep=2), timeout=300)
    close(torch.tensor(ref[0][0]), torch.tensor(ref[1][0]), "ep2: the ranks agree")
    merged = (ref[0][0], ref[0][1], {**ref[0][2], **ref[1][2]}, ref[0][3])
    _compare(merged, ranks, "pp2 x ep2")


def _first_half(logits):
    """Top-2 among the first half of the experts (ep rank 0's): ep rank 1 receives no token."""
    E = logits.shape[-1]
    return fmoe.routing.topk(2)(logits.masked_fill(torch.arange(E) >= E // 2, float("-inf")))


def test_pp2_ep2_with_an_empty_expert_slice_equals_the_ep2_run():
    """pp2 x ep2 where every token goes to ep rank 0's experts (ep rank 1's slice is empty in
    both stages, forward and backward): equal to the ep2 run with the same router."""
    ref = on_ranks(_on_mesh, 2, "qwen3_moe", 2, "gpipe", dict(ep=2), None, _first_half, timeout=300)
    ranks = on_ranks(_on_mesh, 4, "qwen3_moe", 2, "gpipe", dict(pp=2, ep=2), None, _first_half, timeout=300)
    E = len(ref[0][3]["expert_load"][0])
    assert all(sum(load[E // 2:]) == 0 < sum(load) for load in ref[0][3]["expert_load"])   # really empty
    merged = (ref[0][0], ref[0][1], {**ref[0][2], **ref[1][2]}, ref[0][3])
    _compare(merged, ranks, "pp2 x ep2, empty slice")


def test_pp2_tp2_sp_equals_one_process():
    """pp2 x tp2 with sequence parallelism (the stages pass the residual stream's sequence
    shard): equal to one process (AdamW with eps=1: sequence parallelism sums in another order)."""
    ref = _train("qwen3_moe", None, 2, eps=1.0)
    _compare(ref, on_ranks(_on_mesh, 4, "qwen3_moe", 2, "1f1b", dict(pp=2, tp=2, sp=True), 1.0, timeout=300),
             "pp2 x tp2 sp")


def test_pp2_cp2_equals_one_process():
    """pp2 x cp2 on 4 ranks (each stage's two ranks split every sequence in head and tail chunks,
    attention gathers K/V, the experts on ep2 over the cp ranks): equal to one process, every
    parameter and both moments after each step (AdamW with eps=1: the cp ranks sum a sequence's
    pieces in another order)."""
    ref = _train("qwen3_moe", None, 2, eps=1.0)
    _compare(ref, on_ranks(_on_mesh, 4, "qwen3_moe", 2, "1f1b", dict(pp=2, cp=2, ep=2), 1.0, timeout=300),
             "pp2 x cp2")


@pytest.mark.slow
def test_pp2_fsdp2_ep2_on_8_ranks_equals_the_4_rank_run():
    """pp2 x dp_replicate2 x fsdp2 with the experts on ep2 on 8 ranks: equal to the same 4-rank
    stage mesh (HSDP 2 x 2, ep2) without the pipeline."""
    ref = on_ranks(_on_mesh, 4, "qwen3_moe", 2, "gpipe", dict(dp_replicate=2, ep=2), timeout=600)
    merged = (ref[0][0], ref[0][1], {k: v for r in ref for k, v in r[2].items()}, ref[0][3])
    _compare(merged, on_ranks(_on_mesh, 8, "qwen3_moe", 2, "1f1b", dict(pp=2, dp_replicate=2, ep=2), timeout=600),
             "pp2 x dp_replicate2 x fsdp2 x ep2")


def test_stages_and_schedules():
    assert stage_layers(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(ValueError, match="pp=4 must divide the model's 6 decoder layers"):
        stage_layers(6, 4)
    assert stage_layers(6, 3, [1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
    with pytest.raises(ValueError, match=r"pp_layers \[3, 2\] must be 2 layer counts >= 1 summing to the model's 6"):
        stage_layers(6, 2, [3, 2])
    for name in ("1f1b", "gpipe"):
        for pp in (2, 3, 4):
            for stage in range(pp):
                order = schedule(name, stage, pp, 5)
                assert sorted(order) == sorted([("F", m) for m in range(5)] + [("B", m) for m in range(5)])
                assert [m for k, m in order if k == "B"] == list(range(5))          # backwards in order
                assert all(order.index(("F", m)) < order.index(("B", m)) for m in range(5))
                if name == "1f1b":             # at most pp - stage micro-batches in flight
                    live = peak = 0
                    for k, _ in order:
                        live += 1 if k == "F" else -1
                        peak = max(peak, live)
                    assert peak == min(pp - stage, 5), (stage, pp, peak)
    tree = {"embed": 0, "layers": [1, 2, 3, 4], "norm": 5, "lm_head": 6}
    assert stage_tree(tree, 1, 2) == {"layers": [None, None, 3, 4], "norm": 5, "lm_head": 6}


JOB = dict(model="qwen3_moe", preset="tiny", steps=4, seq=16, warmup=1, quiet=True, eval_every=2, save_every=2)


def test_job_pp2_equals_its_grad_accum_twin_and_resumes_anywhere(tmp_path):
    """``fmoe train --pp 2 --nproc 2 --batch 4`` (1F1B and GPipe, 2 micro-batches) logs the
    losses, gradient norms, routing and held-out entries of ``--batch 2 --grad-accum 2`` on one
    process, step by step; its step-2 checkpoint resumed on one process (and on pp2 again)
    continues with the same losses; its export equals the twin's."""
    from safetensors.torch import load_file

    twin, runs = tmp_path / "twin", {s: tmp_path / s for s in ("1f1b", "gpipe")}
    fmoe.training.run(JobConfig(out=str(twin), batch=2, grad_accum=2, export_hf=str(tmp_path / "hf_twin"), **JOB))
    for s, out in runs.items():
        fmoe.training.run(JobConfig(out=str(out), batch=4, nproc=2, pp=2, pp_schedule=s,
                                    export_hf=str(tmp_path / f"hf_{s}") if s == "1f1b" else None, **JOB))
    ref = read_log(twin)
    keys = ("loss", "grad_norm", "load_balance_loss", "expert_load", "maxvio", "eval_loss", "eval_maxvio")
    for s, out in runs.items():
        rows = read_log(out)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for a, b in zip(ref, rows):
            for k in keys:
                same = (torch.tensor(b[k], dtype=torch.float64), torch.tensor(a[k], dtype=torch.float64)) \
                    if k in a else None
                assert k not in b if same is None else torch.allclose(*same, rtol=1e-5, atol=0), \
                    (s, a["step"], k, a.get(k), b.get(k))
    for resumed, flags in (("one", dict(nproc=1)), ("pp", dict(nproc=2, pp=2))):
        fmoe.training.run(JobConfig(out=str(tmp_path / resumed), resume=str(runs["1f1b"] / "step-2"), steps=4,
                                    quiet=True, **flags))
        rows = read_log(tmp_path / resumed)
        assert [r["step"] for r in rows] == [3, 4]
        for a, b in zip(ref[2:], rows):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(
                a["grad_norm"], rel=1e-5), (resumed, a["step"])
    a = {k: v for f in (tmp_path / "hf_twin").glob("*.safetensors") for k, v in load_file(f).items()}
    b = {k: v for f in (tmp_path / "hf_1f1b").glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(a) == sorted(b)
    for k in a:
        close(b[k], a[k], f"export {k}")


def test_job_uneven_stages_with_expert_bias(tmp_path):
    """DeepSeek-V3 (3 layers: dense, then MoE with the aux-loss-free expert bias) on stages of 2
    and 1 layers (``--pp-layers 2,1``) logs the losses, gradient norms and bias sizes of its
    ``--grad-accum`` twin."""
    job = dict(model="deepseek_v3", preset="tiny", steps=3, seq=16, warmup=1)
    fmoe.training.run(JobConfig(out=str(tmp_path / "twin"), batch=2, grad_accum=2, quiet=True, **job))
    fmoe.training.run(JobConfig(out=str(tmp_path / "pp"), batch=4, nproc=2, pp=2, pp_layers="2,1",   # prints its plan
                                memory_gb=1e3, **job))
    for a, b in zip(read_log(tmp_path / "twin"), read_log(tmp_path / "pp"), strict=True):
        for k in ("loss", "grad_norm", "expert_bias_absmax", "expert_load"):
            assert torch.allclose(torch.tensor(b[k], dtype=torch.float64), torch.tensor(a[k], dtype=torch.float64),
                                  rtol=1e-5, atol=0), (a["step"], k, a[k], b[k])


@pytest.mark.parametrize("flags,message", [
    (dict(pp=3, nproc=3, microbatches=2, batch=4), "--pp 3 must divide model qwen3_moe's 2 decoder layers"),
    (dict(pp=2, nproc=3), r"--nproc 3 must be divisible by --pp 2 \(pipeline stages of equal size\)"),
    (dict(pp=2, nproc=2, pp_layers="2,1"), "--pp-layers '2,1' must be 2 comma-separated layer counts >= 1 .* summing "
                                           "to model qwen3_moe's 2 decoder layers"),
    (dict(pp_layers="1,1"), "--pp-layers 1,1 sizes the stages of a pipeline; it needs --pp > 1"),
    (dict(pp=2, nproc=2, microbatches=3, batch=4), "--microbatches 3 must divide --batch 4"),
    (dict(pp=2, nproc=2, batch=3), r"--microbatches 2 \(the default: --pp\) must divide --batch 3"),
    (dict(microbatches=2), "--microbatches 2 splits the batch of a pipeline; it needs --pp > 1"),
    (dict(pp=2, nproc=2, grad_accum=2), "--grad-accum 2 with --pp 2: the pipeline's micro-batches are the accumulation"),
    (dict(pp=2, nproc=2, balance="global_aux"), "--balance global_aux with --pp 2"),
    (dict(sp=True, nproc=2), r"--sp \(sequence parallelism\) .* it needs --tp > 1, got --tp 1"),
    (dict(sp=True, nproc=2, tp=2, seq=15), "it must also divide --seq 15"),
], ids=["layers", "nproc", "pp-layers", "pp-layers-without-pp", "microbatches", "default-microbatches", "microbatches-without-pp", "grad-accum",
        "global-aux", "sp-without-tp", "sp-seq"])
def test_bad_input_fails_before_any_rank_starts(tmp_path, flags, message):
    with pytest.raises(JobConfigError, match=message):
        fmoe.training.run(JobConfig(model="qwen3_moe", preset="tiny", out=str(tmp_path / "x"), **flags))
    assert not (tmp_path / "x").exists()          # nothing started: no run directory
