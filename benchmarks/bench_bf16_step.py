"""bf16 against fp32, eager and compiled: the trainer's step on one process (issue 33, item 4).

Four runners of :func:`fmoe.training.step.train_step` on the same Qwen3-MoE preset (``small`` by
default: D=256, 32 experts top-4, 4 layers, ~27M parameters), the same tokens and initial
weights: ``StepConfig(dtype=...)`` fp32 or bf16 (bf16 compute copies of fp32 masters, the job's
``--dtype bf16``), each eager and with ``compile=True`` (the job's ``--compile``: on one process
forward + loss compiled as one Inductor graph, backward by AOTAutograd). The runners alternate
step by step (the order rotated every step) so background load hits them alike; the first
``--warmup`` steps (compilation included) are not timed. Reports the median s/step of each and the
ratios bf16 / fp32 (eager and compiled) and compiled / eager, each the median of per-step ratios,
plus the CPU's bf16 capability.

    python benchmarks/bench_bf16_step.py [--preset small] [--batch 8] [--seq 128] [--steps 8] [--warmup 2]
        [--runners fp32 bf16 fp32+compile bf16+compile] [--profile RUNNER]

``--profile RUNNER`` writes a ``torch.profiler`` table of one step of that runner (after the
timed steps) to ``benchmarks/out/profile_bf16_step_<RUNNER>.txt``.
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
    ap.add_argument("--profile", choices=list(RUNNERS), default=None)
    ap.add_argument("--out", default="benchmarks/out/bf16_step.json")
    a = ap.parse_args()
    cfg = qwen3_moe.MODEL.preset(a.preset, 1)
    data, mesh = TokenStream.stdlib(400_000), fmoe.Mesh()
    init = fmoe.tree.map_with_path(lambda p, t: t.requires_grad_(not p.endswith("expert_bias")),
                                   qwen3_moe.init(cfg, seed=0))
    runs = {}
    for name in a.runners:
        dtype, compile = RUNNERS[name]
        params = fmoe.tree.map_with_path(lambda p, t: t.detach().clone().requires_grad_(t.requires_grad), init)
        runs[name] = dict(params=params, state=adamw_init(params), cfg=StepConfig(dtype=dtype, compile=compile),
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
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        r = runs[a.profile]
        batch = data.batch(10_000, 0, a.batch, a.seq, seed=0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_step(qwen3_moe, cfg, r["params"], r["state"], batch, mesh=mesh, step_cfg=r["cfg"], lr=1e-3)
        path = os.path.join(os.path.dirname(a.out) or ".", f"profile_bf16_step_{a.profile.replace('+', '_')}.txt")
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        print(f"profile: {path}")


if __name__ == "__main__":
    main()
