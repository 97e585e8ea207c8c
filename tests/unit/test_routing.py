"""Routers, aux losses and load statistics in one process: hand-checked examples (exact ids and
weights), the layer semantics they rely on, bad input, and the aux-loss-free bias update."""

import math

import pytest
import torch

import fmoe
from fmoe import routing
from fmoe.routing import global_stats
from fmoe.routing import Loss, Routing, aux_losses
from fmoe.routing.core import as_stats
from helpers import close
from moe_cases import D, E, batch, full_params, shared_params


def L(*probs):
    """Logits whose softmax over the row is exactly ``probs`` (rows must sum to 1)."""
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def finish(aux):
    """A router's aux as ``fmoe.moe`` finishes it in one process (losses unwrapped, kinds recorded)."""
    stats, kinds = as_stats(aux)
    return {**global_stats.finalize(stats), "router_keys": kinds}


def near(got, want):
    close(got, torch.as_tensor(want, dtype=got.dtype))


# ------------------------------------------------------------------ hand-checked routers
def test_topk_with_and_without_renormalisation():
    logits = L([0.1, 0.2, 0.3, 0.4])
    r = routing.topk(2, normalize=False)(logits)
    assert r.expert_ids.tolist() == [[3, 2]]
    near(r.weights, [[0.4, 0.3]])
    r = routing.topk(2)(logits)
    assert r.expert_ids.tolist() == [[3, 2]]
    near(r.weights, [[4 / 7, 3 / 7]])


def test_softmax_after_topk():
    logits = torch.tensor([[0.0, math.log(3), -5.0, math.log(2)]])
    r = routing.topk_softmax(2)(logits)
    assert r.expert_ids.tolist() == [[1, 3]]
    near(r.weights, [[0.6, 0.4]])                      # softmax over [log 3, log 2]


def test_group_limited_topk():
    # groups of 2: g0 = {0, 1} max .28 / top-2 sum .30; g1 = {2, 3} .22 / .43; g2 = {4, 5} .25 / .27
    logits = L([0.28, 0.02, 0.22, 0.21, 0.25, 0.02])
    r = routing.group_topk(2, num_groups=3, topk_groups=1)(logits)        # best max: g0
    assert r.expert_ids.tolist() == [[0, 1]]
    near(r.weights, [[0.28, 0.02]])
    r = routing.group_topk(2, num_groups=3, topk_groups=2)(logits)        # g0 and g2
    assert r.expert_ids.tolist() == [[0, 4]]
    near(r.weights, [[0.28, 0.25]])
    r = routing.group_topk(2, num_groups=3, topk_groups=1, group_top=2, normalize=True, scale=2.5)(logits)
    assert r.expert_ids.tolist() == [[2, 3]]                              # best top-2 sum: g1
    near(r.weights, [[2.5 * 0.22 / 0.43, 2.5 * 0.21 / 0.43]])
    assert routing.topk(2, normalize=False)(logits).expert_ids.tolist() == [[0, 4]]


def test_sigmoid_bias_selects_but_does_not_weight():
    logits = torch.tensor([[math.log(3), 0.0, -math.log(3), math.log(9)]])   # scores .75 .5 .25 .9
    r = routing.sigmoid_topk(2)(logits)
    assert r.expert_ids.tolist() == [[3, 0]]
    near(r.weights, [[0.9 / 1.65, 0.75 / 1.65]])
    bias = torch.tensor([0.0, 0.5, 0.0, -0.5], requires_grad=True)         # biased: .75 1.0 .25 .4
    lg = logits.clone().requires_grad_(True)
    r = routing.sigmoid_topk(2, scale=2.0)(lg, expert_bias=bias)
    assert r.expert_ids.tolist() == [[1, 0]]
    near(r.weights, [[2.0 * 0.5 / 1.25, 2.0 * 0.75 / 1.25]])            # unbiased scores
    r.weights.sum().backward()
    assert bias.grad is None
    r0 = routing.sigmoid_topk(2, normalize=False)(logits, expert_bias=bias)
    near(r0.weights, [[0.5, 0.75]])
    # DeepSeek-V3 group limit: groups {0,1} (top-2 sum 1.25) beat {2,3} (1.15)
    r = routing.sigmoid_topk(1, normalize=False, num_groups=2, topk_groups=1, group_top=2)(logits)
    assert r.expert_ids.tolist() == [[0]]
    near(r.weights, [[0.75]])


