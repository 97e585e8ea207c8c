"""A whole training step compiled as one graph vs eager, on one process.

The step is ``torch.func.grad_and_value`` of the next-token loss plus ``fmoe.optim.adamw.update``
(the trainer's AdamW), on a tiny random Qwen3-MoE, fp32. ``torch.compile(step, fullgraph=True)``
traces it whole: the step counter is a tensor, so there is no host sync, and no torch switch is
needed beyond ``fullgraph=True``. Eager and compiled steps alternate (order swapped every step)
after warm-up (compilation happens in the first compiled call); the report is the median step
time of each and the parameters' largest relative difference after the timed steps (both start
from the same parameters and see the same tokens).

``--mode fwdbwd`` times ``torch.compile(loss)`` + ``.backward()`` instead (the compiled forward
with its AOTAutograd backward, no optimizer). ``--experts/--topk/--hidden/--inter`` size the model
(``--preset`` names the starting point); ``--dtype bf16`` computes in bf16 (the model's weights
cast). The first compiled call's wall time is printed as the cold compile (run with a fresh
``TORCHINDUCTOR_CACHE_DIR`` for a cold cache).

    python benchmarks/bench_compiled_step.py [--steps 10] [--warmup 2] [--layers 2] [--batch 4] [--seq 64]
        [--mode step|fwdbwd] [--preset tiny] [--experts E] [--topk K] [--hidden D] [--inter I] [--dtype fp32|bf16]
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
    ap.add_argument("--mode", choices=("step", "fwdbwd"), default="step")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--experts", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--inter", type=int)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    a = ap.parse_args()
    size = {k: v for k, v in (("num_experts", a.experts), ("num_experts_per_tok", a.topk), ("hidden_size", a.hidden),
                              ("moe_intermediate_size", a.inter)) if v is not None}
    if a.hidden is not None:
        size["head_dim"] = a.hidden // 8
    cfg = getattr(qwen3_moe.Config, a.preset)(num_hidden_layers=a.layers, **size)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    params = fmoe.tree.map_with_path(lambda _, t: t.to(dtype), qwen3_moe.init(cfg, seed=0))
    toks = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    loss = lambda p: fmoe.nn.cross_entropy(qwen3_moe.forward(p, toks, cfg)[:, :-1], toks[:, 1:])  # noqa: E731

    def step(p, s):
        g, value = torch.func.grad_and_value(loss)(p)
        p, s = adamw.update(g, s, p, lr=1e-3)
        return p, s, value

    if a.mode == "fwdbwd":
        def fwdbwd(f):
            def run(p, s):
                leaves = {k: v.detach().requires_grad_(True) for k, v in fmoe.tree.flatten(p).items()}
                value = f(fmoe.tree.unflatten(leaves, like=p))
                value.backward()
                return p, s, value.detach()
            return run
        step, compiled = fwdbwd(loss), fwdbwd(torch.compile(loss))
    else:
        compiled = torch.compile(step, fullgraph=True)
    runs = {"eager": [params, adamw.init(params), []], "compiled": [params, adamw.init(params), []]}
    fns = {"eager": step, "compiled": compiled}
    for i in range(a.warmup + a.steps):
        for name in (("eager", "compiled") if i % 2 else ("compiled", "eager")):
            p, s, times = runs[name]
            t = time.perf_counter()
            p, s, _ = fns[name](p, s)
            dt = time.perf_counter() - t
            if i >= a.warmup:
                times.append(dt)
            runs[name][:2] = p, s
            if i == 0 and name == "compiled":
                print(f"first compiled call (cold compile): {dt:.1f}s")
    pe, pc = fmoe.tree.flatten(runs["eager"][0]), fmoe.tree.flatten(runs["compiled"][0])
    diff = max(((pc[k] - pe[k]).abs().max() / pe[k].abs().max()).item() for k in pe)
    me, mc = statistics.median(runs["eager"][2]), statistics.median(runs["compiled"][2])
    tokens = a.batch * a.seq
    print(f"| Qwen3-MoE ({a.preset} + {size}), {a.layers} layers, {a.dtype}, {a.mode}, {tokens} tok/step | median s/step | tok/s |")
    print("|---|---|---|")
    print(f"| eager | {me:.4f} | {tokens / me:.0f} |")
    print(f"| compiled (fullgraph) | {mc:.4f} | {tokens / mc:.0f} |")
    print(f"compiled / eager = {mc / me:.3f}; params max relative difference after "
          f"{a.warmup + a.steps} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
