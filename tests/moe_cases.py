"""Shared pieces of the MoE parity tests: parameters, batches, routers and the checker that
runs on every rank (imported by spawned ranks, so it lives in a plain module)."""

import torch

import fmoe
from fmoe import P, Plan
from fmoe.routing import Routing

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


def check_case(mesh, impl, router_name, sizes, seed=0):
    """Distributed fmoe.moe vs single process on this rank's batch; returns a list of failures."""
    router = ROUTERS[router_name] if isinstance(router_name, str) else router_name
    full = full_params(seed)
    leaves = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    sharded = fmoe.shard(leaves, Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
    b = mesh.batch_index
    x, coef = batch(b, sizes[b])
    y, gx, aux = run(sharded, x, coef, router, mesh, impl)
    grads = fmoe.gather({k: v.grad for k, v in sharded.items()})
    # single-process references: this batch, and every batch of this rank's EP group
    group_batches = sorted({r // mesh.tp for r in mesh.ranks("ep")})
    ref = {}
    for bb in group_batches:
        p1 = {k: v.clone().requires_grad_(True) for k, v in full.items()}
        xb, cb = batch(bb, sizes[bb])
        yb, gxb, auxb = run(p1, xb, cb, router, None, "auto")
        ref[bb] = (yb, gxb, {k: v.grad for k, v in p1.items()}, auxb)
    fails = []

    def close(name, got, want):
        scale = want.abs().max().item() if want.numel() else 0.0
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * max(scale, 1e-3)):
            err = (got - want).abs().max().item() if got.shape == want.shape else f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
            fails.append(f"{name}: {err} (scale {scale})")

    yb, gxb, gpb, auxb = ref[b]
    close("y", y, yb)
    close("grad x", gx, gxb)
    close("grad router", grads["router"], gpb["router"])
    for k in ("w_gate_up", "w_down"):
        want = sum(ref[bb][2][k] for bb in group_batches)
        close(f"grad {k}", grads[k], want)
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
