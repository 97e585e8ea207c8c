"""fmoe.optim: the pure AdamW over trees (the trainer's own), freezing by glob, and the compiled
whole step.

- ``adamw.update`` over a nested tree equals ``torch.optim.AdamW`` step by step (weight decay
  masked off for vectors as the trainer does), with a float lr or a tensor lr;
- a NaN gradient changes nothing (params, moments, step counter) and is reported as skipped;
- torch's fused kernel (fp32 leaves) and the tensor math (float64, bf16 stochastic rounding,
  transforms) are one update: fp32 equals float64 to fp32 precision with clipping active,
  ``donate`` equals the copying update bitwise, and the copying update leaves its inputs alone;
- ``mask`` / ``partition`` / ``combine`` / ``freeze`` select subtrees by glob, name unmatched
  globs, and a masked or partitioned-out subtree stays bitwise unchanged;
- the trainer's step runs this optimizer (one implementation);
- a whole step (``grad_and_value`` + ``update``) compiled with ``fullgraph=True`` equals eager
  (float64, 3 steps; the transform-matrix test runs it on all five models).
"""

import pytest
import torch
from torch.func import grad

import fmoe
from fmoe.optim import AdamWConfig, adamw, combine, freeze, mask, partition


def tree():
    g = torch.Generator().manual_seed(0)
    return {"layers": {"0": {"w": torch.randn(4, 3, generator=g), "norm": torch.randn(3, generator=g)}},
            "embed": torch.randn(5, 3, generator=g)}


@pytest.mark.parametrize("lr", [1e-2, torch.tensor(1e-2)], ids=["float", "tensor"])
def test_update_equals_torch_adamw_over_a_tree(lr):
    params = tree()
    flat = fmoe.tree.flatten(params)
    ref = {k: v.clone().requires_grad_() for k, v in flat.items()}
    groups = [{"params": [ref[k] for k in flat if flat[k].ndim >= 2], "weight_decay": 0.1},
              {"params": [ref[k] for k in flat if flat[k].ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    state = adamw.init(params)
    cfg = AdamWConfig(max_grad_norm=None)
    for i in range(4):
        grads = fmoe.tree.map_with_path(
            lambda p, t: torch.randn(t.shape, generator=torch.Generator().manual_seed(i * 10 + len(p))), params)
        for k, g in fmoe.tree.flatten(grads).items():
            ref[k].grad = g.clone()
        opt.step()
        params, state = adamw.update(grads, state, params, lr=lr, cfg=cfg)
    assert int(state["step"]) == 4
    for k, v in fmoe.tree.flatten(params).items():
        torch.testing.assert_close(v, ref[k].detach(), rtol=1e-6, atol=1e-7)


def test_non_finite_gradient_changes_nothing():
    params = tree()
    state = adamw.init(params)
    params, state = adamw.update(fmoe.tree.map_with_path(lambda _, t: torch.ones_like(t), params), state, params, lr=0.1)
    bad = fmoe.tree.map_with_path(lambda p, t: torch.full_like(t, float("nan") if p == "embed" else 1.0), params)
    new, new_state, stats = adamw.step(bad, state, params, lr=0.1)
    assert bool(stats["skipped"]) and int(new_state["step"]) == 1
    for a, b in zip(fmoe.tree.leaves((new, new_state)), fmoe.tree.leaves((params, state))):
        assert torch.equal(a, b)


def test_fused_kernel_and_tensor_math_are_one_update():
    p64 = fmoe.tree.map_with_path(lambda _, t: t.double(), tree())
    s64 = adamw.init(p64)
    p32, s32 = fmoe.tree.map_with_path(lambda _, t: t.float(), p64), adamw.init(tree())
    cfg = AdamWConfig(max_grad_norm=0.5)                 # the clip scale is active: norms are ~4
    for i in range(3):
        g64 = fmoe.tree.map_with_path(
            lambda p, t: torch.randn(t.shape, generator=torch.Generator().manual_seed(i * 10 + len(p)),
                                     dtype=torch.float64), p64)
        g32 = fmoe.tree.map_with_path(lambda _, t: t.float(), g64)
        frozen = [t.clone() for t in fmoe.tree.leaves((g32, s32, p32))]
        copied, copied_s, stats = adamw.step(g32, s32, p32, lr=1e-2, cfg=cfg)
        assert float(stats["clip_scale"]) < 0.5
        for a, b in zip(fmoe.tree.leaves((g32, s32, p32)), frozen):      # inputs untouched
            assert torch.equal(a, b)
        p32, s32, _ = adamw.step(g32, s32, p32, lr=1e-2, cfg=cfg, donate=True)
        for a, b in zip(fmoe.tree.leaves((copied, copied_s)), fmoe.tree.leaves((p32, s32))):
            assert torch.equal(a, b)
        p64, s64, _ = adamw.step(g64, s64, p64, lr=1e-2, cfg=cfg)
    # fp32 rounding of ~10 elementwise ops per step, 3 steps, on values of size ~1: well under 1e-5
    for k, v in fmoe.tree.flatten(p32).items():
        torch.testing.assert_close(v.double(), fmoe.tree.flatten(p64)[k], rtol=1e-5, atol=1e-6)


def test_freeze_by_glob():
    params = tree()
    m = mask(params, "layers.*.norm")
    assert fmoe.tree.flatten(m) == {"embed": True, "layers.0.norm": False, "layers.0.w": True}
    with pytest.raises(ValueError, match=r"glob\(s\) \['nothing.\*'\] match no leaf"):
        mask(params, "nothing.*")
    with pytest.raises(TypeError, match="globs must be one or more non-empty strings"):
        mask(params)
    frozen, train = partition(params, "layers.**")
    assert fmoe.tree.paths(frozen) == ["layers.0.norm", "layers.0.w"] and fmoe.tree.paths(train) == ["embed"]
    with pytest.raises(ValueError, match="'embed' is in more than one tree"):
        combine(train, train)
    # torch.func: differentiate the trainable part only; the frozen part is left exactly as is
    loss = lambda tr, fr: sum(t.square().sum() for t in fmoe.tree.leaves(combine(tr, fr)))  # noqa: E731
    g = grad(loss)(train, frozen)
    new_train, _ = adamw.update(g, adamw.init(train), train, lr=0.1)
    whole = combine(new_train, frozen)
    assert torch.equal(fmoe.tree.flatten(whole)["layers.0.w"], params["layers"]["0"]["w"])
    assert not torch.equal(whole["embed"], params["embed"])
    # mask=: the same update over the whole tree
    full_g = fmoe.tree.map_with_path(lambda _, t: 2 * t, params)
    masked, _ = adamw.update(full_g, adamw.init(params), params, lr=0.1, mask=m)
    assert torch.equal(masked["layers"]["0"]["norm"], params["layers"]["0"]["norm"])
    assert not torch.equal(masked["layers"]["0"]["w"], params["layers"]["0"]["w"])
    # freeze: .backward() leaves frozen leaves without gradient
    live = freeze(fmoe.tree.map_with_path(lambda _, t: t.clone().requires_grad_(), params), "embed")
    assert not live["embed"].requires_grad and live["layers"]["0"]["w"].requires_grad


def test_the_trainer_uses_this_optimizer():
    import fmoe.training.step as step
    assert step.adamw is adamw
