"""The optimizer step inside backward (``--optim-in-backward``, fmoe.training.optim_backward):
the same parameters, moments, losses and gradient norms as the normal step, on one process and
on gloo meshes, with and without clipping; fewer gradient bytes alive at once; the refused
combinations named before any rank starts."""

import dataclasses

import pytest
import torch

import fmoe
from fmoe.optim import AdamWConfig, lr_at
from fmoe.optim.adamw import init as adamw_init
from fmoe.training.step import StepConfig, train_step
from helpers import close, on_ranks
from train_cases import B, LR, S, corpus, model_and_cfg, read_log, sharded_for_training, train_cli

STEPS = 3
CASES = {"clip": StepConfig(opt=AdamWConfig(max_grad_norm=0.5)),              # two passes, clipping active
         "no clip": StepConfig(opt=AdamWConfig(max_grad_norm=None)),           # one pass
         "no clip, grad_accum 2": StepConfig(opt=AdamWConfig(max_grad_norm=None), grad_accum=2),
         "clip, remat layer": StepConfig(opt=AdamWConfig(max_grad_norm=0.5), remat="layer")}


def _train(name, mesh, step_cfg, steps=STEPS):
    """``steps`` steps on ``mesh`` (None: one process); (losses, norms, gathered params, moments)."""
    model, cfg = model_and_cfg(name)
    mesh_ = mesh or fmoe.Mesh()
    if mesh is None:
        params = fmoe.tree.map_with_path(lambda p, t: t.detach().requires_grad_(not p.endswith("expert_bias")),
                                         model.init(cfg, seed=0))
    else:
        params = sharded_for_training(model, cfg, mesh)[0]
    state, data = adamw_init(params), corpus()
    losses, norms = [], []
    for step in range(1, steps + 1):
        tokens, targets = data.batch(step, mesh_.batch_index, B * step_cfg.grad_accum, S, seed=0)
        params, state, m = train_step(model, cfg, params, state, (tokens, targets), mesh=mesh_, step_cfg=step_cfg,
                                      lr=lr_at(step, LR, 1, steps))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        assert m["skipped"] is False
    flat = lambda t: {k: v.detach() for k, v in fmoe.tree.flatten(fmoe.gather(t)).items()}  # noqa: E731
    return losses, norms, flat(params), flat({"m": state["m"], "v": state["v"]}), int(state["step"])


def _compare(a, b, what):
    close(torch.tensor(a[0]), torch.tensor(b[0]), f"{what}: losses")
    close(torch.tensor(a[1]), torch.tensor(b[1]), f"{what}: grad norms")
    for k in a[2]:
        close(b[2][k], a[2][k], f"{what}: param {k}")
    for k in a[3]:
        close(b[3][k], a[3][k], f"{what}: moment {k}")
    assert a[4] == b[4] == STEPS, what


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_equals_the_normal_step(case):
    normal = CASES[case]
    _compare(_train("qwen3_moe", None, normal),
             _train("qwen3_moe", None, dataclasses.replace(normal, optim_in_backward=True)), case)


def _on_mesh(rank, world, name, tp, ep, case):
    mesh = fmoe.Mesh(tp=tp, ep=ep)
    normal = CASES[case]
    return _train(name, mesh, normal), _train(name, mesh, dataclasses.replace(normal, optim_in_backward=True))


@pytest.mark.parametrize("world,tp,ep,case", [(2, 1, 1, "clip"), (2, 1, 2, "no clip"), (4, 2, 2, "clip"),
                                              (4, 1, 4, "no clip, grad_accum 2")],
                         ids=["fsdp2-clip", "ep2-noclip", "tp2xfsdp2xep2-clip", "fsdp4xep4-accum2"])
def test_ranks_equal_the_normal_step(world, tp, ep, case):
    """fsdp2, ep2, tp2 x fsdp2 x ep2, ep4: the gathered parameters and moments after 3 steps, the
    losses and gradient norms equal the normal step's on the same mesh (fp32)."""
    for normal, oib in on_ranks(_on_mesh, world, "qwen3_moe", tp, ep, case, timeout=300):
        _compare(normal, oib, f"tp{tp} ep{ep} on {world} ranks, {case}")


