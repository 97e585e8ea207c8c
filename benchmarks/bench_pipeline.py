"""The pipeline's bubble: each stage's idle share of a step, 1F1B against GPipe, on gloo ranks.

Runs the real job (``fmoe.training.run``) with ``--pp 2`` on 2 local gloo ranks for each schedule
and each micro-batch count, and reads the log rows: ``pp_idle`` (per stage, the share of the
schedule it spent blocked on a peer: receiving an activation or a gradient, or waiting for its
sends) and ``step_time``; the medians over the steps after the first (warm-up). The runs alternate
schedule by schedule for each ``M`` so background load hits both alike.

Theory for equal stages (forward ``f``, backward ``b`` per micro-batch, no communication cost):
both schedules idle ``(pp - 1) / (M + pp - 1)`` of the step; 1F1B holds at most ``pp - s``
micro-batches' activations on stage ``s`` where GPipe holds ``M``. On gloo the exchange itself
(a copy through the loopback) adds to the waiting.

Usage::

    python benchmarks/bench_pipeline.py --micro 2 4 8 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile

import torch


def cpu_name() -> str:
    """The ``lscpu`` model name (the machine of the numbers)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def run(schedule: str, micro: int, steps: int, preset: str, rows: int, seq: int) -> dict:
    """One job; the medians of its log rows after the first step."""
    import fmoe
    from fmoe.training import JobConfig

    with tempfile.TemporaryDirectory() as out:
        fmoe.training.run(JobConfig(model="qwen3_moe", preset=preset, nproc=2, pp=2, microbatches=micro,
                                    pp_schedule=schedule, batch=rows * micro, seq=seq, steps=steps, warmup=1,
                                    quiet=True, out=os.path.join(out, "run")))
        with open(os.path.join(out, "run", "log.jsonl")) as f:
            rows_ = [json.loads(line) for line in f][1:]
    idle = [statistics.median(r["pp_idle"][s] for r in rows_) for s in range(2)]
    return {"idle": idle, "step_time": statistics.median(r["step_time"] for r in rows_)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rows", type=int, default=1, help="rows per micro-batch")
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    print(f"# {cpu_name()}, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.1f}; qwen3_moe {args.preset}, pp2 on 2 gloo ranks, {args.rows} row(s) x "
          f"{args.seq} tokens per micro-batch, median of steps 2..{args.steps}")
    print("| M | theory (pp-1)/(M+pp-1) | 1F1B idle stage 0 / 1 | GPipe idle stage 0 / 1 | 1F1B step s | GPipe step s |")
    print("|---|---|---|---|---|---|")
    for m in args.micro:
        res = {s: run(s, m, args.steps, args.preset, args.rows, args.seq) for s in ("1f1b", "gpipe")}
        a, b = res["1f1b"], res["gpipe"]
        print(f"| {m} | {1 / (m + 1):.2f} | {a['idle'][0]:.2f} / {a['idle'][1]:.2f} | {b['idle'][0]:.2f} / "
              f"{b['idle'][1]:.2f} | {a['step_time']:.3f} | {b['step_time']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
