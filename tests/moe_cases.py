"""Shared pieces of the MoE parity tests: parameters, batches, routers and the checker that
runs on every rank (imported by spawned ranks, so it lives in a plain module)."""

import torch

import fmoe
from fmoe import P, Plan
from fmoe.routing import Routing
from helpers import mismatch

E, D, I = 8, 8, 4


def full_params(seed=0, e=E, d=D, i=I):
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(e, d, generator=g), "w_gate_up": torch.randn(e, 2 * i, d, generator=g) / d ** 0.5,
            "w_down": torch.randn(e, d, i, generator=g) / i ** 0.5}


def batch(b, n, d=D):
    """Tokens of data-parallel batch ``b`` (n may be 0) and its loss coefficients."""
    g = torch.Generator().manual_seed(1000 + b)
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)


def one_rank_router(logits):          # every token to experts 0 and 1 (both on ep rank 0)
    w = torch.softmax(logits[:, :2].float(), -1)
    return Routing(w, torch.tensor([0, 1]).expand(logits.shape[0], 2).contiguous(), {})


def duplicate_router(logits):         # the same expert twice per token, plus a neighbour on the same rank
    top = logits.argmax(-1)
    pair = (top // 2) * 2
    ids = torch.stack([top, top, pair + (1 - top % 2)], -1)
    w = torch.softmax(logits.gather(1, ids).float(), -1)
    return Routing(w, ids, {})


ROUTERS = {
    "top2": fmoe.routing.topk(2),
    "top1": fmoe.routing.topk(1),
    "topE": fmoe.routing.topk(E, normalize=False),
    "top3_softmax": fmoe.routing.topk_softmax(3),
    "one_rank": one_rank_router,
    "duplicate": duplicate_router,
}


def run(params, x, coef, router, mesh, impl, matmul="auto"):
    """Forward + backward of loss = sum(y * coef); returns output and the gradient leaves."""
    x = x.clone().requires_grad_(True)
    y, aux = fmoe.moe(params, x, router=router, mesh=mesh, impl=impl, matmul=matmul)
    (y * coef).sum().backward()
    return y.detach(), x.grad, aux


def expected_dispatch_rows(ids, e_local, mesh):
    T = ids.shape[0]
    base, extra = divmod(T, mesh.tp)
    t = mesh.rank_in("tp")
    start = t * base + min(t, extra)
    stop = start + base + (1 if t < extra else 0)
    me = mesh.rank_in("ep")
    return sum(len({int(e) // e_local for e in row} - {me}) for row in ids[start:stop])


def check_case(mesh, impl, router_name, sizes, seed=0, matmul="auto"):
    """Distributed fmoe.moe vs single process on this rank's batch; returns a list of failures.
    ``matmul="loop"`` forces the blocked CPU expert path (``"auto"`` takes it only from
    ``fmoe.experts.BLOCKED_MIN_ROWS`` rows per expert, more than these tiny batches have)."""
    router = ROUTERS[router_name] if isinstance(router_name, str) else router_name
    full = full_params(seed)
    leaves = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    sharded = fmoe.shard(leaves, Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
    b = mesh.batch_index
    x, coef = batch(b, sizes[b])
    y, gx, aux = run(sharded, x, coef, router, mesh, impl, matmul)
    grads = fmoe.gather({k: v.grad for k, v in sharded.items()})
    # single-process references: every batch (the gathered gradients are honest: every leaf
    # holds the gradient of the sum over all distinct batches, see fmoe.sharding.to_local)
    group_batches = list(range(mesh.num_batches))
    ref = {}
    for bb in group_batches:
        p1 = {k: v.clone().requires_grad_(True) for k, v in full.items()}
        xb, cb = batch(bb, sizes[bb])
        yb, gxb, auxb = run(p1, xb, cb, router, None, "auto")
        ref[bb] = (yb, gxb, {k: v.grad for k, v in p1.items()}, auxb)
    fails = []

    def check(name, got, want, rel=None):
        fails.extend([e for e in [mismatch(got, want, name, rtol=rel, atol=rel or 1e-6)] if e])   # rel: cancellations too

    yb, gxb, _, auxb = ref[b]
    check("y", y, yb)
    check("grad x", gx, gxb)
    # The router gradient passes through the softmax backward w * (g - sum_k w g): with K = E
    # random (duplicate) slots the difference cancels, so fp32 rounding differences in the
    # expert outputs (grouped GEMMs over different row counts) grow to ~3e-5 of the largest
    # value (seen with a hypothesis-found routing); a wrong scale or a missing term is O(1).
    check("grad router", grads["router"], sum(ref[bb][2]["router"] for bb in group_batches), rel=1e-4)
    for k in ("w_gate_up", "w_down"):
        want = sum(ref[bb][2][k] for bb in group_batches)
        check(f"grad {k}", grads[k], want)
        if sharded[k].grad is None:
            fails.append(f"grad {k} missing")
    if not torch.equal(aux["tokens_per_expert"], auxb["tokens_per_expert"]):
        fails.append("tokens_per_expert")
    if impl == "all_to_all":
        ids = router(x @ full["router"].t()).expert_ids
        want_rows = expected_dispatch_rows(ids, E // mesh.ep, mesh)
        if int(aux["dispatch_rows"]) != want_rows:
            fails.append(f"dispatch_rows {int(aux['dispatch_rows'])} != {want_rows}")
    return [f"{impl} tp={mesh.tp} ep={mesh.ep} {router_name} sizes={sizes} rank={mesh.rank}: {f}" for f in fails]


class RandomRouter:
    """Random expert ids (duplicates allowed) with weights from the logits; deterministic for
    a given (seed, T) so that the single-process reference sees the same routing."""

    def __init__(self, seed, k):
        self.seed, self.k = seed, k

    def __call__(self, logits):
        T = logits.shape[0]
        g = torch.Generator().manual_seed(self.seed * 1000 + T)
        ids = torch.randint(0, logits.shape[1], (T, self.k), generator=g)
        return Routing(torch.softmax(logits.gather(1, ids).float(), -1), ids, {})

    def __repr__(self):
        return f"RandomRouter(seed={self.seed}, k={self.k})"


# ---------------------------------------------------------------------------------------------
# Routing kit (tests/distributed/test_routing_parity.py): any router, extra params (expert_bias, shared
# experts), per-batch router inputs, and the layer's global aux (losses, rates, load).

SHARED_TP_RULES = {"shared.w_gate_up": "packed_colwise", "shared.w_down": "rowwise"}


def shared_params(seed=0, d=D, i=4, gate=True):
    g = torch.Generator().manual_seed(500 + seed)
    out = {"w_gate_up": torch.randn(2 * i, d, generator=g) / d ** 0.5,
           "w_down": torch.randn(d, i, generator=g) / i ** 0.5}
    if gate:
        out["gate"] = torch.randn(1, d, generator=g)
    return out


def _tree_map(fn, tree, path=""):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v, f"{path}.{k}" if path else k) for k, v in tree.items()}
    return fn(path, tree)


def run_inputs(params, x, coef, router, mesh, impl, router_inputs=None):
    """Forward + backward of loss = sum(y * coef) with router inputs; returns y, grad x, aux."""
    x = x.clone().requires_grad_(True)
    y, aux = fmoe.moe(params, x, router=router, mesh=mesh, impl=impl, router_inputs=router_inputs)
    (y * coef).sum().backward()
    return y.detach(), x.grad, aux


def _global_reference(full, router, sizes, inputs):
    """Per-batch single-process routing stats summed over all batches, then finished."""
    from fmoe.routing.global_stats import GlobalStat
    from fmoe.routing import call
    sums, finishes, load = {}, {}, None
    for bb, n in enumerate(sizes):
        xb, _ = batch(bb, n)
        extra = {"expert_bias": full["expert_bias"]} if "expert_bias" in full else {}
        r = call(router, xb @ full["router"].t(), {**(inputs(bb, n) if inputs else {}), **extra})
        for key, st in r.aux.items():
            if isinstance(st, GlobalStat):
                finishes[key] = st.finish
                acc = sums.setdefault(key, {})
                for name, t in st.sums.items():
                    acc[name] = acc[name] + t.detach() if name in acc else t.detach()
        counts = torch.zeros(E, dtype=torch.int64)
        for t, k in zip(*torch.nonzero(r.weights != 0, as_tuple=True)):
            counts[int(r.expert_ids[t, k])] += 1
        load = counts if load is None else load + counts
    want = {key: finishes[key](s) for key, s in sums.items()}
    want["load"] = load
    want["imbalance"] = (load.max() * E / load.sum()).float() if load.sum() > 0 else torch.tensor(1.0)
    return want


def check_router_case(mesh, impl, router, sizes, name, extra=None, inputs=None, rules=None, seed=0):
    """Distributed fmoe.moe vs single process for any router: outputs, gradients (x, router,
    experts, shared experts), no gradient for expert_bias, and the layer's global aux entries
    (every GlobalStat, load, imbalance) vs per-batch single-process routing summed over batches."""
    full = {**full_params(seed), **(extra or {})}
    leaves = _tree_map(lambda p, v: v.clone().requires_grad_(p != "expert_bias"), full)
    sharded = fmoe.shard(leaves, Plan({"w_*": P("ep", None, None), **(rules or {})}, default=P()), mesh)
    b = mesh.batch_index
    x, coef = batch(b, sizes[b])
    y, gx, aux = run_inputs(sharded, x, coef, router, mesh, impl, inputs(b, sizes[b]) if inputs else None)
    grads = fmoe.gather(_tree_map(lambda p, v: v.grad, {k: v for k, v in sharded.items() if k != "expert_bias"}))
    group_batches = list(range(mesh.num_batches))          # gathered gradients: sum over every batch
    ref = {}
    for bb in group_batches:
        p1 = _tree_map(lambda p, v: v.clone().requires_grad_(p != "expert_bias"), full)
        xb, cb = batch(bb, sizes[bb])
        yb, gxb, auxb = run_inputs(p1, xb, cb, router, None, "auto", inputs(bb, sizes[bb]) if inputs else None)
        ref[bb] = (yb, gxb, _tree_map(lambda p, v: v.grad, {k: v for k, v in p1.items() if k != "expert_bias"}), auxb)
    fails = []

    def check(what, got, want):
        fails.extend([e for e in [mismatch(got.float(), want.float(), what)] if e])

    yb, gxb, _, auxb = ref[b]
    check("y", y, yb)
    check("grad x", gx, gxb)
    for k in ("router", "w_gate_up", "w_down"):
        check(f"grad {k}", grads[k], sum(ref[bb][2][k] for bb in group_batches))
    for k in (extra or {}).get("shared", {}):
        check(f"grad shared.{k}", grads["shared"][k], sum(ref[bb][2]["shared"][k] for bb in group_batches))
    if "expert_bias" in sharded and sharded["expert_bias"].grad is not None:
        fails.append("expert_bias received a gradient")
    if not torch.equal(aux["tokens_per_expert"], auxb["tokens_per_expert"]):
        fails.append("tokens_per_expert")
    want = _global_reference(full, router, sizes, inputs)
    for key, value in want.items():
        if key not in aux:
            fails.append(f"aux[{key!r}] missing")
        else:
            check(f"aux[{key!r}]", aux[key].detach(), value)
    return [f"{name} {impl} tp={mesh.tp} ep={mesh.ep} dpr={mesh.dp_replicate} sizes={sizes} "
            f"rank={mesh.rank}: {f}" for f in fails]
