"""torch.func transforms and torch.compile over fmoe: every claim of the README's "Transforms" table.

One process (both expert matmul paths, ``grouped`` and ``loop``):
- ``vmap`` over stacked parameter trees (an ensemble) equals separate forwards; ``vmap(grad)``
  per-example gradients equal a loop; ``vmap`` over ``x`` of ``fmoe.moe``;
- ``jvp``/``jacfwd``/``hessian`` of ``fmoe.moe`` equal ``jacrev`` (and ``jvp`` equals central
  finite differences in float64);
- data-dependent input checks still raise in eager mode and do not break ``vmap``;
- ``torch.compile(forward, fullgraph=True)``, fp32 and bf16: logits and every gradient equal eager.

Four gloo ranks, meshes tp1/ep4, tp2/ep4, tp2/ep2 (efsdp 2), dp_replicate 2:
- ``fmoe.gather`` of ``torch.func.grad`` / ``grad_and_value`` / ``vjp`` and of ``.backward()``
  gradients equals the single-process gradient of the SUM of the distinct batches' losses (fp32,
  1e-5 relative), every leaf; also for ``load_hf(..., mesh=...)`` output and an FSDP plan;
- gradient placements are honest: ``Partial`` exactly on the axes whose batches are not summed
  yet, and every ``Replicate`` claim is true (the local values agree across that axis);
- ``jvp`` of ``fmoe.moe`` equals one process; compiled forward + backward equals eager, with
  graph breaks only at the dispatch's one host sync per MoE layer.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.func import grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vjp, vmap

import fmoe
import fmoe.nn as nn
from fmoe import P, Plan
from fmoe.mesh import DATA_AXES
from fmoe.models import qwen3_moe
from fmoe.routing import Routing
from helpers import close, on_ranks

MATMULS = ["grouped", "loop"]
B, S = 2, 6


def near(a, b, what, rtol=1e-5):
    """``helpers.close`` at ``rtol``, an element that cancels allowed ``rtol`` of the scale."""
    close(a, b, what, rtol=rtol, atol=rtol)


def moe_params(e=4, d=8, i=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(e, d, generator=g).to(dtype),
            "w_gate_up": (torch.randn(e, 2 * i, d, generator=g) / d ** 0.5).to(dtype),
            "w_down": (torch.randn(e, d, i, generator=g) / i ** 0.5).to(dtype)}


def layer(matmul, mesh=None, impl="auto", router=None):
    router = router or fmoe.routing.topk(2)
    return lambda p, x: fmoe.moe(p, x, router=router, mesh=mesh, impl=impl, matmul=matmul)[0]


def softmax_top2(logits):
    """Softmax top-2 in the logits' own dtype (fmoe's routers compute in fp32: no fp64 check)."""
    w, ids = torch.softmax(logits, -1).topk(2, dim=-1)
    return Routing(w, ids, {})


def lm_loss(cfg, tokens, mesh=None):
    return lambda p: nn.cross_entropy(qwen3_moe.forward(p, tokens, cfg, mesh)[:, :-1], tokens[:, 1:])


def tokens_of(cfg, b):
    return torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(100 + b))


# ------------------------------------------------------------------------------ one process: vmap
@pytest.mark.parametrize("matmul", MATMULS)
def test_vmap_over_stacked_params_x_and_per_example_grads(matmul):
    f = layer(matmul)
    trees = [moe_params(seed=s) for s in range(3)]
    stacked = {k: torch.stack([t[k] for t in trees]) for k in trees[0]}
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    near(vmap(f, in_dims=(0, None))(stacked, x), torch.stack([f(t, x) for t in trees]), "ensemble")
    xs = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))
    near(vmap(f, in_dims=(None, 0))(trees[0], xs), torch.stack([f(trees[0], xb) for xb in xs]), "vmap x")
    per_token = grad(lambda p, xt: f(p, xt[None]).square().sum())
    got = vmap(per_token, in_dims=(None, 0))(trees[0], x)
    for k in trees[0]:
        near(got[k], torch.stack([per_token(trees[0], xt)[k] for xt in x]), f"per-token grad {k}")


def test_vmap_over_three_stacked_models_and_per_sequence_grads():
    cfg = qwen3_moe.Config.tiny(num_hidden_layers=1, initializer_range=0.2)
    trees = [qwen3_moe.init(cfg, seed=s) for s in range(3)]
    stacked = fmoe.tree.map_with_path(lambda p, _: torch.stack([fmoe.tree.flatten(t)[p] for t in trees]), trees[0])
    tokens = tokens_of(cfg, 0)
    fwd = lambda p, t: qwen3_moe.forward(p, t, cfg)  # noqa: E731
    near(vmap(fwd, in_dims=(0, None))(stacked, tokens), torch.stack([fwd(t, tokens) for t in trees]), "ensemble logits")
    per_seq = grad(lambda p, t: lm_loss(cfg, t[None])(p))
    got = fmoe.tree.flatten(vmap(per_seq, in_dims=(None, 0))(trees[0], tokens))
    want = [fmoe.tree.flatten(per_seq(trees[0], t)) for t in tokens]
    for k in got:
        near(got[k], torch.stack([w[k] for w in want]), f"per-sequence grad {k}")


# ------------------------------------------------------------------------------ one process: forward mode
@pytest.mark.parametrize("matmul", MATMULS)
def test_jvp_jacfwd_hessian_of_moe_equal_jacrev_and_finite_differences(matmul):
    p = moe_params()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    v = torch.randn_like(x)
    f = lambda x: layer(matmul)(p, x)  # noqa: E731
    y, t = jvp(f, (x,), (v,))
    J = jacrev(f)(x)                                                    # [T, D, T, D]
    near(t, torch.einsum("abcd,cd->ab", J, v), "jvp vs jacrev")
    near(jacfwd(f)(x), J, "jacfwd vs jacrev")
    scalar = lambda x: f(x).sin().sum()  # noqa: E731
    near(hessian(scalar)(x), jacrev(jacrev(scalar))(x), "hessian vs jacrev(jacrev)", rtol=1e-4)
    # jvp w.r.t. every parameter too, against float64 central differences (routing is piecewise
    # constant: a step of 1e-6 does not cross a decision); no fp64 torch._grouped_mm kernel, so
    # the grouped op takes its loop here
    p64, x64 = {k: w.double() for k, w in p.items()}, x.double()
    tan = {k: torch.randn_like(w) for k, w in p64.items()}
    g = lambda p, x: layer("loop", router=softmax_top2)(p, x)  # noqa: E731
    _, t64 = jvp(g, (p64, x64), (tan, v.double()))
    h = 1e-6
    fd = (g({k: w + h * tan[k] for k, w in p64.items()}, x64 + h * v) -
          g({k: w - h * tan[k] for k, w in p64.items()}, x64 - h * v)) / (2 * h)
    near(t64, fd, "jvp vs finite differences", rtol=1e-6)


def test_data_checks_raise_in_eager_and_do_not_break_vmap():
    p = moe_params()
    x = torch.randn(3, 8)
    bad = lambda l: Routing(torch.ones(3, 2), torch.full((3, 2), 7), {})  # noqa: E731
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, 4\)"):
        fmoe.moe(p, x, router=bad)
    nan = lambda l: Routing(torch.full((3, 2), float("nan")), torch.zeros(3, 2, dtype=torch.long), {})  # noqa: E731
    with pytest.raises(ValueError, match="NaN"):
        fmoe.moe(p, x, router=nan)
    cfg = qwen3_moe.Config.tiny(num_hidden_layers=1)
    params = qwen3_moe.init(cfg)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\)"):
        qwen3_moe.forward(params, torch.full((1, 3), 128), cfg)
    with pytest.raises(ValueError, match="expert_ids must be in"):      # still raised under grad
        grad(lambda x: fmoe.moe(p, x, router=bad)[0].sum())(x)
    ok = vmap(lambda t: qwen3_moe.forward(params, t[None], cfg)[0])(tokens_of(cfg, 0))
    near(ok, qwen3_moe.forward(params, tokens_of(cfg, 0), cfg), "vmap over sequences")


def test_grouped_mm_ops_pass_opcheck():
    from fmoe.experts.ops import offsets
    offs = offsets(torch.tensor([2, 0, 3]))
    for impl in ("grouped", "loop"):
        for rg in (False, True):     # with requires_grad: the operator's own autograd kernel
            torch.library.opcheck(torch.ops.fmoe.grouped_mm.default,
                                  (torch.randn(5, 4, requires_grad=rg), torch.randn(3, 8, 4, requires_grad=rg), offs,
                                   True, impl))
            torch.library.opcheck(torch.ops.fmoe.grouped_wgrad.default,
                                  (torch.randn(5, 8, requires_grad=rg), torch.randn(5, 4, requires_grad=rg), offs, impl))


# ------------------------------------------------------------------------------ one process: compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compile_fullgraph_equals_eager(dtype):
    """fp32: 1e-5, on Dynamo + AOTAutograd (``aot_eager``; Inductor compiles fp32 forward + backward of
    Qwen3-MoE in ``test_compile.py::test_compiled_step_equals_eager_on_one_process``). bf16, on
    Inductor: it is asked to round like eager (``emulate_precision_casts``), so
    the logits are bitwise equal (on a CPU without native bf16, where GEMMs run in fp32 on the bf16
    values, within 2 bf16 eps of their scale); the gradients differ only by the order of bf16 sums (autograd
    vs the eager path's hand-written backward): within ``2 eps sqrt(n)`` of their norm (bf16 eps,
    n the longest reduction), and no further from the fp32 gradients than eager bf16 is."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    torch._dynamo.reset()
    cfg = qwen3_moe.Config.tiny(num_hidden_layers=1, initializer_range=0.2)
    tokens = tokens_of(cfg, 0)
    fwd = lambda p, t: qwen3_moe.forward(p, t, cfg)  # noqa: E731

    def run(f, dt):
        params = fmoe.tree.map_with_path(lambda _, t: t.to(dt).requires_grad_(), qwen3_moe.init(cfg))
        logits = f(params, tokens)
        leaves = fmoe.tree.flatten(params)
        gs = torch.autograd.grad(logits.float().square().mean(), list(leaves.values()))
        return logits.detach().float(), {k: g.float() for k, g in zip(leaves, gs)}

    with inductor_config.patch(emulate_precision_casts=True):
        backend = "inductor" if dtype == torch.bfloat16 else "aot_eager"
        lc, gc = run(torch.compile(fwd, fullgraph=True, backend=backend), dtype)
    le, ge = run(fwd, dtype)
    if dtype == torch.float32:
        near(lc, le, "logits")
        for k in ge:
            near(gc[k], ge[k], f"grad {k}")
        return
    if fmoe.precision.native_bf16():
        assert torch.equal(lc, le), "bf16 logits"
    else:   # fp32 GEMMs of the bf16 values (no native bf16): Inductor's and eager's fp32 sums may differ in order
        assert float((lc - le).abs().max()) <= 2 * torch.finfo(torch.bfloat16).eps * float(le.abs().max()), "bf16 logits"
    _, g32 = run(fwd, torch.float32)
    # two summation orders of n bf16 terms differ by ~sqrt(n) roundings of eps = 2^-8 each
    # (random-walk rounding); n: the longest reduction of the backward, the vocab / model dim
    n = max(cfg.vocab_size, cfg.hidden_size, B * S)
    bound = 2 * torch.finfo(torch.bfloat16).eps * n ** 0.5
    for k in ge:
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        assert rel(gc[k], ge[k]) < bound, (k, rel(gc[k], ge[k]), bound)
        assert rel(gc[k], g32[k]) < 1.25 * rel(ge[k], g32[k]) + 1e-3, (k, rel(gc[k], g32[k]), rel(ge[k], g32[k]))


