"""Every router distributed == single process on 4 ranks (outputs, gradients, global aux), and
aux losses over the union of the data-parallel batches (value on every rank; router gradient
summed over one rank per batch; x gradient per batch). One spawn runs all the checks."""

import torch

import fmoe
from fmoe import P, Plan, routing
from fmoe.routing import aux_losses
from helpers import mismatch, on_ranks
from moe_cases import E, SHARED_TP_RULES, batch, check_router_case, full_params, shared_params


def token_inputs(b, n):
    g = torch.Generator().manual_seed(77 + b)
    return {"token_ids": torch.randint(0, 1000, (n,), generator=g)}


def seq_inputs(b, n):
    return {"seq_ids": b * 100 + torch.arange(n) // 3}     # sequences of 3 (the last may be shorter)


def bias():
    return torch.linspace(-0.4, 0.5, E)


def router_cases(tp):
    """name -> (router, extra params, router inputs, extra plan rules)."""
    shared_rules = SHARED_TP_RULES if tp > 1 else None
    return {
        "topk2": (routing.topk(2), None, None, None),
        "topk_softmax3": (routing.topk_softmax(3), None, None, None),
        "group_topk": (routing.group_topk(3, num_groups=4, topk_groups=2), None, None, None),
        "sigmoid_bias": (routing.sigmoid_topk(2, num_groups=2, topk_groups=1, scale=1.5),
                         {"expert_bias": bias()}, None, None),
        "switch": (routing.switch(capacity_factor=1.0, k=2), None, None, None),
        "expert_choice": (routing.expert_choice(capacity_factor=0.5, k=2), None, None, None),
        "expert_choice_max2": (routing.expert_choice(k=2, max_experts=2), None, None, None),
        "hash": (routing.hash_router(k=2), None, token_inputs, None),
        "balanced": (routing.balanced(2), None, None, None),
        "random": (routing.random_topk(3, seed=3), None, None, None),
        "shared": (routing.topk(2), {"shared": shared_params()}, None, shared_rules),
        "losses": (aux_losses.with_losses(routing.topk(2), load_balance=0.1, seq_balance=0.2, z=0.3),
                   None, seq_inputs, None),
        "inactive": (aux_losses.with_losses(remoe_fixed, load_balance=0.1, z=0.3), None, None, None),
    }


def remoe_fixed(logits):
    """ReMoE's ReLU gates with a fixed L1 coefficient: slots of gate 0 inactive (expert id -1)."""
    return routing.remoe(k=2)(logits, l1_coef=torch.tensor(0.01))


MESHES = [(dict(tp=1, ep=4), [5, 0, 3, 2]), (dict(tp=2, ep=2), [4, 3]), (dict(tp=2, ep=4), [0, 5]),
          (dict(tp=1, ep=2, dp_replicate=2), [2, 4, 1, 3])]


def aux_union(mesh, name, router, sizes, extra, inputs):
    """Aux losses on the mesh vs one process on the concatenated batches."""
    full = {**full_params(1), **(extra or {})}
    leaves = {k: v.clone().requires_grad_(k == "router") for k, v in full.items()}
    sharded = fmoe.shard(leaves, Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
    b = mesh.batch_index
    x = batch(b, sizes[b])[0].requires_grad_(True)
    _, aux = fmoe.moe(sharded, x, router=router, mesh=mesh, impl="all_to_all",
                      router_inputs=inputs(b, sizes[b]) if inputs else None)
    aux_losses.total([aux]).backward()
    g = fmoe.gather(sharded["router"].grad)      # honest placements: already the sum over the batches
    xu = torch.cat([batch(bb, n)[0] for bb, n in enumerate(sizes)]).requires_grad_(True)
    iu = {k: torch.cat([inputs(bb, n)[k] for bb, n in enumerate(sizes)]) for k in inputs(0, 1)} if inputs else None
    p1 = {k: v.clone().requires_grad_(k == "router") for k, v in full.items()}
    _, aux1 = fmoe.moe(p1, xu, router=router, router_inputs=iu)
    aux_losses.total([aux1]).backward()
    fails = []

    def check(what, got, want):
        fails.extend([e for e in [mismatch(got.float(), want.float(), what)] if e])

    for key in ("load_balance_loss", "seq_balance_loss", "z_loss", "load", "imbalance"):
        check(key, aux[key].detach(), aux1[key].detach())
    check("summed router grad", g, p1["router"].grad)
    if "expert_bias" in full:               # the bias update on a replicated DTensor bias
        new = routing.update_bias(sharded, aux["load"], rate=0.1)["expert_bias"]
        if fmoe.placement_of(new) != P() or not isinstance(new, type(sharded["expert_bias"])):
            fails.append(f"updated bias placement {fmoe.placement_of(new)!r} / type {type(new).__name__}")
        check("updated bias", fmoe.gather(new), routing.update_bias(full["expert_bias"], aux1["load"], 0.1))
    start = sum(sizes[:b])
    check("x grad", x.grad, xu.grad[start:start + sizes[b]])
    return [f"aux union {name} {mesh!r}: {f}" for f in fails]


def _four_ranks(rank, world):
    fails = []
    for kw, sizes in MESHES:
        mesh = fmoe.Mesh(**kw)
        for name, (router, extra, inputs, rules) in router_cases(mesh.tp).items():
            fails += check_router_case(mesh, "all_to_all", router, sizes, name, extra, inputs, rules)
        if mesh.ep == mesh.tp:
            for name in ("sigmoid_bias", "expert_choice", "shared", "inactive"):
                router, extra, inputs, rules = router_cases(mesh.tp)[name]
                fails += check_router_case(mesh, "all_reduce", router, sizes, name, extra, inputs, rules)
        even = [2 * (n // 2) for n in sizes]                                # whole sequences of 2
        fails += aux_union(mesh, "topk", aux_losses.with_losses(routing.topk(2), load_balance=0.3,
                           seq_balance=0.7, z=0.11, seq_len=2), even, None, None)
        fails += aux_union(mesh, "sigmoid", aux_losses.with_losses(
            routing.sigmoid_topk(2), load_balance=0.3, seq_balance=0.7, z=0.11,
            probs=aux_losses.normalized_sigmoid), sizes, {"expert_bias": bias()}, seq_inputs)
    return fails


def test_routers_and_aux_losses_on_four_ranks():
    fails = sum(on_ranks(_four_ranks, 4, timeout=600), [])
    assert not fails, "\n".join(fails[:40])


def _stat_grads(rank, world):
    """A statistic of detached sums stays detached once summed over the batches; a loss keeps its graph."""
    mesh = fmoe.Mesh(tp=1, ep=2)
    p = fmoe.shard({k: v.requires_grad_(True) for k, v in full_params().items()},
                   Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
    x, _ = batch(rank, 6)
    router = aux_losses.with_losses(remoe_fixed, z=0.3)
    _, aux = fmoe.moe(p, x, router=router, mesh=mesh)
    ec = fmoe.moe(p, x, router=routing.expert_choice(capacity_factor=1.0), mesh=mesh)[1]
    return (aux["active"].requires_grad, aux["load"].requires_grad, aux["z_loss"].requires_grad,
            float(ec["uses_future_tokens"]))


def test_statistics_carry_no_graph_on_two_ranks_and_expert_choice_says_it_looks_ahead():
    assert on_ranks(_stat_grads, 2) == [(False, False, True, 1.0)] * 2
