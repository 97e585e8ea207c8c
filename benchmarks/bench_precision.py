"""Pure-bf16 AdamW against fp32 masters: stochastic rounding vs round-to-nearest (issue 21).

One process, Qwen3-MoE ``Config.tiny()`` widened as the main job widens it (byte vocabulary),
stdlib text, batch 4 x 64 tokens, the trainer's step (bf16 compute for every bf16 policy), the same
data and initial weights for every policy. Prints the loss every 20 steps and the final gap to
fp32 masters; ``--lr`` small enough that many updates fall below half a bf16 ulp of the weight
is where round-to-nearest stalls.

Example:
    python benchmarks/bench_precision.py --steps 200 --lr 3e-4
"""

from __future__ import annotations

import argparse
import time

import torch

import fmoe
from fmoe.data import TokenStream
from fmoe.models import qwen3_moe
from fmoe.precision import Precision
from fmoe.optim import AdamWConfig, lr_at
from fmoe.optim.adamw import init as adamw_init
from fmoe.training.step import StepConfig, train_step

POLICIES = {"fp32 masters, fp32 moments, bf16 compute": ("bf16", "fp32", "fp32", True),
            "pure bf16, stochastic rounding": ("bf16", "bf16", "bf16", True),
            "pure bf16, round to nearest": ("bf16", "bf16", "bf16", False)}


def train(policy, steps: int, lr: float, batch: int, seq: int) -> list[float]:
    dtype, master, optim, stochastic = policy
    pol = Precision(dtype, master, optim)
    cfg = qwen3_moe.MODEL.preset("tiny", 1)
    params = fmoe.tree.map_with_path(lambda p, t: t.to(pol.master_dtype).requires_grad_(not p.endswith("expert_bias")),
                                     qwen3_moe.init(cfg, seed=0))
    state = adamw_init(params, dtype=pol.optim_dtype)
    data = TokenStream.stdlib(400_000)
    step_cfg = StepConfig(opt=AdamWConfig(), dtype=dtype, round_seed=0 if master == "bf16" and stochastic else None,
                          donate=True)
    mesh, losses = fmoe.Mesh(), []
    for i in range(1, steps + 1):
        b = data.batch(i, 0, batch, seq, 0, num_batches=1)
        params, state, m = train_step(qwen3_moe, cfg, params, state, b, mesh=mesh, step_cfg=step_cfg,
                                      lr=lr_at(i, lr, 10, steps))
        losses.append(m["loss"])
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    results = {}
    for name, pol in POLICIES.items():
        t0 = time.perf_counter()
        results[name] = train(pol, args.steps, args.lr, args.batch, args.seq)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    ref = results["fp32 masters, fp32 moments, bf16 compute"]
    marks = list(range(19, args.steps, 20)) + ([args.steps - 1] if (args.steps - 1) % 20 != 19 else [])
    print("| policy | " + " | ".join(f"loss @{s + 1}" for s in marks) + " | mean loss, last 20 steps | gap to fp32 |")
    print("|---|" + "---|" * (len(marks) + 2))
    for name, losses in results.items():
        tail = sum(losses[-20:]) / len(losses[-20:])
        gap = tail - sum(ref[-20:]) / len(ref[-20:])
        print(f"| {name} | " + " | ".join(f"{losses[s]:.4f}" for s in marks) + f" | {tail:.4f} | {gap:+.4f} |")


if __name__ == "__main__":
    main()
