"""The expert-parallel contract (``fmoe.ep``): a user pair of steps is run exactly like the
built-ins (same outputs, gradients and folded statistics), a whole-layer function still works,
and the expert path is chosen from explicit data (the activation's name), not object identity."""

import torch
import torch.nn.functional as F

import fmoe
from fmoe import P, Plan, ep
from helpers import on_ranks
from moe_cases import batch, full_params


def _recording(pair: ep.ExpertParallel, log: list) -> ep.ExpertParallel:
    """A user-written pair (a new object) that delegates to ``pair``'s steps and records what
    the layer gave its dispatch."""

    def dispatch(x, weights, expert_ids, experts, mesh, stats):
        log.append(stats is not None)
        d = pair.dispatch(x, weights, expert_ids, experts, mesh, stats)
        assert isinstance(d, ep.Dispatch)
        return d

    return ep.ExpertParallel(dispatch, lambda out, d, mesh: pair.combine(out, d, mesh), pair.folds_stats)


def _grads(p, x, impl, mesh):
    y, aux = fmoe.moe(p, x, router=fmoe.routing.aux_losses.with_losses(fmoe.routing.topk(2), load_balance=0.1),
                      mesh=mesh, impl=impl)
    loss = y.square().sum() + aux["load_balance_loss"]
    leaves = [x] + [p[k] for k in ("router", "w_gate_up", "w_down")]
    return y.detach(), aux, [fmoe.to_local(g) for g in torch.autograd.grad(loss, leaves)]


def _user_pair_on_four(rank, world):
    out = {}
    log: list = []
    ep.register("user_a2a", _recording(ep.ALL_TO_ALL, log))
    ep.register("user_fn", ep.as_function(ep.ALL_TO_ALL))
    for kw in (dict(tp=1, ep=4), dict(tp=2, ep=2)):        # efsdp = 1: folded; efsdp = 2: not
        mesh = fmoe.Mesh(**kw)
        p = fmoe.shard({k: v.requires_grad_(True) for k, v in full_params().items()},
                       Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
        x, _ = batch(mesh.batch_index, 5)
        res = {impl: _grads(p, x.clone().requires_grad_(True), impl, mesh) for impl in ("all_to_all", "user_a2a", "user_fn")}
        (y0, a0, g0) = res["all_to_all"]
        same = {}
        for impl in ("user_a2a", "user_fn"):
            # the pair folds like the built-in: bitwise; the function form reduces the
            # statistics with an all-reduce instead (another summation order): float noise
            eq = torch.equal if impl == "user_a2a" else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7))
            y1, a1, g1 = res[impl]
            same[impl] = (eq(y0, y1) and all(eq(a, b) for a, b in zip(g0, g1))
                          and eq(a0["load_balance_loss"], a1["load_balance_loss"])
                          and torch.equal(a0["load"], a1["load"])
                          and int(a0["dispatch_rows"]) == int(a1["dispatch_rows"]))
        out[str(kw)] = (same, list(log), ep.folds_stats(mesh))
        del log[:]
    return out


def test_a_user_pair_runs_like_the_builtin_and_folds_statistics_the_same_way():
    for out in on_ranks(_user_pair_on_four, 4, timeout=300):
        for kw, (same, log, folds) in out.items():
            assert same == {"user_a2a": True, "user_fn": True}, kw
            assert log == [folds], (kw, log)          # the layer passed the statistics iff the pair folds
        assert [v[2] for v in out.values()] == [True, False]


def test_pair_and_function_in_one_process():
    """``run`` gives the same Result for the local pair and its function form; the registry
    accepts pairs and callables and rejects anything else."""
    torch.manual_seed(0)
    wgu, wd = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    experts = fmoe.experts.LocalExperts({"w_gate_up": wgu, "w_down": wd}, 0, 4)
    x, w, ids = torch.randn(5, 8), torch.rand(5, 2), torch.randint(0, 4, (5, 2))
    a = ep.run(ep.LOCAL, x, w, ids, experts, None)
    b = ep.run(ep.as_function(ep.LOCAL), x, w, ids, experts, None)
    assert torch.equal(a.y, b.y) and int(a.sent_rows) == int(b.sent_rows) == 0
    assert a.stats_sum is None and b.extra == {}
    assert ep.takes_stats(ep.LOCAL, None) is False and ep.takes_stats(ep.as_function(ep.LOCAL), None) is False
    # a built-in pair is callable as a whole-layer function
    y, extra = ep.LOCAL(x, w, ids, experts, None)
    assert torch.equal(y, a.y) and int(extra["dispatch_rows"]) == 0
    # a whole-layer function's extra entries reach the aux; its dispatch_rows becomes sent_rows
    c = ep.run(lambda *args: (a.y, {"dispatch_rows": torch.tensor(7), "mine": 1}), x, w, ids, experts, None)
    assert int(c.sent_rows) == 7 and c.extra == {"mine": 1}
    try:
        ep.register("bad", 3)
    except TypeError as e:
        assert "ExpertParallel" in str(e)
    else:
        raise AssertionError("register accepted a non-callable")


