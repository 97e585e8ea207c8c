"""Context parallelism against sequence parallelism at equal ranks, on gloo ranks (issue 45).

Runs the real job (``fmoe.training.run``) on a long sequence for each layout over the same ranks
(``--tp N --sp``, ``--cp N``, and their mix ``--tp 2 --sp --cp N/2``; experts over all ranks,
``--ep N``) and reads the log rows: ``rank_step_time`` (seconds, each rank) and ``sent_bytes``
(each rank's bytes handed to collectives in the step, K/V all-gathers and all-to-alls included);
the medians over the steps after the first (warm-up).

Usage::

    python benchmarks/bench_cp.py --nproc 4 --seq 4096 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

import fmoe.training
from fmoe.training import JobConfig


def layouts(n: int) -> dict:
    out = {f"tp{n} --sp": dict(tp=n, sp=True), f"cp{n}": dict(cp=n)}
    if n >= 4:
        out[f"tp2 --sp x cp{n // 2}"] = dict(tp=2, sp=True, cp=n // 2)
    return out


def run(kw: dict, args, out: str) -> dict:
    fmoe.training.run(JobConfig(model=args.model, preset=args.preset, nproc=args.nproc, ep=args.nproc, batch=1,
                                seq=args.seq, steps=args.steps, warmup=1, quiet=True, out=out, **kw))
    with open(os.path.join(out, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"step"' in line]
    rows = [r for r in rows if "rank_step_time" in r][1:]           # after the warm-up step
    return {"step_s": statistics.median(max(r["rank_step_time"]) for r in rows),
            "sent_mb": statistics.median(max(r["sent_bytes"]) for r in rows) / 1e6,
            "loss": rows[-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", default="qwen3_moe")
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    print(f"# {args.model} {args.preset}, {args.nproc} gloo ranks, batch 1 x seq {args.seq}, fp32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| layout | step s (slowest rank, median) | sent MB per rank per step (max over ranks) | last loss |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in layouts(args.nproc).items():
            r = run(kw, args, os.path.join(tmp, name.replace(" ", "_")))
            print(f"| {name} | {r['step_s']:.3f} | {r['sent_mb']:.2f} | {r['loss']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
