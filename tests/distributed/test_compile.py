"""Compile is the fast path: what ``torch.compile`` of fmoe must keep.

- The expert GEMMs stay grouped under every transform: the compiled ``torch.func.grad`` of a
  64-expert top-2 layer runs exactly the FLOPs of its eager ``grad`` (counted by
  ``torch.utils.flop_counter.FlopCounterMode`` inside the compiled graph), not one masked matmul
  per expert (G times the FLOPs, what fmoe did before);
- a plain ``torch.compile(f)`` is not a ``torch.func`` transform (:func:`fmoe.transforms.func_active`).
"""

from collections import Counter

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.flop_counter import FlopCounterMode

import fmoe
from fmoe.transforms import func_active
from helpers import close, on_ranks


def counting_backend(counts: Counter):
    """AOTAutograd with its graphs (forward, backward) run as Python, each run under a
    ``FlopCounterMode`` whose FLOPs per operator are added to ``counts``."""
    def compiler(gm, _example_inputs):
        def run(*args):
            with FlopCounterMode(display=False) as mode:
                out = gm(*args)
            counts.update(mode.get_flop_counts()["Global"])
            return out
        return make_boxed_func(run)
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def moe_layer(e=64, d=32, i=16, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = {"router": torch.randn(e, d, generator=g), "w_gate_up": torch.randn(e, 2 * i, d, generator=g) / d ** 0.5,
         "w_down": torch.randn(e, d, i, generator=g) / i ** 0.5}
    x = torch.randn(n, d, generator=g)
    return p, lambda p: fmoe.moe(p, x, router=fmoe.routing.topk(2))[0].square().sum()


def test_compiled_grad_of_a_64_expert_layer_costs_its_eager_flops():
    p, loss = moe_layer()
    grad = torch.func.grad(loss)
    with FlopCounterMode(display=False) as eager:
        ref = grad(p)
    counts = Counter()
    out = torch.compile(grad, backend=counting_backend(counts), fullgraph=True)(p)
    assert eager.get_total_flops() > 0
    # the grouped operators carry the expert GEMMs; the masked path had 64 aten.mm per projection
    assert counts[torch.ops.fmoe.grouped_mm] > 0 and counts[torch.ops.fmoe.grouped_wgrad] > 0
    assert counts == Counter(eager.get_flop_counts()["Global"])
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=0, atol=1e-6 * ref[k].abs().max().item())


def test_compiled_backward_of_a_64_expert_layer_costs_its_eager_flops():
    p, loss = moe_layer()
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    with FlopCounterMode(display=False) as eager:
        torch.func.grad(loss)(p)
    counts = Counter()
    torch.compile(loss, backend=counting_backend(counts), fullgraph=True)(leaves).backward()
    assert counts == Counter(eager.get_flop_counts()["Global"])


def test_plain_compile_is_not_a_transform():
    seen = []

    def f(x):
        seen.append(func_active())
        return x * 2

    torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    torch.compile(torch.func.grad(lambda x: f(x).sum()), backend="eager", fullgraph=True)(torch.ones(2))
    assert seen == [False, True]


# ------------------------------------------------------------------ StepConfig(compile=...)
STEPS = 10


