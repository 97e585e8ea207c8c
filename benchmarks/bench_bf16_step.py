"""bf16 against fp32, eager and compiled: the trainer's step on one process (issue 33, item 4).

Four runners of :func:`fmoe.training.step.train_step` on the same Qwen3-MoE preset (``small`` by
default: D=256, 32 experts top-4, 4 layers, ~27M parameters), the same tokens and initial
weights: ``StepConfig(dtype=...)`` fp32 or bf16 (bf16 compute copies of fp32 masters, the job's
``--dtype bf16``), each eager and with ``compile=True`` (the job's ``--compile``: on one process
forward + loss compiled as one Inductor graph, backward by AOTAutograd), with ``donate=True`` as
the job's step (the optimizer writes into the given weights and moments; ``--no-donate``: copies). The runners alternate
step by step (the order rotated every step) so background load hits them alike; the first
``--warmup`` steps (compilation included) are not timed. Reports the median s/step of each and the
ratios bf16 / fp32 (eager and compiled) and compiled / eager, each the median of per-step ratios,
plus the CPU's bf16 capability.

    python benchmarks/bench_bf16_step.py [--preset small] [--batch 8] [--seq 128] [--steps 8] [--warmup 2]
        [--runners fp32 bf16 fp32+compile bf16+compile] [--profile RUNNER ...] [--no-donate]

``--profile RUNNER [RUNNER ...]`` writes a ``torch.profiler`` table of one step of each runner (after
the timed steps) to ``benchmarks/out/profile_bf16_step_<RUNNER>.txt`` and prints the step split
into categories (:func:`breakdown`: expert GEMMs and their padding, dense GEMMs, SDPA, Inductor's
kernels (named by ``torch._inductor.config.cpp.enable_kernel_profile``, set for the run), the
optimizer, the bf16 casts, other ATen ops, and the Python / dispatch time between ops).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import fmoe
from fmoe.data import TokenStream
from fmoe.models import qwen3_moe
from fmoe.optim.adamw import init as adamw_init
from fmoe.training.step import StepConfig, train_step

RUNNERS = {"fp32": ("fp32", False), "bf16": ("bf16", False), "fp32+compile": ("fp32", True),
           "bf16+compile": ("bf16", True)}


def cpu_bf16() -> dict:
    """The CPU's bf16 support: torch's capability string and the relevant ``/proc/cpuinfo`` flags."""
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()}
    return {"capability": torch.backends.cpu.get_cpu_capability(),
            "flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512f"})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    ap.add_argument("--profile", nargs="+", choices=list(RUNNERS), default=None)
    ap.add_argument("--no-donate", dest="donate", action="store_false",
                    help="copies for the optimizer's update (the job's step donates)")
    ap.add_argument("--out", default="benchmarks/out/bf16_step.json")
    a = ap.parse_args()
    if a.profile:                                   # Inductor's kernels named in the profile
        torch._inductor.config.cpp.enable_kernel_profile = True
    cfg = qwen3_moe.MODEL.preset(a.preset, 1)
    data, mesh = TokenStream.stdlib(400_000), fmoe.Mesh()
    init = fmoe.tree.map_with_path(lambda p, t: t.requires_grad_(not p.endswith("expert_bias")),
                                   qwen3_moe.init(cfg, seed=0))
    runs = {}
    for name in a.runners:
        dtype, compile = RUNNERS[name]
        params = fmoe.tree.map_with_path(lambda p, t: t.detach().clone().requires_grad_(t.requires_grad), init)
        runs[name] = dict(params=params, state=adamw_init(params), cfg=StepConfig(dtype=dtype, compile=compile,
                                                                                      donate=a.donate),
                          times=[], losses=[])
    order = list(runs)
    load_before = os.getloadavg()
    for i in range(a.warmup + a.steps):
        batch = data.batch(i + 1, 0, a.batch, a.seq, seed=0)
        for name in order[i % len(order):] + order[:i % len(order)]:
            r = runs[name]
            t0 = time.perf_counter()
            r["params"], r["state"], m = train_step(qwen3_moe, cfg, r["params"], r["state"], batch, mesh=mesh,
                                                    step_cfg=r["cfg"], lr=1e-3)
            dt = time.perf_counter() - t0
            r["losses"].append(m["loss"])
            if i >= a.warmup:
                r["times"].append(dt)
            elif i == 0:
                print(f"{name}: first step {dt:.1f} s (compilation included)", flush=True)
    med = {n: statistics.median(r["times"]) for n, r in runs.items()}
    ratio = lambda x, y: statistics.median([p / q for p, q in zip(runs[x]["times"], runs[y]["times"])])  # noqa: E731
    ratios = {f"{x} / {y}": ratio(x, y) for x, y in (("bf16", "fp32"), ("bf16+compile", "fp32+compile"),
                                                        ("fp32+compile", "fp32"), ("bf16+compile", "bf16"),
                                                        ("bf16+compile", "fp32"))
              if x in runs and y in runs}
    tokens = a.batch * a.seq
    print(f"| Qwen3-MoE {a.preset}, one process, {tokens} tokens/step | median s/step | tok/s | loss step 1 -> last |")
    print("|---|---|---|---|")
    for n, r in runs.items():
        print(f"| {n} | {med[n]:.4f} | {tokens / med[n]:.0f} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")
    for k, v in ratios.items():
        print(f"{k} = {v:.3f} (median of per-step ratios)")
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.platform(), processor=platform.processor(),
                cpus=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__, cpu=cpu_bf16(),
                loadavg_before=load_before, loadavg_after=os.getloadavg(), args=vars(a))
    print(json.dumps(meta))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, median_s=med, ratios=ratios, times={n: r["times"] for n, r in runs.items()},
                       losses={n: r["losses"] for n, r in runs.items()}), f, indent=2)
    for name in a.profile or ():
        r = runs[name]
        batch = data.batch(10_000, 0, a.batch, a.seq, seed=0)
        wall, prof = profiled_step(lambda: train_step(qwen3_moe, cfg, r["params"], r["state"], batch, mesh=mesh,
                                                      step_cfg=r["cfg"], lr=1e-3))
        path = os.path.join(os.path.dirname(a.out) or ".", f"profile_bf16_step_{name.replace('+', '_')}.txt")
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=120))
        split = breakdown(prof.events(), wall)
        print(f"| {name}: one profiled step, {wall * 1e3:.1f} ms (table: {path}) | ms | share |")
        print("|---|---|---|")
        for k, v in sorted(split.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v * 1e3:.1f} | {v / wall:.1%} |")


#: (category, test on the op's name and the names of the ops and labels around it), first match wins
CATEGORIES = (
    ("optimizer (grad norm, fused AdamW)", lambda n, up: "OPTIM" in up),
    ("cast fp32 masters -> bf16 copies", lambda n, up: "_CastShard" in up),
    ("cast bf16 grads -> fp32", lambda n, up: "_CastShardBackward" in up),
    ("expert GEMMs", lambda n, up: n in GEMMS and any(u.startswith("fmoe::grouped") for u in up)),
    ("expert padding / copies", lambda n, up: any(u.startswith("fmoe::grouped") for u in up)),
    ("Inductor kernels: loss", lambda n, up: "cpp_fused" in n and ("nll_loss" in n or "log_softmax" in n)),
    ("Inductor kernels: other", lambda n, up: "cpp_fused" in n),
    ("SDPA", lambda n, up: "scaled_dot_product" in n),
    ("dense GEMMs (attention, router, lm_head)", lambda n, up: n in GEMMS),
    ("other ATen ops", lambda n, up: n.startswith("aten::")),
    ("Python / autograd / graph wrappers", lambda n, up: True),
)
GEMMS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm")


def profiled_step(fn) -> tuple:
    """``(wall seconds, profiler)`` of one call of ``fn`` under ``torch.profiler``, with Inductor's
    kernels named (``enable_kernel_profile``: set before the runners compile, :func:`main`) and the
    optimizer's step labelled ``OPTIM``."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from fmoe.optim import adamw
    step_flat = adamw.step_flat

    def labelled(*args, **kwargs):
        with record_function("OPTIM"):
            return step_flat(*args, **kwargs)
    adamw.step_flat = labelled
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
    finally:
        adamw.step_flat = step_flat
    return wall, prof


def breakdown(events, wall: float) -> dict:
    """Seconds of one profiled step by :data:`CATEGORIES`: each op's self time goes to the first
    category its name and the names around it match; the time inside no op at all (Python between
    ops) to the last one."""
    out = dict.fromkeys((c for c, _ in CATEGORIES), 0.0)
    inside = 0.0
    for e in events:
        up, p = [], e.cpu_parent
        while p is not None:
            up.append(p.name)
            p = p.cpu_parent
        t = e.self_cpu_time_total / 1e6
        inside += t
        out[next(c for c, test in CATEGORIES if test(e.name, [e.name] + up if e.name == "OPTIM" else up))] += t
    out[CATEGORIES[-1][0]] += wall - inside
    return {k: v for k, v in out.items() if v > 0}

if __name__ == "__main__":
    main()
