"""Single-process MoE semantics, expert paths, validation, registry, auto and a property test."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fmoe
from fmoe import P, Plan
from fmoe.routing import Routing
from helpers import on_ranks
from moe_cases import D, E, I, RandomRouter, batch, check_case, full_params


def naive_moe(p, x, router):
    """Token by token, expert by expert: the definition."""
    r = router(x @ p["router"].t())
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for k in range(r.expert_ids.shape[1]):
            e = int(r.expert_ids[t, k])
            gate, up = (p["w_gate_up"][e] @ x[t]).chunk(2)
            acc = acc + r.weights[t, k] * (p["w_down"][e] @ (torch.nn.functional.silu(gate) * up))
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("router", [fmoe.routing.topk(2), fmoe.routing.topk(1), fmoe.routing.topk(E, normalize=False),
                                    fmoe.routing.topk_softmax(3)])
@pytest.mark.parametrize("matmul", ["grouped", "loop"])
def test_single_process_matches_naive_definition(router, matmul):
    p = {k: v.requires_grad_(True) for k, v in full_params().items()}
    x, coef = batch(0, 7)
    x.requires_grad_(True)
    y, aux = fmoe.moe(p, x, router=router, matmul=matmul)
    want = naive_moe(p, x, router)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    g = torch.autograd.grad((y * coef).sum(), [x, *p.values()])
    gw = torch.autograd.grad((want * coef).sum(), [x, *p.values()])
    for a, b in zip(g, gw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert aux["tokens_per_expert"].sum() == 7 * router(torch.zeros(1, E)).expert_ids.shape[1]
    assert int(aux["dispatch_rows"]) == 0


def test_grouped_and_loop_agree_forward_and_backward_with_biases():
    torch.manual_seed(0)
    n_per = [3, 0, 5, 1]
    x = torch.randn(sum(n_per), 8, requires_grad=True)
    w = {"w_gate_up": torch.randn(4, 8, 8), "w_down": torch.randn(4, 8, 4), "b_gate_up": torch.randn(4, 8),
         "b_down": torch.randn(4, 8)}
    outs = {}
    for matmul in ("grouped", "loop"):
        ws = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        xi = x.detach().clone().requires_grad_(True)
        y = fmoe.experts.expert_mlp(xi, n_per, ws["w_gate_up"], ws["w_down"], ws["b_gate_up"], ws["b_down"],
                                    act=fmoe.experts.clamped_swiglu(), matmul=matmul)
        y.backward(torch.arange(y.numel(), dtype=torch.float32).view_as(y) / 10)
        outs[matmul] = (y, xi.grad, {k: v.grad for k, v in ws.items()})
    (yg, xg, wg), (yl, xl, wl) = outs["grouped"], outs["loop"]
    torch.testing.assert_close(yg, yl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xg, xl, rtol=1e-5, atol=1e-4)
    for k in w:
        torch.testing.assert_close(wg[k], wl[k], rtol=1e-5, atol=1e-4)
    assert torch.equal(wl["w_gate_up"][1], torch.zeros(8, 8))     # idle expert: zero, not missing


def test_zero_tokens_single_process_keeps_graph():
    p = {k: v.requires_grad_(True) for k, v in full_params().items()}
    y, aux = fmoe.moe(p, torch.zeros(0, D, requires_grad=True), router=fmoe.routing.topk(2))
    assert y.shape == (0, D) and y.requires_grad
    y.sum().backward()
    assert torch.equal(p["w_down"].grad, torch.zeros(E, D, I))


def bad(**kw):
    p = full_params()
    p.update(kw.pop("params", {}))
    for k in kw.pop("drop", []):
        del p[k]
    x = kw.pop("x", torch.randn(3, D))
    return lambda: fmoe.moe(p, x, router=kw.pop("router", fmoe.routing.topk(2)), **kw)


@pytest.mark.parametrize("call,exc,match", [
    (bad(x=torch.randn(3, D, 1)), ValueError, r"x must be a \[T, D\] tensor, got \(3, 8, 1\)"),
    (bad(x=torch.randn(3, 5)), ValueError, "x has model dim 5 but the router expects D=8"),
    (bad(x=torch.randn(3, D, dtype=torch.float64)), ValueError, "x dtype torch.float64 differs"),
    (bad(drop=["w_down"]), ValueError, r"missing \['w_down'\]"),
    (bad(params={"w_down": torch.randn(E, D, I + 1)}), ValueError, r"w_down must be \[E=8, D=8, I=4\]"),
    (bad(params={"w_gate_up": torch.randn(E + 1, 2 * I, D)}), ValueError, r"w_gate_up must be \[E=8, 2I, D=8\]"),
    (bad(params={"extra": torch.randn(1)}), ValueError, r"params\['extra'\] is router state, but router .* does not "
     r"accept"),
    (bad(params={"extra": torch.ones(1, dtype=torch.long)}), ValueError, r"unexpected params \['extra'\]"),
    (bad(matmul="fused"), ValueError, r"moe: matmul must be 'auto', 'grouped' or 'loop', got 'fused'"),
    (bad(impl="nope"), ValueError, r"unknown MoE impl 'nope'; registered: \['auto', 'all_reduce', 'all_to_all'"),
    (bad(router=lambda l: Routing(torch.ones(3, 2), torch.full((3, 2), 8), {})), ValueError, r"expert_ids must be in \[0, 8\) or -1 \(an inactive slot\), got values in \[8, 8\]"),
    (bad(router=lambda l: Routing(torch.ones(3, 2), torch.full((3, 2), -2), {})), ValueError, r"got values in \[-2, -2\]"),
    (bad(router=lambda l: Routing(torch.ones(3, 2), torch.full((3, 2), -1), {})), ValueError,
     r"6 inactive slot\(s\) \(expert id -1\) have a non-zero weight"),
    (bad(router=lambda l: Routing(torch.ones(3, 2), torch.ones(3, 2), {})), ValueError, "expert_ids must be an integer tensor"),
    (bad(router=lambda l: Routing(torch.ones(3, 1), torch.zeros(3, 2, dtype=torch.long), {})), ValueError, r"weights shape \(3, 1\) must equal expert_ids shape \(3, 2\)"),
    (bad(router=lambda l: Routing(torch.full((3, 2), float("nan")), torch.zeros(3, 2, dtype=torch.long), {})), ValueError, "NaN"),
    (bad(router=lambda l: Routing(torch.ones(3, 2, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long), {})), ValueError, "weights must be floating point"),
    (bad(router=lambda l: (1, 2)), TypeError, "must return fmoe.routing.Routing"),
    (bad(router=fmoe.routing.topk(9)), ValueError, "k=9 exceeds the number of experts E=8"),
    (lambda: fmoe.routing.topk(0), ValueError, "k must be an int >= 1, got k=0"),
])
def test_bad_input_raises_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _auto_registry_and_properties(rank, world, examples):
    from fmoe import ep
    calls = []

    def counting(x, w, ids, experts, mesh):
        calls.append(x.shape[0])
        return ep.ALL_TO_ALL(x, w, ids, experts, mesh)

    ep.register("counting", counting)
    out = {}
    mesh = fmoe.Mesh(tp=2, ep=2)
    p = fmoe.shard(full_params(), Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
    x, _ = batch(mesh.batch_index, 5)
    with torch.no_grad():
        y_auto, aux_auto = fmoe.moe(p, x, router=fmoe.routing.topk(2), mesh=mesh)
        y_a2a, _ = fmoe.moe(p, x, router=fmoe.routing.topk(2), mesh=mesh, impl="all_to_all")
    out["auto_is_all_reduce"] = int(aux_auto["dispatch_rows"]) == 0 and torch.allclose(y_auto, y_a2a, atol=1e-6)
    y, aux = fmoe.moe(p, x.requires_grad_(True), router=fmoe.routing.topk(2), mesh=mesh)
    out["auto_grad_is_all_to_all"] = int(aux["dispatch_rows"]) > 0 or mesh.rank_in("tp") == 1
    fmoe.moe(p, x, router=fmoe.routing.topk(2), mesh=mesh, impl="counting")
    out["custom_called"] = calls == [5]
    try:
        fmoe.moe(p, x, router=fmoe.routing.topk(2), mesh=fmoe.Mesh(tp=1, ep=2), impl="all_reduce")
        out["all_reduce_rule"] = None
    except ValueError as e:
        out["all_reduce_rule"] = str(e)
    fails = []
    for (tp, ep_size), sizes, seed, k in examples:
        m = fmoe.Mesh(tp=tp, ep=ep_size)
        fails += check_case(m, "all_to_all", RandomRouter(seed, k), sizes[: m.num_batches])
    out["property_fails"] = fails
    return out


MESHES = [(1, 4), (2, 4), (4, 4), (1, 2), (2, 2), (1, 1)]
example = st.tuples(st.sampled_from(MESHES), st.lists(st.integers(0, 6), min_size=4, max_size=4),
                    st.integers(0, 10_000), st.integers(1, E))


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(examples=st.lists(example, min_size=12, max_size=12))
def test_auto_registry_and_random_routings_on_four_ranks(examples):
    for rank, out in enumerate(on_ranks(_auto_registry_and_properties, 4, examples, timeout=300)):
        assert out["auto_is_all_reduce"] and out["auto_grad_is_all_to_all"] and out["custom_called"]
        assert "requires ep == tp" in out["all_reduce_rule"] and "ep=2, tp=1" in out["all_reduce_rule"]
        assert not out["property_fails"], "\n".join(out["property_fails"])