def _train(mesh, compile, steps=STEPS, layers=None, bias=None):
    """``steps`` AdamW steps of tiny Qwen3-MoE (``layers`` decoder layers, default the preset's;
    new tokens every step: the routing changes); returns the losses, the gradients of the first
    step's loss, and the Dynamo counters. ``bias(step) -> [E]``: every MoE layer's ``expert_bias``
    before step ``step`` (0: the gradients' forward), read by the biased top-k router and never
    updated (``bias_rate=0``): a routing forced step by step."""
    import dataclasses

    import torch._dynamo
    from torch._dynamo.utils import counters

    from fmoe.data import TokenStream
    from fmoe.fsdp import data_parallel_plan
    from fmoe.models import qwen3_moe
    from fmoe.optim.adamw import init as adamw_init
    from fmoe.training.step import StepConfig, _compiled, train_step
    torch._dynamo.reset()
    counters.clear()
    cfg = dataclasses.replace(qwen3_moe.MODEL.preset("tiny", mesh.tp), output_router_logits=True, router_aux_loss_coef=0.01)
    cfg = cfg if layers is None else dataclasses.replace(cfg, num_hidden_layers=layers)
    full = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(True), qwen3_moe.init(cfg, seed=0))
    if bias is not None:
        for layer in full["layers"]:
            layer["moe"]["expert_bias"] = torch.zeros(cfg.num_experts)
    params = fmoe.shard(full, data_parallel_plan(qwen3_moe.check_plan(cfg, None, mesh.tp), full, mesh), mesh)
    state, data = adamw_init(params), TokenStream.stdlib(300_000)
    step_cfg = StepConfig(compile=compile) if bias is None else StepConfig(
        compile=compile, bias_rate=0.0, router=qwen3_moe.default_router(cfg, biased=True))

    def set_bias(step):
        for path, t in fmoe.tree.flatten(params).items():
            if bias is not None and path.endswith("expert_bias"):
                value = bias(step)
                if isinstance(t, DTensor):          # placed as fmoe.shard placed the zeros
                    value = distribute_tensor(value, t.device_mesh, t.placements)
                with torch.no_grad():
                    t.copy_(value)

    set_bias(0)
    batch = data.batch(1, mesh.batch_index, 2, 16, 0, num_batches=mesh.num_batches)
    fwd_loss, region = _compiled(step_cfg, mesh)                  # the step's own (compiled) forward + loss
    with region:
        loss, _ = fwd_loss(qwen3_moe, params, *batch, cfg, mesh, step_cfg)
        leaves = {k: v for k, v in fmoe.tree.flatten(params).items() if v.requires_grad}
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    grads = {k: v.detach() for k, v in fmoe.tree.flatten(fmoe.gather(fmoe.tree.unflatten(
        {**fmoe.tree.flatten(params), **grads}, like=params))).items() if k in grads}
    losses, graphs, loads = [], [], []
    for step in range(1, steps + 1):
        set_bias(step)
        batch = data.batch(step, mesh.batch_index, 2, 16, 0, num_batches=mesh.num_batches)
        params, state, m = train_step(qwen3_moe, cfg, params, state, batch, mesh=mesh, step_cfg=step_cfg, lr=3e-3)
        losses.append(m["loss"])
        loads.append(m["expert_load"][0])
        graphs.append(counters["stats"]["unique_graphs"])
    return losses, grads, graphs, dict(counters["graph_break"]), loads


def _check_same(eager, compiled):
    (le, ge, _, _, _), (lc, gc, graphs, breaks, _) = eager, compiled
    print(f"graphs after each step {graphs}, graph breaks {breaks}, losses {lc[0]:.5f} .. {lc[-1]:.5f}")
    for k in ge:
        close(gc[k], ge[k], f"gradient {k}")
    eps = torch.finfo(torch.float32).eps
    for i, (a, b) in enumerate(zip(lc, le)):        # AdamW amplifies rounding over steps: ~84 eps per step
        assert abs(a - b) <= 84 * eps * (i + 1) * abs(b), (i, a, b)
    # every graph compiled by the gradients' forward, before the first step: none after, whatever the routing
    assert graphs[0] > 0 and all(g == graphs[0] for g in graphs), f"graphs compiled per step: {graphs} (recompiles)"


def test_compiled_step_equals_eager_on_one_process():
    """Inductor (the shipped path), one process: forward + loss as one graph, no graph break."""
    eager, compiled = _train(fmoe.Mesh(), False), _train(fmoe.Mesh(), True)
    _check_same(eager, compiled)
    assert not compiled[3], f"graph breaks: {compiled[3]}"


GROUPED_GRAPHS = []   # per graph a backend compiled: whether it holds the expert GEMMs (fmoe::grouped_mm)


def _grouped_graphs_backend(gm, example_inputs):
    """``aot_eager``, noting whether each Dynamo graph holds the grouped expert GEMMs and an all-to-all."""
    op = torch.ops.fmoe.grouped_mm
    names = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    GROUPED_GRAPHS.append((any(n.target in (op, op.default) for n in gm.graph.nodes),
                           any("all_to_all" in t for t in names)))
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


if "fmoe_test_grouped_graphs" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(_grouped_graphs_backend, name="fmoe_test_grouped_graphs")