# ------------------------------------------------------------------------------ four ranks
MESHES = [dict(tp=1, ep=4), dict(tp=2, ep=4), dict(tp=2, ep=2), dict(tp=1, ep=2, dp_replicate=2)]


def _honest(g: DTensor, param: DTensor, path: str) -> list:
    """Partial exactly where a sum is pending; each Replicate claim true across its axis."""
    fails = []
    mesh = g.device_mesh
    for i, (name, pg, pp) in enumerate(zip(mesh.mesh_dim_names, g.placements, param.placements)):
        pending = isinstance(pp, Replicate) and mesh.shape[i] > 1 and (
            name in DATA_AXES or (name == "tp" and path.endswith(("q_norm", "k_norm"))))
        want = Partial() if pending else pp
        if pg != want:
            fails.append(f"{path}: grad placement on {name} is {pg}, expected {want}")
        if isinstance(pg, Replicate) and mesh.shape[i] > 1:
            local = g.to_local().contiguous()
            every = [torch.empty_like(local) for _ in range(mesh.shape[i])]
            dist.all_gather(every, local, group=mesh.get_group(name))
            if not all(torch.equal(e, local) for e in every):
                fails.append(f"{path}: grad claims Replicate on {name} but the ranks differ")
    return fails


def _grads_on_meshes(rank, world, ckpt):
    from fmoe.fsdp import data_parallel_plan
    cfg = qwen3_moe.Config.tiny(initializer_range=0.2)
    full = qwen3_moe.init(cfg, seed=0)
    out = []
    for kw in MESHES:
        mesh = fmoe.Mesh(**kw)
        nb = mesh.num_batches
        ref = fmoe.tree.flatten(grad(lambda p: sum(lm_loss(cfg, tokens_of(cfg, b))(p) for b in range(nb)))(full))
        loss = lm_loss(cfg, tokens_of(cfg, mesh.batch_index), mesh)
        trees = {"default": qwen3_moe.shard(full, cfg, mesh)}
        if kw == dict(tp=2, ep=2):
            trees["fsdp"] = fmoe.shard(full, data_parallel_plan(qwen3_moe.plan(cfg), full, mesh), mesh)
            trees["load_hf"] = qwen3_moe.load_hf(ckpt, mesh=mesh)[0]
        fails = []
        for name, sh in trees.items():
            g_and_v, value = grad_and_value(loss)(sh)
            own, vjp_fn = vjp(loss, sh)
            leaves = fmoe.tree.map_with_path(lambda _, t: t.detach().clone().requires_grad_(), sh)
            loss(leaves).backward()
            results = {"grad": grad(loss)(sh), "grad_and_value": g_and_v, "vjp": vjp_fn(torch.ones(()))[0],
                       "backward": fmoe.tree.map_with_path(lambda _, t: t.grad, leaves)}
            if not torch.equal(value, own):
                fails.append(f"{name}: grad_and_value value differs from the loss")
            params = fmoe.tree.flatten(sh)
            for how, g in results.items():
                for path, t in fmoe.tree.flatten(g).items():
                    fails += [f"{kw} {name} {how}: {f}" for f in _honest(t, params[path], path)]
                for path, t in fmoe.tree.flatten(fmoe.gather(g)).items():
                    try:
                        near(t, ref[path], f"{kw} {name} {how} {path}")
                    except AssertionError as e:
                        fails.append(str(e)[:300])
        out.append(fails)
    return out


