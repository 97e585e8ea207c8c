"""Exact ReMoE (``fmoe.routing.remoe``: all ``E`` slots, the gate-0 ones inactive, expert id -1)
against top-2 at the same mean experts per token: one MoE layer's forward + backward (aux loss
included), one process, one thread; CPU time and wall time, arms interleaved, medians of 15.

The ReLU gates are shifted by the ``1 - 2/E`` quantile of the logits, so exactly 2 of the ``E``
gates per token are positive on average (``computed_slots`` = 2T, as top-2's). The third arm is
ReMoE as it ran before inactive slots: every slot on a real expert at weight 0 (``E`` slots
computed per token).

Usage::

    python benchmarks/bench_remoe.py
"""
import statistics
import time

import torch

import fmoe
from fmoe import routing

torch.set_num_threads(1)
torch.manual_seed(0)
E, D, I, T = 8, 256, 512, 2048
p0 = {"router": torch.randn(E, D) / D ** 0.5, "w_gate_up": torch.randn(E, 2 * I, D) / D ** 0.5,
      "w_down": torch.randn(E, D, I) / I ** 0.5}
x = torch.randn(T, D)
logits = x @ p0["router"].t()
c = float(torch.quantile(logits.flatten(), 1 - 2 / E))       # shift: exactly 2 of E gates positive per token on average
re = routing.remoe(k=2)
def remoe_exact(lg):
    return re(lg - c, l1_coef=torch.tensor(1e-3))
def remoe_zero_slots(lg):                                    # before inactive slots: every slot computed
    r = remoe_exact(lg)
    return routing.Routing(r.weights, torch.arange(E).expand(T, E), r.aux)
arms = {"top2": routing.topk(2), "remoe_exact": remoe_exact, "remoe_zero_weight_slots": remoe_zero_slots}
def step(router):
    p = {k: v.clone().requires_grad_(True) for k, v in p0.items()}
    y, aux = fmoe.moe(p, x, router=router)
    (y.square().mean() + sum(aux[k] for k, kind in aux["router_keys"].items() if kind == "loss")).backward()
    return aux
for name, r in arms.items():
    a = step(r)
    print(name, "computed slots", float(a["computed_slots"]), "per token", float(a["computed_slots"]) / T)
cpu, wall = {n: [] for n in arms}, {n: [] for n in arms}
for rep in range(15):
    for name, r in arms.items():
        t0, c0 = time.perf_counter(), time.process_time()
        step(r)
        wall[name].append(time.perf_counter() - t0)
        cpu[name].append(time.process_time() - c0)
for name in arms:
    print(f"{name}: median CPU {statistics.median(cpu[name]) * 1e3:.1f} ms, wall {statistics.median(wall[name]) * 1e3:.1f} ms")
print("ratio remoe_exact / top2: CPU %.3f, wall %.3f" % (statistics.median(cpu["remoe_exact"]) / statistics.median(cpu["top2"]),
      statistics.median(wall["remoe_exact"]) / statistics.median(wall["top2"])))
print("ratio zero-weight slots / top2: CPU %.3f" % (statistics.median(cpu["remoe_zero_weight_slots"]) / statistics.median(cpu["top2"])))