def _live_grads(name, step_cfg):
    """The most gradient bytes alive at once during one step, measured by the dry run's tracker
    (fmoe.memory.tracker.StepTracker), and the bytes of the full gradient."""
    from fmoe.memory.tracker import StepTracker

    model, cfg = model_and_cfg(name)
    params = fmoe.tree.map_with_path(lambda p, t: t.detach().requires_grad_(not p.endswith("expert_bias")),
                                     model.init(cfg, seed=0))
    full = sum(t.numel() * t.element_size() for t in fmoe.tree.leaves(params) if t.requires_grad)
    tokens, targets = corpus().batch(1, 0, B, S, seed=0)
    tracker = StepTracker()
    tracker.tag(params, "params")
    with tracker:
        train_step(model, cfg, params, adamw_init(params), (tokens, targets), mesh=fmoe.Mesh(), step_cfg=step_cfg,
                   lr=1e-3)
    return tracker.max_grads_bytes, full


@pytest.mark.parametrize("clip", [0.5, None])
def test_gradients_never_coexist(clip):
    """The normal step holds the full gradient at once; inside backward at most a layer's worth
    (and the layers whose backward is running) is alive: measured below half of it (4 layers)."""
    normal = StepConfig(opt=AdamWConfig(max_grad_norm=clip))
    peak, full = _live_grads("qwen3_moe", normal)
    assert peak >= full, (peak, full)                    # the measure sees the normal step's gradients
    peak, full = _live_grads("qwen3_moe", dataclasses.replace(normal, optim_in_backward=True))
    assert 0 < peak < full / 2, (peak, full)


def test_refused_with_clip_and_grad_accum_or_compile():
    with pytest.raises(ValueError, match="--clip 0.5 and --grad-accum 2"):
        _train("qwen3_moe", None, StepConfig(opt=AdamWConfig(max_grad_norm=0.5), grad_accum=2,
                                             optim_in_backward=True), steps=1)
    with pytest.raises(ValueError, match="--clip 0.5 and --compile"):
        _train("qwen3_moe", None, StepConfig(opt=AdamWConfig(max_grad_norm=0.5), compile="aot_eager",
                                             optim_in_backward=True), steps=1)


def test_compiled_one_pass_equals_the_normal_step():
    """``--clip 0 --compile``: the compiled one-process step with the update inside backward."""
    normal = StepConfig(opt=AdamWConfig(max_grad_norm=None), compile="aot_eager")
    _compare(_train("qwen3_moe", None, normal), _train("qwen3_moe", None,
                                                       dataclasses.replace(normal, optim_in_backward=True)), "compiled")


BASE = ("--model", "qwen3_moe", "--preset", "tiny", "--steps", "3", "--batch", "2", "--seq", "16", "--warmup", "1",
        "--quiet")


def test_job_losses_equal_step_by_step(tmp_path):
    """``fmoe train --optim-in-backward`` on 2 ranks (ep2) logs the losses and gradient norms of
    the run without it, step by step; with --clip 0 (one pass) too."""
    for extra in ((), ("--clip", "0")):
        rows = {}
        for flag in ((), ("--optim-in-backward",)):
            out = str(tmp_path / f"run{len(extra)}{len(flag)}")
            train_cli(*BASE, "--nproc", "2", "--ep", "2", *extra, *flag, "--out", out)
            rows[flag] = [r for r in read_log(out) if "loss" in r and "step" in r]
        a, b = rows[()], rows[("--optim-in-backward",)]
        assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
        close(torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]), f"losses {extra}")
        close(torch.tensor([r["grad_norm"] for r in b]), torch.tensor([r["grad_norm"] for r in a]), f"norms {extra}")


@pytest.mark.parametrize("flags,message", [
    (("--grad-accum", "2"), "--optim-in-backward with --clip 1.0 and --grad-accum 2"),
    (("--nproc", "2", "--pp", "2"), "--optim-in-backward with --pp 2"),
    (("--compile",), "--optim-in-backward with --clip 1.0 and --compile")])
def test_job_refuses_before_any_rank_starts(tmp_path, flags, message):
    out = train_cli(*BASE, "--optim-in-backward", *flags, "--out", str(tmp_path / "run"), check=False)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "log.jsonl").exists()


def test_the_job_hands_the_flag_to_the_step(tmp_path):
    from fmoe.training import JobConfig
    from fmoe.training.options import step_options
    from fmoe.training.resolve import resolve

    job = resolve(JobConfig(model="qwen3_moe", preset="tiny", optim_in_backward=True, out=str(tmp_path / "run")))
    assert step_options(job)["optim_in_backward"] is True