def _forced(step, num_experts=8, ep=4):
    """The ``expert_bias [E]`` of step ``step``: every routing the exchange must survive without a
    recompile, over ``ep`` ranks of ``num_experts // ep`` experts: free routing; one rank's experts
    shut (that rank receives no rows, its expert slices empty); every token on one rank's experts
    (the other ranks receive nothing, each sends all its rows to one rank)."""
    local, shut = num_experts // ep, torch.full((num_experts,), -1e4)
    kind, rank = (step + 2) % 3, step % ep           # step 0 (the gradients' forward): all rows to rank 0
    if kind == 0:
        return torch.zeros(num_experts)
    if kind == 1:
        return torch.zeros(num_experts).index_fill(0, torch.arange(rank * local, (rank + 1) * local), -1e4)
    return shut.index_fill(0, torch.arange(rank * local, (rank + 1) * local), 0.0)


def _four_ranks(rank, world):
    mesh = fmoe.Mesh(ep=4)
    GROUPED_GRAPHS.clear()
    out = {"free": (_train(mesh, False), _train(mesh, "fmoe_test_grouped_graphs"), list(GROUPED_GRAPHS))}
    GROUPED_GRAPHS.clear()
    out["forced"] = (_train(mesh, False, bias=_forced), _train(mesh, "fmoe_test_grouped_graphs", bias=_forced),
                     list(GROUPED_GRAPHS))
    return out


def test_compiled_step_equals_eager_on_four_ranks():
    """ep4, regional compilation (AOTAutograd; Inductor runs in the one-process test): each decoder
    layer is one graph, its MoE block (router, dispatch with the all-to-all exchange, experts,
    combine) traced inside under ``symbolic_splits``; compiled once by the first forward and reused
    by every layer and step after, while the routing (and so every split size) changes step to step
    ("free"), and while it is forced to empty expert slices, a rank receiving no rows and every row
    sent to one rank ("forced", :func:`_forced`): losses and every gradient equal eager's."""
    for out in on_ranks(_four_ranks, 4, timeout=600):
        for case, (eager, compiled, graphs) in out.items():
            _check_same(eager, compiled)
            assert not compiled[3], f"{case}: graph breaks {compiled[3]}"
            # one graph: the layer, with the grouped expert GEMMs and the exchange's all-to-alls in it
            assert graphs == [(True, True)], (case, graphs)
        # the forced routing did what it says: the ranks whose experts took no slot, step by step
        for step, load in enumerate(out["forced"][1][4], start=1):
            idle = [r for r in range(4) if sum(load[2 * r:2 * r + 2]) == 0]
            kind, rank = (step + 2) % 3, step % 4
            assert rank in idle if kind == 1 else kind == 0 or idle == [r for r in range(4) if r != rank], (step, load)


def _depths(rank, world):
    mesh, graphs = fmoe.Mesh(ep=2), {}
    for layers in (1, 4):
        _, _, per_step, breaks, _ = _train(mesh, "aot_eager", steps=1, layers=layers)
        graphs[layers] = (per_step[-1], sum(breaks.values()))
    return graphs


def test_compiled_graphs_do_not_grow_with_depth_on_two_ranks():
    """Regional compilation compiles each decoder layer's code once: a 4-layer model compiles the
    same one graph as a 1-layer one, with no graph break: the cold compile does not grow with
    depth (measured in benchmarks/RESULTS.md). Two ranks (ep2) trace what four do (the exchange
    inside the graph); the 4-rank test above checks the graphs of the tiny preset's depth."""
    for graphs in on_ranks(_depths, 2, timeout=600):
        assert graphs[1] == graphs[4] == (1, 0), graphs


