"""bf16 mixed precision, activation recomputation and gradient accumulation in the train step.

All on 4 gloo ranks (tp=2, ep=4: FSDP over 2, experts over 4), the layout the main job uses,
against the plain fp32 step:

- ``dtype="bf16"`` (bf16 weight copies cast once per step, every GEMM in bf16): master weights,
  gradients and AdamW moments stay fp32; after 30 steps the loss is within 0.03 (absolute, on a
  loss near 2.6) of fp32 training — bf16 keeps 8 bits of mantissa, so each matmul is off by
  ~0.4% relative and the runs drift apart slowly, while a wrong policy (bf16 masters, bf16
  moments, a lost gradient) ends far outside. The whole curve is held too: step 1 (same weights)
  within 2 bf16 roundings of the loss, the mean gap over the 30 steps below 0.015 and every gap
  below 0.15 (measured: mean 0.0035, one step at 0.05 where a near-tie between experts' scores
  routed tokens differently; such flips are why a per-step bound must be loose).
- ``remat="layer"`` / ``"moe"``: identical losses and parameters (recomputation replays the
  same ops), and less memory saved for backward (measured in one process).
- ``grad_accum=2`` over a batch of 2B rows: the same losses and parameters as one batch of 2B
  rows, to float noise (aux losses off: a batch-level load-balance loss is computed per
  micro-batch, which is a different objective).
"""

import dataclasses

import torch

import fmoe
from helpers import close, on_ranks

STEPS_BF16, STEPS, B, S = 30, 4, 2, 16


def _train(mesh, dtype="fp32", remat="none", grad_accum=1, steps=STEPS, aux=True, rows=B):
    from fmoe.data import TokenStream
    from fmoe.models import qwen3_moe
    from fmoe.fsdp import data_parallel_plan
    from fmoe.optim import AdamWConfig, lr_at
    from fmoe.optim.adamw import init as adamw_init
    from fmoe.training.step import StepConfig, train_step
    cfg = dataclasses.replace(qwen3_moe.MODEL.preset("tiny", mesh.tp), output_router_logits=aux, router_aux_loss_coef=0.01)
    full = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(True), qwen3_moe.init(cfg, seed=0))
    params = fmoe.shard(full, data_parallel_plan(qwen3_moe.check_plan(cfg, None, mesh.tp), full, mesh), mesh)
    state = adamw_init(params)
    data = TokenStream.stdlib(300_000)
    step_cfg = StepConfig(opt=AdamWConfig(max_grad_norm=1.0), dtype=dtype, remat=remat, grad_accum=grad_accum)
    losses = []
    for step in range(1, steps + 1):
        batch = data.batch(step, mesh.batch_index, rows, S, 0, num_batches=mesh.num_batches)
        params, state, m = train_step(qwen3_moe, cfg, params, state, batch, mesh=mesh, step_cfg=step_cfg,
                                      lr=lr_at(step, 3e-3, 2, steps))
        losses.append(m["loss"])
    dtypes = {str(t.dtype) for t in fmoe.tree.leaves(params)} | {str(t.dtype) for t in fmoe.tree.leaves(state["m"])} \
        | {str(t.dtype) for t in fmoe.tree.leaves(state["v"])}
    return losses, {k: v.detach() for k, v in fmoe.tree.flatten(fmoe.gather(params)).items()}, dtypes


def _all_variants(rank, world):
    mesh = fmoe.Mesh(tp=2, ep=4)
    out = {"fp32": _train(mesh, steps=STEPS_BF16), "bf16": _train(mesh, "bf16", steps=STEPS_BF16),
           "plain": _train(mesh), "layer": _train(mesh, remat="layer"), "moe": _train(mesh, remat="moe"),
           "big": _train(mesh, aux=False, rows=2 * B), "accum": _train(mesh, aux=False, rows=2 * B, grad_accum=2)}
    return out if rank == 0 else None


def test_bf16_remat_and_grad_accum_match_fp32_on_four_ranks():
    r = on_ranks(_all_variants, 4, timeout=900)[0]
    fp32, bf16 = r["fp32"][0], r["bf16"][0]
    print(f"loss after {STEPS_BF16} steps: fp32 {fp32[-1]:.5f} bf16 {bf16[-1]:.5f} (step 1: {fp32[0]:.4f})")
    assert r["bf16"][2] == {"torch.float32"} and r["fp32"][2] == {"torch.float32"}   # masters and moments fp32
    assert fp32[-1] < fp32[0] - 0.5 and bf16[-1] < bf16[0] - 0.5                   # both learn
    assert abs(bf16[-1] - fp32[-1]) < 0.03, (bf16[-1], fp32[-1])
    gaps = [abs(a - b) for a, b in zip(bf16, fp32)]
    print("bf16 - fp32 loss gap per step:", [round(g, 4) for g in gaps])
    assert gaps[0] < 2 * 2.0 ** -8 * fp32[0], gaps[0]                              # step 1: same weights, bf16 rounding
    assert sum(gaps) / len(gaps) < 0.015 and max(gaps) < 0.15, gaps               # the whole curve, not just its end
    assert bf16 != fp32                                                            # bf16 really computed
    for name in ("layer", "moe"):
        assert r[name][0] == r["plain"][0], name                                   # bitwise: same ops replayed
        assert all(torch.equal(r[name][1][k], r["plain"][1][k]) for k in r["plain"][1]), name
    big, accum = r["big"], r["accum"]
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(accum[0], big[0])), (accum[0], big[0])
    for k in big[1]:
        close(accum[1][k], big[1][k], k, rtol=1e-4)


def test_remat_saves_less_for_backward():
    from fmoe.models import qwen3_moe
    cfg = qwen3_moe.Config.small()
    params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(True), qwen3_moe.init(cfg))
    own = {t.untyped_storage().data_ptr() for t in fmoe.tree.leaves(params)}
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    saved = {}
    for policy in ("none", "layer", "moe"):
        seen = {}

        def pack(t):
            p = t.untyped_storage().data_ptr()
            if p not in own:
                seen[p] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fmoe.nn.remat.policy(policy):
            loss = fmoe.nn.cross_entropy(qwen3_moe.forward(params, tokens, cfg), tokens)
        saved[policy] = sum(seen.values())
        torch.autograd.grad(loss, fmoe.tree.leaves(params))
    print("saved for backward (bytes):", saved)
    assert saved["layer"] < 0.35 * saved["none"] and saved["moe"] < 0.75 * saved["none"], saved


def test_every_model_recomputes_to_the_same_loss_and_gradients():
    from fmoe.models import deepseek_v3, gpt_oss, llama, mixtral, qwen3_moe
    for model in (qwen3_moe, mixtral, gpt_oss, llama, deepseek_v3):
        cfg = model.Config.tiny()
        params = fmoe.tree.map_with_path(lambda p, t: t.requires_grad_(not p.endswith("expert_bias")), model.init(cfg))
        leaves = [t for t in fmoe.tree.leaves(params) if t.requires_grad]
        tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        out = {}
        for policy in ("none", "layer", "moe"):
            with fmoe.nn.remat.policy(policy):
                loss = fmoe.nn.cross_entropy(model.forward(params, tokens, cfg), tokens)
                out[policy] = (loss, torch.autograd.grad(loss, leaves))
        for policy in ("layer", "moe"):
            assert torch.equal(out[policy][0], out["none"][0]), (model.__name__, policy)
            assert all(torch.equal(a, b) for a, b in zip(out[policy][1], out["none"][1])), (model.__name__, policy)
