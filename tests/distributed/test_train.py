"""Training: optimizer, global norm on meshes, N-step parity with one process, CLI, resume."""

import functools

import pytest
import torch

import fmoe
from fmoe import P
from helpers import on_ranks
from fmoe.training import step as step_module
from fmoe.optim import AdamWConfig, lr_at
from fmoe.optim.adamw import init as adamw_init
from fmoe.optim.adamw import step as adamw_step
from fmoe.optim.adamw import global_norm
from train_cases import train


def test_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    w = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    ref = [w["a"].clone().requires_grad_(True)]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    params = {"a": w["a"].clone()}
    state = adamw_init(params)
    for i in range(5):
        g = torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
        ref[0].grad = g.clone()
        opt.step()
        params, state, _ = adamw_step({"a": g}, state, params, lr=1e-2, cfg=AdamWConfig(max_grad_norm=None))
    torch.testing.assert_close(params["a"], ref[0].detach(), rtol=1e-6, atol=1e-7)


def test_lr_schedule_and_no_decay_for_vectors():
    assert lr_at(1, 1.0, 4, 10) == 0.25 and lr_at(4, 1.0, 4, 10) == 1.0
    assert abs(lr_at(10, 1.0, 4, 10) - 0.1) < 1e-12
    p = {"w": torch.ones(2, 2), "norm": torch.ones(2)}
    out, _, _ = adamw_step({"w": torch.zeros(2, 2), "norm": torch.zeros(2)}, adamw_init(p), p,
                           lr=0.1, cfg=AdamWConfig(weight_decay=0.5))
    assert torch.allclose(out["w"], torch.full((2, 2), 0.95)) and torch.equal(out["norm"], torch.ones(2))


def _norms(rank, world):
    full = {"col": torch.arange(24.0).view(8, 3), "experts": torch.arange(32.0).view(8, 2, 2) / 7,
            "rep": torch.ones(5), "fsdp": torch.arange(8.0), "packed": torch.arange(32.0).view(8, 4) / 3,
            "nested": torch.arange(8.0).view(8, 1)}
    want = float(torch.sqrt(sum(v.double().square().sum() for v in full.values())))
    out = []
    for tp, ep in [(2, 2), (2, 4), (1, 4), (4, 4)]:
        mesh = fmoe.Mesh(tp=tp, ep=ep)
        plan = {"col": P("tp", None), "experts": P("ep", "efsdp", None), "rep": P(),
                "fsdp": P("fsdp"), "packed": P("tp", "fsdp", packed=2), "nested": P(("fsdp", "tp"))}
        sh = fmoe.shard(full, fmoe.Plan({k: v for k, v in plan.items()}), mesh)
        out.append(float(global_norm(sh)))
        out.append(_reduce_inplace_ok(sh, mesh))
    return want, out


def _reduce_inplace_ok(sh, mesh):
    """reduce_grads leaves its input alone by default; inplace=True gives the same result."""
    from fmoe.training.grads import reduce_grads

    grads = fmoe.tree.map_with_path(lambda _, t: t + 1.0, sh)          # per-rank "gradients"
    before = {k: v.to_local().clone() for k, v in fmoe.tree.flatten(grads).items()}
    copy = fmoe.gather(reduce_grads(grads, sh, mesh))
    untouched = all(torch.equal(fmoe.tree.flatten(grads)[k].to_local(), v) for k, v in before.items())
    inplace = fmoe.gather(reduce_grads(grads, sh, mesh, inplace=True))
    same = all(torch.equal(copy[k], inplace[k]) for k in copy)
    return untouched and same


def test_global_norm_counts_every_element_once_on_every_mesh():
    """Also: reduce_grads(inplace=False) leaves the given gradients unchanged, inplace=True agrees."""
    for want, got in on_ranks(_norms, 4):
        for g in got[1::2]:
            assert g is True
        for g in got[::2]:
            assert abs(g - want) <= 1e-6 * want, (g, want)


def _train_meshes(rank, world, name, meshes, cfg=None):
    out = []
    for kw in meshes:
        mesh = fmoe.Mesh(**kw)
        counts = fmoe.fsdp.RegatherCounts()     # counted in the trainer's own regather context
        step_module.regather_in_backward = functools.partial(fmoe.fsdp.regather_in_backward, counts=counts)
        losses, norms, params = train(name, mesh, cfg=cfg)
        regathered = (counts.packed, counts.regathered)
        out.append((kw, mesh.num_batches, losses, norms, params, regathered, mesh.fsdp))
    return out


def compare(results, name, cfg=None):
    refs = {}
    for kw, nb, losses, norms, params, (packed, regathered), fsdp in results:
        if fsdp > 1:      # gathered FSDP weights were saved as recipes and gathered again in backward
            assert packed > 0 and regathered == packed, (kw, packed, regathered)
        if nb not in refs:
            refs[nb] = train(name, None, num_batches=nb, cfg=cfg)
        rl, rn, rp = refs[nb]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(rl), rtol=1e-5, atol=0, msg=f"{kw} losses")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(rn), rtol=1e-4, atol=0, msg=f"{kw} grad norms")
        for k in rp:
            # Adam divides by sqrt(v): float noise (~1e-7) in a gradient element that is itself
            # ~1e-7 can move that parameter by up to ~lr per step. So: almost every element to
            # 1e-5 (a hundredth of lr), and none further than lr/10 (3e-4).
            diff = (params[k] - rp[k]).abs()
            assert diff.max() <= 3e-4, (kw, k, diff.max().item())
            assert (diff > 1e-5).float().mean() <= 1e-3, (kw, k, (diff > 1e-5).sum().item(), diff.numel())


def test_llama_training_matches_single_process_on_four_ranks():
    meshes = [dict(tp=2), dict(tp=1), dict(tp=2, dp_replicate=2)]
    compare(on_ranks(_train_meshes, 4, "llama", meshes, timeout=600)[0], "llama")


def test_qwen3_moe_training_matches_single_process_on_four_ranks():
    meshes = [dict(tp=1, ep=4), dict(tp=2, ep=4), dict(tp=1, ep=2, dp_replicate=2), dict(tp=2, ep=2)]
    compare(on_ranks(_train_meshes, 4, "qwen3_moe", meshes, timeout=900)[0], "qwen3_moe")


@pytest.mark.slow
def test_qwen3_moe_training_reference_configs_on_eight_ranks():
    # the four eight-rank configurations of the reference, plus HSDP with efsdp > 1
    meshes = [dict(tp=4, ep=4), dict(tp=1, ep=4), dict(tp=2, ep=4), dict(tp=8, ep=8),
              dict(tp=2, ep=2, dp_replicate=2)]
    results = on_ranks(_train_meshes, 8, "qwen3_moe", meshes, timeout=1200)[0]
    assert [(kw, nb) for kw, nb, *_ in results] == [(meshes[0], 2), (meshes[1], 8), (meshes[2], 4),
                                                    (meshes[3], 1), (meshes[4], 4)]
    compare(results, "qwen3_moe")
