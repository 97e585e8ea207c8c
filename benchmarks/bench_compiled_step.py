"""A whole training step compiled as one graph vs eager, on one process.

The step is ``torch.func.grad_and_value`` of the next-token loss plus ``fmoe.optim.adamw.update``
(the trainer's AdamW), on a tiny random Qwen3-MoE, fp32. ``torch.compile(step, fullgraph=True)``
traces it whole: the step counter is a tensor, so there is no host sync, and no torch switch is
needed beyond ``fullgraph=True``. Eager and compiled steps alternate (order swapped every step)
after warm-up (compilation happens in the first compiled call); the report is the median step
time of each and the parameters' largest relative difference after the timed steps (both start
from the same parameters and see the same tokens).

    python benchmarks/bench_compiled_step.py [--steps 10] [--warmup 2] [--layers 2] [--batch 4] [--seq 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fmoe
from fmoe.models import qwen3_moe
from fmoe.optim import adamw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    cfg = qwen3_moe.Config.tiny(num_hidden_layers=a.layers)
    params = qwen3_moe.init(cfg, seed=0)
    toks = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    loss = lambda p: fmoe.nn.cross_entropy(qwen3_moe.forward(p, toks, cfg)[:, :-1], toks[:, 1:])  # noqa: E731

    def step(p, s):
        g, value = torch.func.grad_and_value(loss)(p)
        p, s = adamw.update(g, s, p, lr=1e-3)
        return p, s, value

    compiled = torch.compile(step, fullgraph=True)
    runs = {"eager": [params, adamw.init(params), []], "compiled": [params, adamw.init(params), []]}
    fns = {"eager": step, "compiled": compiled}
    t0 = time.perf_counter()
    for i in range(a.warmup + a.steps):
        for name in (("eager", "compiled") if i % 2 else ("compiled", "eager")):
            p, s, times = runs[name]
            t = time.perf_counter()
            p, s, _ = fns[name](p, s)
            dt = time.perf_counter() - t
            if i >= a.warmup:
                times.append(dt)
            runs[name][:2] = p, s
        if i == 0:
            print(f"first compiled call (compilation) done after {time.perf_counter() - t0:.1f}s")
    pe, pc = fmoe.tree.flatten(runs["eager"][0]), fmoe.tree.flatten(runs["compiled"][0])
    diff = max(((pc[k] - pe[k]).abs().max() / pe[k].abs().max()).item() for k in pe)
    me, mc = statistics.median(runs["eager"][2]), statistics.median(runs["compiled"][2])
    tokens = a.batch * a.seq
    print(f"| tiny Qwen3-MoE, {a.layers} layers, {tokens} tok/step | median s/step | tok/s |")
    print("|---|---|---|")
    print(f"| eager | {me:.4f} | {tokens / me:.0f} |")
    print(f"| compiled (fullgraph) | {mc:.4f} | {tokens / mc:.0f} |")
    print(f"compiled / eager = {mc / me:.3f}; params max relative difference after "
          f"{a.warmup + a.steps} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