def test_expert_path_is_chosen_by_the_activation_name():
    E, D, I = 2, 8, 4
    w = {"w_gate_up": torch.randn(E, 2 * I, D), "w_down": torch.randn(E, D, I)}
    x = torch.randn(3, D)
    many = fmoe.experts.BLOCKED_MIN_ROWS * E
    fused = [fmoe.nn.swiglu, fmoe.experts.swiglu, fmoe.experts.activations.Activation("swiglu", fmoe.nn.swiglu.fn)]
    assert fmoe.nn.swiglu is fmoe.experts.swiglu                # one SwiGLU
    for act in fused:
        assert fmoe.experts.LocalExperts(w, 0, E, act=act).blocked(x, many)
    for act in (lambda g, u: F.silu(g) * u, fmoe.experts.clamped_swiglu()):
        assert not fmoe.experts.LocalExperts(w, 0, E, act=act).blocked(x, many)
        assert fmoe.experts.LocalExperts(w, 0, E, act=act, matmul="loop").path(x, many) == "loop"
    ex = fmoe.experts.LocalExperts(w, 0, E, act=fmoe.nn.swiglu)
    assert ex.path(x, many) == "blocked" and ex.path(x, 1) in ("grouped", "loop")
    seen = []
    torch.func.grad(lambda r: (seen.append(ex.path(r, many)), r.sum())[1])(x)
    assert seen == ["traced"]                                     # under torch.func: the grouped operators
    # the general path gives the same numbers for the same function
    rows = torch.randn(6, D)
    counts = [2, 4]
    y_fused = fmoe.experts.expert_mlp(rows, counts, w["w_gate_up"], w["w_down"], act=fmoe.nn.swiglu, matmul="loop")
    y_plain = fmoe.experts.expert_mlp(rows, counts, w["w_gate_up"], w["w_down"], act=lambda g, u: F.silu(g) * u,
                                      matmul="loop")
    torch.testing.assert_close(y_fused, y_plain, rtol=1e-6, atol=1e-6)


def _compiled_steps(rank, world):
    import torch._dynamo
    from torch._dynamo.utils import counters

    mesh = fmoe.Mesh(tp=1, ep=world)
    p = fmoe.shard(full_params(), Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
    router = fmoe.routing.aux_losses.with_losses(fmoe.routing.topk(2), load_balance=0.1)
    # what is counted is Dynamo's graphs and AOTAutograd's guards; Inductor's C++ code generation
    # adds nothing to them and cost ~100 s of this test on 2 cores (its numerics: the matrix cells)
    layer = torch.compile(lambda p, x: fmoe.moe(p, x, router=router, mesh=mesh, impl="all_to_all"),
                          backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for step in range(6):                   # new tokens, new split sizes every call
        x = torch.randn(9 + step, p["router"].shape[1], generator=torch.Generator().manual_seed(10 * step + rank))
        y, aux = layer(p, x)
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def test_compiled_layer_stops_recompiling_after_warmup():
    """Nothing per-call crosses the dispatch's graph break as a guarded object (the statistics
    were once matched by ``id()``, so every call recompiled the frame after the break until
    Dynamo's recompile limit sent it back to eager)."""
    for graphs in on_ranks(_compiled_steps, 2, timeout=600):
        assert graphs[3] == graphs[-1], graphs


def test_the_layer_chooses_by_declared_properties_not_by_name():
    """A name registered again runs as registered on one process (it declares no ``one_rank``
    stand-in), while the built-in under that name declares LOCAL as its one-rank equivalent;
    ``shared_batch`` is what refuses an ``ep != tp`` mesh."""
    p, (x, _) = full_params(), batch(0, 6)
    router = fmoe.routing.topk(2)
    builtin = ep.declared("all_to_all")
    assert builtin.impl is ep.ALL_TO_ALL and builtin.one_rank == "local" and not builtin.shared_batch
    assert ep.declared("all_reduce").shared_batch and ep.declared("local").properties == {
        "shared_batch": False, "one_rank": None}
    y_local, _ = fmoe.moe(p, x, router=router, mesh=None, impl="local")
    calls = []

    def mine(x, weights, expert_ids, experts, mesh):
        calls.append(x.shape[0])
        return ep.LOCAL(x, weights, expert_ids, experts, mesh)

    try:
        ep.register("all_to_all", mine)
        y_mine, _ = fmoe.moe(p, x, router=router, mesh=None, impl="all_to_all")
        assert calls == [6] and torch.equal(y_mine, y_local)       # the user's function ran
        ep.register("all_to_all", mine, **builtin.properties)      # declared like the built-in
        fmoe.moe(p, x, router=router, mesh=None, impl="all_to_all")
        assert calls == [6]                                        # one rank: LOCAL stands in
    finally:
        ep.register("all_to_all", builtin.impl, **builtin.properties)
    assert ep.declared("all_to_all") == builtin
    for bad, err in ((lambda: ep.register("x", mine, one_rank="nope"), ValueError),
                     (lambda: ep.register("x", mine, shared_batch=1), TypeError)):
        try:
            bad()
        except err as e:
            assert "ep.register" in str(e)
        else:
            raise AssertionError("register accepted a bad property")
    assert "x" not in ep.registered()