def test_switch_capacity_drops_in_order_and_reports_rate():
    logits = L([0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.4, 0.6])            # C = ceil(1.0 * 4 / 2) = 2
    r = routing.switch(capacity_factor=1.0)(logits)
    assert r.expert_ids.tolist() == [[0], [0], [0], [1]]
    near(r.weights, [[0.9], [0.8], [0.0], [0.6]])                        # third token to e0 dropped
    near(global_stats.finalize(r.aux)["drop_rate"], 0.25)
    # k = 2 (GShard): all first choices are placed before any second choice; C = ceil(3*2/3) = 2
    logits = L([0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.7, 0.2, 0.1])
    r = routing.switch(capacity_factor=1.0, k=2)(logits)
    assert r.expert_ids.tolist() == [[0, 1], [0, 2], [0, 1]]
    near(r.weights, [[0.5, 0.3], [0.6, 0.3], [0.0, 0.2]])
    done = global_stats.finalize(r.aux)
    near(done["drop_rate"], 0.0)                       # drop_rate counts tokens no expert takes: none here
    assert done["load_routed"].tolist() == [3, 2, 1]    # before capacity; after it e0 keeps 2
    assert global_stats.routed_load(r.weights, r.expert_ids, 3)["load"].local().tolist() == [2, 2, 1]
    r = routing.switch(capacity_factor=2.0)(L([0.9, 0.1], [0.8, 0.2], [0.7, 0.3]))
    near(r.weights, [[0.9], [0.8], [0.7]])                               # C = 3: nothing dropped
    near(global_stats.finalize(r.aux)["drop_rate"], 0.0)


def test_expert_choice_zero_one_or_several_experts_per_token():
    r = routing.expert_choice(k=1)(L([0.7, 0.3], [0.6, 0.4], [0.2, 0.8]))    # C = ceil(3/2) = 2
    assert r.expert_ids.tolist() == [[0, 0], [0, 1], [1, 1]]
    near(r.weights, [[0.7, 0.0], [0.6, 0.4], [0.8, 0.0]])
    near(global_stats.finalize(r.aux)["drop_rate"], 0.0)
    logits = L([0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.55, 0.45])           # C = ceil(.5*4/2) = 1
    r = routing.expert_choice(capacity_factor=0.5, max_experts=2)(logits)  # exact: E slots
    assert r.expert_ids.tolist() == [[0, 0], [0, 0], [1, 1], [0, 0]]       # unrouted: best expert, w 0
    near(r.weights, [[0.9, 0.0], [0.0, 0.0], [0.7, 0.0], [0.0, 0.0]])
    near(global_stats.finalize(r.aux)["drop_rate"], 0.5)
    assert global_stats.finalize(r.aux)["load_routed"].tolist() == [3, 1]   # each token's top-1 by score
    r = routing.expert_choice(k=1, max_experts=1)(L([0.7, 0.3], [0.6, 0.4], [0.2, 0.8]))
    assert r.expert_ids.tolist() == [[0], [0], [1]]                        # token 1 keeps its best
    near(r.weights, [[0.7], [0.6], [0.8]])
    near(global_stats.finalize(r.aux)["truncated_rate"], 1 / 4)            # its choice by e1 is cut


