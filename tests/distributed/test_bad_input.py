"""Bad input is refused before any communication: on 2 gloo ranks every case raises a clear
ValueError/TypeError and not a single collective has been issued when it does (so no rank is
ever left waiting in a collective because its peer refused the input)."""

import torch
import torch.distributed as dist

import fmoe
from fmoe import P, Plan
from fmoe.routing import Routing
from helpers import on_ranks
from moe_cases import D, E, I, full_params

COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
               "broadcast", "barrier", "all_gather_object")


def _router_returning(w, ids):
    return lambda logits: Routing(w, ids, {})


def cases(mesh):
    from fmoe.models import qwen3_moe
    params = fmoe.shard(full_params(), Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
    x = torch.randn(3, D)
    top2 = fmoe.routing.topk(2)
    ids = torch.zeros(3, 2, dtype=torch.long)
    moe = lambda p=params, x=x, router=top2, **kw: fmoe.moe(p, x, router=router, mesh=mesh, **kw)  # noqa: E731
    cfg = qwen3_moe.Config.tiny()
    model = qwen3_moe.shard(qwen3_moe.init(cfg), cfg, mesh)
    fwd = lambda toks: qwen3_moe.forward(model, toks, cfg, mesh)  # noqa: E731
    return [
        ("x not 2-D", lambda: moe(x=torch.randn(3, D, 1)), r"x must be a \[T, D\] tensor"),
        ("wrong model dim", lambda: moe(x=torch.randn(3, D + 1)), "x has model dim 9 but the router expects D=8"),
        ("dtype vs params", lambda: moe(x=x.double()), "x dtype torch.float64 differs"),
        ("missing key", lambda: moe(p={k: v for k, v in params.items() if k != "w_down"}), r"missing \['w_down'\]"),
        ("inconsistent I", lambda: moe(p={**params, "w_down": torch.randn(E, D, I + 1)}), "w_down must be"),
        ("unknown impl", lambda: moe(impl="nccl_magic"), "unknown MoE impl 'nccl_magic'"),
        ("mesh without groups", lambda: fmoe.moe(params, x, router=top2, mesh=fmoe.mesh.RankLayout(1)),
         "mesh must be an fmoe.Mesh or None, got RankLayout"),
        ("all_reduce with ep != tp", lambda: moe(impl="all_reduce"), "requires ep == tp"),
        ("ids out of range", lambda: moe(router=_router_returning(torch.ones(3, 2), ids + E)), r"expert_ids must be in \[0, 8\)"),
        ("negative ids", lambda: moe(router=_router_returning(torch.ones(3, 2), ids - 2)), r"got values in \[-2, -2\]"),
        ("weighted inactive slot", lambda: moe(router=_router_returning(torch.ones(3, 2), ids - 1)),
         r"6 inactive slot\(s\) \(expert id -1\) have a non-zero weight"),
        ("float ids", lambda: moe(router=_router_returning(torch.ones(3, 2), ids.float())), "must be an integer tensor"),
        ("weights shape", lambda: moe(router=_router_returning(torch.ones(3, 1), ids)), "weights shape"),
        ("NaN weights", lambda: moe(router=_router_returning(torch.full((3, 2), float("nan")), ids)), "NaN"),
        ("k > E", lambda: moe(router=fmoe.routing.topk(E + 1)), "k=9 exceeds the number of experts E=8"),
        ("k <= 0", lambda: fmoe.routing.topk(0), "k must be an int >= 1"),
        ("tokens out of vocab", lambda: fwd(torch.full((1, 4), cfg.vocab_size)), r"token ids must lie in \[0, 128\)"),
        ("tokens not int", lambda: fwd(torch.zeros(1, 4)), "tokens must be an integer tensor"),
        ("tokens empty", lambda: fwd(torch.zeros(1, 0, dtype=torch.long)), "non-empty"),
        ("plan: tp does not divide heads", lambda: qwen3_moe.check_plan(cfg, None, tp=3), "tp=3 does not divide num_key_value_heads=4"),
        ("plan: unknown style", lambda: qwen3_moe.shard(qwen3_moe.init(cfg), cfg, mesh, {"embed": "rowwize"}), "unknown sharding style 'rowwize'"),
        ("plan: key matching nothing", lambda: qwen3_moe.shard(qwen3_moe.init(cfg), cfg, mesh, {"layers.*.mlp.w_up": "colwise"}), "matches no parameter"),
    ]


def _check(rank, world):
    mesh = fmoe.Mesh(tp=1, ep=2)
    calls = []
    real = {n: getattr(dist, n) for n in COLLECTIVES}
    results = []
    for name, fn, match in cases(mesh):
        for n in COLLECTIVES:                                   # count every collective from here
            setattr(dist, n, lambda *a, _n=n, **k: calls.append(_n) or real[_n](*a, **k))
        calls.clear()
        try:
            fn()
            results.append((name, "no error", []))
        except (ValueError, TypeError) as e:
            import re
            results.append((name, None if re.search(match, str(e)) else f"message {e!s:.200}", list(calls)))
        finally:
            for n, f in real.items():
                setattr(dist, n, f)
    return results


def test_bad_input_raises_before_any_collective():
    for rank, results in enumerate(on_ranks(_check, 2, timeout=300)):
        bad = [(name, problem, calls) for name, problem, calls in results if problem or calls]
        assert not bad, f"rank {rank}: {bad}"