def test_grads_over_sharded_trees_are_the_gradient_of_the_sum_of_the_batches(tmp_path):
    cfg = qwen3_moe.Config.tiny(initializer_range=0.2)
    qwen3_moe.save_hf(qwen3_moe.init(cfg, seed=0), cfg, tmp_path / "ckpt")
    for rank, fails in enumerate(on_ranks(_grads_on_meshes, 4, str(tmp_path / "ckpt"), timeout=900)):
        assert not [f for per_mesh in fails for f in per_mesh], f"rank {rank}: {fails}"


def _jvp_and_compile_on_meshes(rank, world):
    import torch._dynamo
    out = {}
    full = moe_params(e=8, d=8, i=4)
    tan = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(9)) for k, v in full.items()}
    for kw in (dict(tp=1, ep=4), dict(tp=2, ep=4)):
        mesh = fmoe.Mesh(**kw)
        b = mesh.batch_index
        x = torch.randn(3 + 2 * b, 8, generator=torch.Generator().manual_seed(b))
        v = torch.randn(x.shape, generator=torch.Generator().manual_seed(50 + b))
        f1, fm = layer("auto"), layer("auto", mesh, impl="all_to_all")
        _, want = jvp(f1, (full, x), (tan, v))
        _, got = jvp(fm, (full, x), (tan, v))         # plain full experts: each rank slices its block
        near(got, want, f"{kw} jvp (params and x)")
        sh = fmoe.shard(full, Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
        _, got = jvp(lambda x: fm(sh, x), (x,), (v,))
        near(got, jvp(lambda x: f1(full, x), (x,), (v,))[1], f"{kw} jvp (placed params, x)")
    # compiled forward + backward on tp=2, ep=4 equals eager; graph breaks only at the host sync
    mesh = fmoe.Mesh(tp=2, ep=4)
    sh = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(),
                                 fmoe.shard(full, Plan({"w_*": P("ep", None, None)}, default=P()), mesh))
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(mesh.batch_index))
    f = layer("auto", mesh, impl="all_to_all")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(sh, x)
    out["break_lines"] = sorted({(b.user_stack[-1].filename.split("/")[-1], b.user_stack[-1].name)
                                 for b in explained.break_reasons})
    torch._dynamo.reset()
    with fmoe.transforms.symbolic_splits():          # the split sizes traced as unbacked ints: no break
        out["symbolic_breaks"] = len(torch._dynamo.explain(f)(sh, x).break_reasons)
    results = []
    # Inductor on rank 0 (its code generation on a mesh), Dynamo + AOTAutograd on the others: the same
    # graph and collectives in the same order, without four identical Inductor compiles on 2 cores;
    # rank 0 compiles its kernels with two workers while the others wait in the first collective
    torch._dynamo.reset()
    import torch._inductor.config as inductor_config
    with fmoe.transforms.symbolic_splits(), inductor_config.patch(compile_threads=2 if rank == 0 else 1):
        for fn in (torch.compile(f, fullgraph=True, backend="inductor" if rank == 0 else "aot_eager"), f):
            y = fn(sh, x)
            y.square().sum().backward()
            results.append((y.detach(), {k: fmoe.gather(t.grad) for k, t in sh.items()}))
            for t in sh.values():
                t.grad = None
    (yc, gc), (ye, ge) = results
    near(yc, ye, "compiled output")
    for k in ge:
        near(gc[k], ge[k], f"compiled grad {k}")
    return out