def test_expert_choice_default_slots_are_twice_the_mean_and_report_what_they_cut():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    small, exact = routing.expert_choice(2.0)(logits), routing.expert_choice(2.0, max_experts=8)(logits)
    assert small.weights.shape == (64, 4) and exact.weights.shape == (64, 8)   # ceil(2 * 2.0 * 1) = 4 slots
    assert float(global_stats.finalize(exact.aux)["truncated_rate"]) == 0.0
    cut = float(global_stats.finalize(small.aux)["truncated_rate"])
    kept = int((small.weights > 0).sum())
    assert kept == round(16 * 8 * (1 - cut)) and kept <= int((exact.weights > 0).sum())   # C = 16 per expert
    top = exact.weights.topk(4, dim=-1).values                               # the best 4 of the exact slots
    torch.testing.assert_close(small.weights.sort(-1, descending=True).values, top)


def test_hash_router_by_token_id():
    tokens = torch.tensor([0, 1, 2, 1, 100])
    r = routing.hash_router()(torch.zeros(5, 8), token_ids=tokens)
    # ((id * 2654435761) mod 2^32) >> 16 mod 8 for ids 0, 1, 2, 100
    assert r.expert_ids.tolist() == [[0], [7], [6], [7], [((100 * 2654435761) % 2 ** 32 >> 16) % 8]]
    near(r.weights, torch.ones(5, 1))
    r2 = routing.hash_router(k=2)(torch.zeros(5, 8), token_ids=tokens)
    assert r2.expert_ids[:, 0].tolist() == r.expert_ids[:, 0].tolist()    # slot j: salt j
    assert r2.expert_ids[:, 1].tolist() == routing.token_hash(tokens, 8, salt=1).tolist()
    near(r2.weights, torch.full((5, 2), 0.5))
    lg = torch.tensor([[0.0, math.log(3), 0, 0, 0, 0, 0, 0]]).requires_grad_(True)
    rg = routing.hash_router(k=2, gate=True)(lg, token_ids=torch.tensor([1]))   # experts 7 and h(2)
    assert rg.expert_ids.tolist() == [[7, int(routing.token_hash(torch.tensor(2), 8))]]
    w = routing.hash_router()(lg, token_ids=torch.tensor([3])).weights
    w.sum().backward()
    assert torch.equal(lg.grad, torch.zeros_like(lg))                     # in the graph, zero grad


def test_balanced_and_random():
    r = routing.balanced(2)(L([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], [0.25] * 4))
    assert r.expert_ids.tolist() == [[0, 1], [2, 3], [0, 1]]
    near(r.weights, [[1 / 3, 2 / 3], [3 / 7, 4 / 7], [0.5, 0.5]])
    big = routing.balanced(3)(torch.randn(40, 8))
    assert torch.bincount(big.expert_ids.flatten(), minlength=8).tolist() == [15] * 8
    a, b = routing.random_topk(3, seed=4)(torch.zeros(64, 8)), routing.random_topk(3, seed=4)(torch.ones(64, 8))
    assert torch.equal(a.expert_ids, b.expert_ids)                         # reproducible, logit-free
    assert all(len(set(row)) == 3 for row in a.expert_ids.tolist())
    counts = torch.bincount(a.expert_ids.flatten(), minlength=8)
    assert counts.min() > 10 and counts.max() < 40                         # 24 expected each
    assert not torch.equal(a.expert_ids, routing.random_topk(3, seed=5)(torch.zeros(64, 8)).expert_ids)