def _all_reduce_layer(rank, world):
    """A compiled MoE layer (biased experts) over the ``all_reduce`` dispatch on tp2/ep2, against eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fmoe import P, Plan
    torch._dynamo.reset()
    counters.clear()
    mesh, g = fmoe.Mesh(tp=2, ep=2), torch.Generator().manual_seed(0)
    e, d, i = 8, 16, 8
    full = {"router": torch.randn(e, d, generator=g), "w_gate_up": torch.randn(e, 2 * i, d, generator=g) / 4,
            "w_down": torch.randn(e, d, i, generator=g) / 3, "b_gate_up": torch.randn(e, 2 * i, generator=g),
            "b_down": torch.randn(e, d, generator=g)}
    p = fmoe.shard(full, Plan({"w_*": P("ep", None, None), "b_*": P("ep", None)}, default=P()), mesh)
    router = fmoe.routing.topk(2)

    def layer(p, x):
        return fmoe.moe(p, x, router=router, mesh=mesh, impl="all_reduce")[0]

    outs = []
    for fn in (layer, torch.compile(layer, backend="aot_eager")):
        for n in (12, 7):                        # two token counts: the padded buffer's size is dynamic
            leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
            x = torch.randn(n, d, generator=torch.Generator().manual_seed(n)).requires_grad_()
            y = fn(leaves, x)
            grads = torch.autograd.grad(y.square().sum(), [x, *leaves.values()])
            outs.append([y.detach(), *[t.full_tensor() if hasattr(t, "full_tensor") else t for t in grads]])
    return outs, dict(counters["graph_break"])


def test_compiled_all_reduce_layer_traces_without_a_host_count():
    """The ``all_reduce`` dispatch gives the experts no host count of their used slots: while
    Dynamo traces, every slot goes to the grouped operators with the unused ones after the last
    group (computed by none of them, masked to zero), so the layer compiles with no graph break
    (``int(used.sum())`` broke it, 9 times in the transform matrix's tp2/ep2 compiled forward) and
    gives eager's output and gradients, biases included."""
    for outs, breaks in on_ranks(_all_reduce_layer, 2, timeout=600):
        assert not breaks, breaks
        eager, compiled = outs[:2], outs[2:]
        for e, c in zip(eager, compiled):
            for a, b in zip(c, e):
                close(a, b, "compiled all_reduce layer vs eager")


# ------------------------------------------------------------------ the grouped operators stay opaque
#: a kernel path forced: (dtype, rows, matmul); the grouped operators' kernels pick their path at run
#: time from these (fmoe.experts.ops), never while Dynamo traces
KERNEL_PATHS = {"grouped": (torch.float32, 8, "auto"),        # aligned fp32 rows: torch._grouped_mm
                "loop": (torch.float32, 7, "grouped"),        # 7 rows: the loop, although "grouped" asked
                "bucketed": (torch.bfloat16, 8, "auto"),      # bf16 on CPU: bucket-padded loop
                "float64": (torch.float64, 8, "grouped")}     # never torch._grouped_mm (fp32 / bf16 / fp16)
KERNEL_OPS = ("_grouped_mm", "aten.mm", "built-in method mm")   # a kernel body's ops in a Dynamo graph


def _opaque_backend(graphs: list, then: str = "aot_eager"):
    """The backend ``then``, recording each Dynamo graph's call targets (as text) in ``graphs``."""
    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return torch._dynamo.lookup_backend(then)(gm, example_inputs)
    return backend


def _expert_case(path: str):
    from fmoe.experts.ops import expert_mlp_offs, offsets
    dtype, n, matmul = KERNEL_PATHS[path]
    g = torch.Generator().manual_seed(n)
    x, wgu, wd = (torch.randn(*s, generator=g).to(dtype) for s in ((n, 8), (2, 8, 8), (2, 8, 4)))
    offs = offsets(torch.tensor([n // 2, n - n // 2]))
    mlp = lambda x, wgu, wd: expert_mlp_offs(x, offs, wgu, wd, matmul=matmul)  # noqa: E731
    return (x, wgu, wd), mlp


def _every_transform(mlp):
    """``mlp`` and its ``grad``, ``jvp`` and ``vmap`` (over a stack of two inputs), in one function:
    one compile traces all four (``vjp`` traces as ``grad`` does)."""
    from torch.func import grad, jvp, vmap
    loss = lambda *a: mlp(*a).float().square().sum()  # noqa: E731

    def every(x, wgu, wd):
        a = (x, wgu, wd)
        return (mlp(*a), grad(loss, argnums=(0, 1, 2))(*a), jvp(mlp, a, tuple(torch.ones_like(t) for t in a)),
                vmap(mlp, in_dims=(0, None, None))(torch.stack([x, 2 * x]), wgu, wd))
    return every


def test_grouped_operators_stay_opaque_under_every_compiled_transform():
    """``fmoe::grouped_mm`` / ``grouped_wgrad`` under ``torch.compile`` of ``forward``, ``grad``,
    ``jvp`` and ``vmap``, each kernel path forced (:data:`KERNEL_PATHS`): every Dynamo graph holds
    the operator and none of a kernel's ops (Dynamo traced their fake rules, not their bodies, whose
    path depends on the rows: issue 46), and the compiled results equal eager's, for every dtype the
    eager path accepts."""
    for path in KERNEL_PATHS:
        torch._dynamo.reset()
        args, mlp = _expert_case(path)
        fn, graphs = _every_transform(mlp), []       # AOTAutograd once (Dynamo's fake tensors reach every rule)
        backend = _opaque_backend(graphs, "aot_eager" if path == "grouped" else "eager")
        got, want = torch.compile(fn, backend=backend, fullgraph=True)(*args), fn(*args)
        assert graphs and all(any("fmoe.grouped_mm" in t for t in gr) for gr in graphs), (path, graphs)
        assert not [t for gr in graphs for t in gr if any(k in t for k in KERNEL_OPS)], (path, graphs)
        rtol = 1e-2 if args[0].dtype == torch.bfloat16 else None
        for name, g, w in zip(("forward", "grad", "jvp", "vmap"), got, want):
            for a, b in zip(torch.utils._pytree.tree_leaves(g), torch.utils._pytree.tree_leaves(w)):
                close(a, b, f"compile({name}), path {path}", rtol=rtol)


def test_an_eager_fallback_never_traces_a_kernel():
    """The issue's mechanism on one process: a graph break inside ``torch.compile(grad(f))`` makes
    Dynamo run ``grad`` eagerly and trace each frame it calls on its own, with real rows; the
    kernels' frames (aligned fp32 rows: the ``torch._grouped_mm`` path, whose meta rule takes bf16
    only) are never among them, and the gradient equals eager's."""
    from torch.func import grad
    torch._dynamo.reset()
    args, mlp = _expert_case("grouped")

    def loss(x, wgu, wd):
        torch._dynamo.graph_break()
        return mlp(x, wgu, wd).square().sum()

    graphs = []
    got = torch.compile(grad(loss, argnums=(0, 1, 2)), backend=_opaque_backend(graphs))(*args)
    assert not [t for gr in graphs for t in gr if any(k in t for k in KERNEL_OPS)], graphs
    for a, b in zip(got, grad(loss, argnums=(0, 1, 2))(*args)):
        close(a, b, "eager fallback of a compiled grad")


def test_a_compiled_transform_on_a_mesh_is_refused_or_runs_eagerly_whole():
    """:func:`fmoe.transforms.refuse_compiled_transform` while Dynamo traces ``torch.compile(grad(f))``
    (a stand-in mesh of 4 ranks, one process): with ``fullgraph=True`` the documented error; without,
    the whole call runs eagerly (eager ``grad``'s value) and Dynamo traces no frame it calls (it traced
    each on its own before, issue 46); a later compiled transform still compiles (the refusal leaves
    no mark on the transform's code)."""
    import types

    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch.func import grad

    from fmoe.transforms import CompiledTransformRefused, refuse_compiled_transform
    mesh, x, traced = types.SimpleNamespace(world=4), torch.arange(3.0), []

    def inner(x):
        traced.append(torch.compiler.is_compiling())
        return x.sin()

    def f(x):
        refuse_compiled_transform(mesh)
        return (inner(x) * x).sum()

    torch._dynamo.reset()
    with pytest.raises(CompiledTransformRefused, match="compile of a torch.func transform .* on a mesh"):
        torch.compile(grad(f), fullgraph=True, backend="eager")(x)
    counter = CompileCounter()
    close(torch.compile(grad(f), backend=counter)(x), grad(f)(x), "eager fallback")
    assert counter.frame_count == 0 and traced == [False, False], (counter.frame_count, traced)
    torch.compile(grad(lambda x: (x * x).sum()), backend=counter, fullgraph=True)(x)
    assert counter.frame_count == 1