def test_jvp_and_compile_on_four_ranks():
    for out in on_ranks(_jvp_and_compile_on_meshes, 4, timeout=900):
        assert out["break_lines"] == [("token_dispatch.py", "_exchange_splits")], out["break_lines"]
        assert out["symbolic_breaks"] == 0


# ------------------------------------------------------------------------------ one process: remat under grad
@pytest.mark.parametrize("policy", ["layer", "moe"])
def test_remat_under_grad_equals_backward(policy):
    """``torch.func.grad`` under a recomputing policy (a functional checkpoint: the block's
    backward recomputes it under ``torch.func.vjp``) equals ``.backward()`` under the same policy
    (``torch.utils.checkpoint``), every leaf, fp32."""
    from helpers import close as close_dtype
    cfg = qwen3_moe.Config.tiny()
    params, toks = qwen3_moe.init(cfg, seed=0), tokens_of(cfg, 0)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in fmoe.tree.flatten(params).items()}
    with fmoe.nn.remat.policy(policy):
        got = fmoe.tree.flatten(grad(lm_loss(cfg, toks))(params))
        lm_loss(cfg, toks)(fmoe.tree.unflatten(leaves, like=params)).backward()
    for k, leaf in leaves.items():
        close_dtype(got[k], leaf.grad, f"{policy}: {k}")