# ------------------------------------------------------------------ through the layer
def naive(p, x, routing_):
    """Only slots with non-zero weight, token by token."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for k in range(routing_.expert_ids.shape[1]):
            if routing_.weights[t, k] == 0:
                continue
            e = int(routing_.expert_ids[t, k])
            gate, up = (p["w_gate_up"][e] @ x[t]).chunk(2)
            acc = acc + routing_.weights[t, k] * (p["w_down"][e] @ (torch.nn.functional.silu(gate) * up))
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


@pytest.mark.parametrize("router", [routing.expert_choice(capacity_factor=0.25, k=2), routing.switch(1.0, k=2)],
                         ids=["expert_choice", "switch"])
def test_zero_weight_slots_change_nothing(router):
    p = {k: v.requires_grad_(True) for k, v in full_params().items()}
    x, coef = batch(0, 9)
    y, aux = fmoe.moe(p, x, router=router)
    r = router(x @ p["router"].t())
    assert (r.weights == 0).any() and (r.weights != 0).any()
    want = naive(p, x, r)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    g = torch.autograd.grad((y * coef).sum(), list(p.values()))
    gw = torch.autograd.grad((want * coef).sum(), list(p.values()))
    for a, b in zip(g, gw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    routed = torch.zeros(E, dtype=torch.long).index_add(0, r.expert_ids[r.weights != 0],
                                                        torch.ones(int((r.weights != 0).sum()), dtype=torch.long))
    assert torch.equal(aux["load"], routed)
    assert int(aux["tokens_per_expert"].sum()) == r.expert_ids.numel()    # slots, zero-weight included
    near(aux["imbalance"], routed.max() * E / routed.sum())
    near(aux["drop_rate"], (r.weights == 0).all(-1).float().mean())      # tokens no expert takes
    assert aux["router_keys"]["drop_rate"] == "stat" and int(aux["load_routed"].sum()) == 2 * 9   # top-2 of 9


def test_layer_passes_expert_bias_detached_and_router_inputs():
    p = full_params()
    p["expert_bias"] = torch.zeros(E)
    p["expert_bias"][5] = 10.0                                              # forces expert 5
    p = {k: v.requires_grad_(True) for k, v in p.items()}
    x, _ = batch(0, 6)
    y, aux = fmoe.moe(p, x, router=routing.sigmoid_topk(1))
    assert aux["load"].tolist() == [0, 0, 0, 0, 0, 6, 0, 0]
    y.sum().backward()
    assert p["expert_bias"].grad is None and p["router"].grad is not None
    tokens = torch.arange(6) * 7
    _, aux = fmoe.moe(full_params(), x, router=routing.hash_router(), router_inputs={"token_ids": tokens})
    want = torch.bincount(routing.token_hash(tokens, E), minlength=E)
    assert torch.equal(aux["load"], want)


def test_offered_inputs_reach_only_the_routers_that_declare_them():
    """token_ids and layer (routing.OFFERED) are passed to a router, or through a wrapper, only
    when declared."""
    x, _ = batch(0, 6)
    tokens, seen = torch.arange(6) * 7, []

    def per_layer(logits, *, layer, token_ids):
        seen.append(layer)
        return routing.hash_router(seed=layer)(logits, token_ids=token_ids)

    offered = {"token_ids": tokens, "layer": 3}
    loads = [fmoe.moe(full_params(), x, router=r, router_inputs=offered)[1]["load"]
             for r in (routing.topk(2), routing.with_losses(routing.hash_router(), z=1e-3), per_layer)]
    assert int(loads[0].sum()) == 12 and seen == [3]
    assert torch.equal(loads[1], torch.bincount(routing.token_hash(tokens, E), minlength=E))
    assert torch.equal(loads[2], torch.bincount(routing.token_hash(tokens, E, 3), minlength=E))


def test_shared_experts_are_added_with_their_gate():
    p = {**full_params(), "shared": shared_params()}
    x, coef = batch(0, 5)
    y, _ = fmoe.moe(p, x, router=routing.topk(2))
    y0, _ = fmoe.moe(full_params(), x, router=routing.topk(2))
    s = p["shared"]
    gate, up = (x @ s["w_gate_up"].t()).chunk(2, -1)
    dense = (torch.nn.functional.silu(gate) * up) @ s["w_down"].t()
    torch.testing.assert_close(y, y0 + torch.sigmoid(x @ s["gate"].t()) * dense, rtol=1e-5, atol=1e-6)
    p2 = {**full_params(), "shared": shared_params(gate=False)}
    y2, _ = fmoe.moe(p2, x, router=routing.topk(2))
    torch.testing.assert_close(y2, y0 + fmoe.nn.shared_experts.shared_expert(p2["shared"], x), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ aux losses, hand-checked
def test_aux_losses_match_their_definitions():
    logits = torch.tensor([[2.0, 0.0, 0.0, -1.0], [0.0, 1.0, 0.0, 0.0],
                           [0.5, 0.5, 3.0, 0.0], [1.0, 0.0, 0.0, 0.0]], requires_grad=True)
    router = aux_losses.with_losses(routing.topk(1), load_balance=0.1, seq_balance=0.2, z=0.3, seq_len=2)
    r = router(logits)
    out = finish(r.aux)
    p = torch.softmax(logits, -1)
    assert r.expert_ids.flatten().tolist() == [0, 1, 2, 0]
    f = torch.tensor([2, 1, 1, 0]) / 4.0
    lb = 4 * (f * p.mean(0)).sum()
    seq = [4 * (torch.tensor(c) / 2.0 * p[rows].mean(0)).sum() for c, rows in
           (([1, 1, 0, 0], [0, 1]), ([1, 0, 1, 0], [2, 3]))]
    zl = (torch.logsumexp(logits, -1) ** 2).mean()
    near(out["load_balance_loss"], 0.1 * lb)                                # weighted terms
    near(out["seq_balance_loss"], 0.2 * (seq[0] + seq[1]) / 2)
    near(out["z_loss"], 0.3 * zl)
    near(aux_losses.total([out, {"z_loss": torch.tensor(1.0), "router_keys": {"z_loss": "loss"}}]), 0.1 * lb + 0.2 * (seq[0] + seq[1]) / 2 + 0.3 * zl + 1)
    g = torch.autograd.grad(aux_losses.total([out]), logits)[0]
    gw = torch.autograd.grad(0.1 * lb + 0.2 * (seq[0] + seq[1]) / 2 + 0.3 * zl, logits)[0]
    torch.testing.assert_close(g, gw, rtol=1e-5, atol=1e-7)
    # perfectly balanced uniform routing gives 1.0; seq_ids from router inputs group tokens freely
    uni = aux_losses.load_balance_loss(torch.full((4, 4), 0.25), torch.tensor([[0], [1], [2], [3]]))
    near(uni.local(), 1.0)
    assert out["router_keys"] == {"load_balance_loss": "loss", "seq_balance_loss": "loss", "z_loss": "loss"}
    r = aux_losses.with_losses(routing.topk(1), seq_balance=1.0)(logits, seq_ids=torch.tensor([7, 3, 7, 3]))
    by_ids = [4 * (torch.tensor(c) / 2.0 * p[rows].mean(0)).sum() for c, rows in
              (([1, 0, 1, 0], [0, 2]), ([1, 1, 0, 0], [1, 3]))]
    near(finish(r.aux)["seq_balance_loss"], (by_ids[0] + by_ids[1]) / 2)


def test_normalized_sigmoid_probs_for_deepseek_balance():
    logits = torch.tensor([[0.0, math.log(3)], [math.log(3), 0.0]])
    r = aux_losses.with_losses(routing.sigmoid_topk(1), load_balance=1.0,
                               probs=aux_losses.normalized_sigmoid)(logits)
    p = torch.tensor([[0.4, 0.6], [0.6, 0.4]])                              # .5/1.25, .75/1.25
    near(finish(r.aux)["load_balance_loss"], 2 * (0.5 * p.mean(0)).sum())


def test_load_statistics_and_stacking():
    r = Routing(torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.2, 0.8]]), torch.tensor([[0, 1], [0, 3], [0, 0]]), {})
    out = global_stats.finalize(global_stats.routed_load(r.weights, r.expert_ids, 4))
    assert out["load"].tolist() == [4, 1, 0, 0] and out["load"].dtype == torch.int64   # zero weight not counted
    near(out["imbalance"], 4 * 4 / 5)
    near(global_stats.imbalance(torch.zeros(4, dtype=torch.long)), 1.0)
    per_layer = [{"imbalance": torch.tensor(2.0), "load": torch.arange(4)},
                 {"imbalance": torch.tensor(1.0), "load": torch.ones(4, dtype=torch.long), "z_loss": torch.tensor(1.)}]
    st = global_stats.stack_layers(per_layer)
    assert sorted(st) == ["imbalance", "load"] and st["load"].shape == (2, 4)
    with pytest.raises(ValueError, match=r"keys \['z_loss'\] are missing"):
        global_stats.stack_layers(per_layer, keys=["z_loss"])


# ------------------------------------------------------------------ aux-loss-free balancing
def test_bias_update_moves_load_toward_balance():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(E, 16, generator=g) * 0.3
    skew = torch.linspace(2.0, -2.0, E)                       # expert 0 strongly preferred
    router = routing.sigmoid_topk(2)
    bias = torch.zeros(E)

    def imbalance_now(b):
        x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(99))
        ids = router(x @ w.t() + skew, expert_bias=b).expert_ids
        return float(global_stats.imbalance(torch.bincount(ids.flatten(), minlength=E)))

    before = imbalance_now(bias)
    for _ in range(300):
        x = torch.randn(256, 16, generator=g)
        ids = router(x @ w.t() + skew, expert_bias=bias).expert_ids
        bias = routing.update_bias(bias, torch.bincount(ids.flatten(), minlength=E), rate=0.01)
    after = imbalance_now(bias)
    assert before > 2.5 and after < 1.25, (before, after)
    assert bias[0] < bias[-1]                                 # the popular expert is penalised


def test_update_bias_forms_and_layer_loop():
    near(routing.update_bias(torch.zeros(3), torch.tensor([5, 1, 0]), rate=0.1), [-0.1, 0.1, 0.1])
    p = {**full_params(), "expert_bias": torch.zeros(E)}
    new = routing.update_bias(p, torch.tensor([9, 1, 1, 1, 1, 1, 1, 1]), rate=0.5)
    assert new is not p and new["router"] is p["router"] and torch.equal(p["expert_bias"], torch.zeros(E))
    near(new["expert_bias"], [-0.5] + [0.5] * 7)
    model = {"layers": [{"moe": dict(p)}, {"moe": dict(p)}], "embed": torch.zeros(2)}
    out = routing.update_bias(model, {"layers.1.moe": torch.arange(E), "layers.0.moe.expert_bias": torch.ones(E)}, 1.0)
    near(out["layers"][0]["moe"]["expert_bias"], torch.zeros(E))           # equal load: unchanged
    near(out["layers"][1]["moe"]["expert_bias"], [1.0] * 4 + [-1.0] * 4)
    # a few layer steps: the bias follows aux["load"] and the load spreads out
    p = {**full_params(), "expert_bias": torch.zeros(E)}
    p["router"] = p["router"] + torch.linspace(1.5, -1.5, E).unsqueeze(1)
    x, _ = batch(0, 64)
    first = None
    for _ in range(60):
        _, aux = fmoe.moe(p, x, router=routing.sigmoid_topk(2))
        first = float(aux["imbalance"]) if first is None else first
        p = routing.update_bias(p, aux["load"], rate=0.05)
    assert float(aux["imbalance"]) < first


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("call,exc,match", [
    (lambda: routing.group_topk(2, num_groups=3, topk_groups=4), ValueError, "topk_groups=4 exceeds num_groups=3"),
    (lambda: routing.group_topk(2, num_groups=3, topk_groups=1)(torch.zeros(2, 8)), ValueError,
     "num_groups=3 must divide the number of experts E=8"),
    (lambda: routing.group_topk(3, num_groups=4, topk_groups=1)(torch.zeros(2, 8)), ValueError,
     r"k=3 exceeds the experts in 1 of 4 groups \(2\)"),
    (lambda: routing.sigmoid_topk(2)(torch.zeros(2, 8), expert_bias=torch.zeros(7)), ValueError,
     r"expert_bias must be a \[E=8\] tensor"),
    (lambda: routing.switch(capacity_factor=0), ValueError, "capacity_factor must be a number > 0, got 0"),
    (lambda: routing.expert_choice(max_experts=9)(torch.zeros(2, 8)), ValueError, "k=9 exceeds the number of experts E=8"),
    (lambda: routing.hash_router()(torch.zeros(3, 8), token_ids=torch.zeros(2, dtype=torch.long)), ValueError,
     r"token_ids must be a \[T=3\] integer tensor, got \(2,\)"),
    (lambda: routing.update_bias(torch.zeros(4), torch.zeros(3)), ValueError, r"shape \(4,\)"),
    (lambda: routing.update_bias({"router": torch.zeros(1)}, torch.zeros(3)), ValueError, "params has no 'expert_bias'"),
    (lambda: routing.update_bias({"a": {"expert_bias": torch.zeros(2)}}, {"b": torch.zeros(2)}), ValueError,
     r"no expert bias at 'b.expert_bias'.*\['a.expert_bias'\]"),
    (lambda: routing.update_bias(torch.zeros(2), torch.zeros(2), rate=-1), ValueError, "rate must be a number >= 0"),
    (lambda: aux_losses.with_losses(routing.topk(1), seq_balance=1.0)(torch.zeros(2, 4)), ValueError,
     "seq_balance needs seq_len=S"),
    (lambda: aux_losses.with_losses(routing.topk(1), seq_balance=1.0, seq_len=3)(torch.zeros(4, 4)), ValueError,
     "T=4 tokens is not a whole number of sequences of seq_len=3"),
    (lambda: aux_losses.with_losses(routing.topk(1), z="big"), TypeError, "z must be a number or None"),
    (lambda: aux_losses.total([{"z_loss": aux_losses.z_loss(torch.zeros(2, 2)), "router_keys": {"z_loss": "loss"}}]),
     ValueError, r"aux\['z_loss'\] must be a scalar tensor \(finalized by fmoe.moe\), got GlobalStat"),
    (lambda: routing.validate(Routing(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), {"n": 3}), 2, 4),
     TypeError, r"aux\['n'\] is int; an aux entry is fmoe.routing.Loss"),
    (lambda: routing.validate(Routing(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long),
                                      {"my_loss": torch.tensor(1.0)}), 2, 4),
     TypeError, r"aux\['my_loss'\] is a bare Tensor named like a loss; wrap it in fmoe.routing.Loss"),
    (lambda: routing.validate(Routing(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long),
                                      {"p": Loss(torch.ones(2))}), 2, 4), TypeError, r"aux\['p'\] = Loss\(tensor of shape \(2,\)\)"),
    (lambda: routing.validate(Routing(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long),
                                      {"load": torch.ones(4)}), 2, 4), TypeError, r"aux\['load'\]: the layer writes"),
    (lambda: fmoe.moe(full_params(), torch.zeros(3, D), router=routing.hash_router()), ValueError,
     r"needs keyword input\(s\) \['token_ids'\]"),
    (lambda: fmoe.moe(full_params(), torch.zeros(3, D), router=routing.topk(2), router_inputs={"positions": 1}),
     ValueError, r"does not accept keyword input\(s\) \['positions'\]"),
    (lambda: fmoe.moe({**full_params(), "expert_bias": torch.zeros(E)}, torch.zeros(3, D), router=routing.topk(2)),
     ValueError, r"does not accept keyword input\(s\) \['expert_bias'\]"),
    (lambda: fmoe.moe(full_params(), torch.zeros(3, D), router=routing.topk(2), router_inputs=[1]), TypeError,
     "router_inputs must be a mapping"),
    (lambda: fmoe.moe({**full_params(), "expert_bias": torch.zeros(E + 1)}, torch.zeros(3, D), router=routing.topk(2)),
     ValueError, r"expert_bias must have shape \(8,\)"),
    (lambda: fmoe.moe({**full_params(), "shared": {"w_gate_up": torch.zeros(6, D)}}, torch.zeros(3, D),
                      router=routing.topk(2)), ValueError, r"params\['shared'\] is missing \['w_down'\]"),
    (lambda: fmoe.moe({**full_params(), "shared": {"w_gate_up": torch.zeros(6, D), "w_down": torch.zeros(D, 4)}},
                      torch.zeros(3, D), router=routing.topk(2)), ValueError,
     r"params\['shared'\]\['w_down'\] must be \[D=8, I=3\], got \(8, 4\)"),
])
def test_bad_input_raises_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("bad_id, message", [(E, rf"expert_ids must be in \[0, {E}\) or -1"),
                                             (-2, r"expert_ids must be in \[0, 8\) or -1 \(an inactive slot\)"),
                                             (-1, r"1 inactive slot\(s\) \(expert id -1\) have a non-zero weight")])
def test_with_losses_refuses_expert_ids_out_of_range_with_the_documented_error(bad_id, message):
    def broken(logits):
        ids = torch.zeros(logits.shape[0], 2, dtype=torch.long)
        ids[1, 1] = bad_id
        return Routing(torch.full(ids.shape, 0.5), ids, {})

    router = aux_losses.with_losses(broken, load_balance=0.01, z=1e-3)
    with pytest.raises(ValueError, match=message):
        router(torch.randn(4, E))


def test_inactive_slots_are_neither_computed_nor_counted():
    """Slots with expert id -1 (weight 0: ReMoE's gates at 0) give the output and gradients of the
    same weights on real experts, count in no statistic, and cost no expert FLOPs: the eager loop
    path and the grouped operators under torch.func compute the active slots only."""
    from torch.utils.flop_counter import FlopCounterMode

    T = 32
    p = full_params()
    I = p["w_down"].shape[2]
    x, _ = batch(0, T)
    sparse = lambda lg: routing.remoe(k=2)(lg, l1_coef=torch.tensor(0.01))     # noqa: E731

    def dense(lg):                                      # the same weights, every slot on a real expert
        r = sparse(lg)
        return Routing(r.weights, torch.arange(E).expand(T, E), r.aux)

    runs = {}
    for name, r in (("sparse", sparse), ("dense", dense)):
        w = p["w_down"].clone().requires_grad_(True)
        with FlopCounterMode(display=False) as eager:
            y, aux = fmoe.moe({**p, "w_down": w}, x, router=r, matmul="loop")
        y.square().sum().backward()
        with FlopCounterMode(display=False) as traced:
            torch.func.grad(lambda v: fmoe.moe({**p, "w_down": v}, x, router=r)[0].square().sum())(p["w_down"])
        runs[name] = (y, w.grad, aux, eager.get_total_flops(), traced.get_total_flops())
    (y, g, aux, f_eager, f_traced), (y2, g2, aux2, _, _) = runs["sparse"], runs["dense"]
    A = int((sparse(x @ p["router"].t()).expert_ids >= 0).sum())
    assert 0 < A < T * E
    near(y, y2)
    near(g, g2)
    assert torch.equal(aux["load"], aux2["load"]) and int(aux["tokens_per_expert"].sum()) == A
    assert float(aux["computed_slots"]) == A and float(aux2["computed_slots"]) == T * E   # logged per layer
    router_flops = 2 * T * D * E
    assert f_eager == router_flops + 6 * A * D * I                    # gate_up and down GEMMs, active slots only
    assert f_traced == router_flops + 8 * A * D * I                   # + the w_down gradient
    assert runs["dense"][3] == router_flops + 6 * T * E * D * I
