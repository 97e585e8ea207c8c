"""Rows sent in the expert-parallel dispatch: fmoe (once per token and remote rank) vs the
reference (once per token and expert), for simulated routings.

Counts use the same function as ``fmoe.moe``'s ``aux["dispatch_rows"]`` (distinct
(token, remote rank) pairs) on a single process: routing is simulated, nothing is exchanged.

    python benchmarks/bench_dispatch_rows.py [--tokens 4096] [--seed 0]

Prints a table and writes benchmarks/out/dispatch_rows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import types

import torch

from fmoe.moe import _dispatch_rows


def fake_mesh(ep: int, ep_rank: int):
    coords = {"tp": 0, "ep": ep_rank}
    return types.SimpleNamespace(tp=1, ep=ep, rank_in=lambda a: coords[a])


def count(tokens: int, E: int, K: int, ep: int, seed: int, skew: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g) + skew * torch.linspace(1, 0, E)
    ids = torch.topk(logits, K, dim=-1).indices
    e_local = E // ep
    ours = ref = ours_all = ref_all = 0
    for r in range(ep):            # every token held by rank r of the EP group in turn
        ours += _dispatch_rows(ids, e_local, fake_mesh(ep, r))
        ref += int(((ids // e_local) != r).sum())
    ours_all = int(sum(len(set((row // e_local).tolist())) for row in ids))
    ref_all = tokens * K
    return dict(E=E, K=K, ep=ep, skew=skew, tokens=tokens, fmoe_remote_rows=ours / ep,
                reference_remote_rows=ref / ep, ratio_remote=ours / max(ref, 1),
                fmoe_rows_incl_local=ours_all, reference_rows_incl_local=ref_all,
                ratio_incl_local=ours_all / ref_all)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = [count(args.tokens, E, K, ep, args.seed, skew)
            for E, K, ep, skew in [(64, 8, 8, 0.0), (64, 8, 8, 2.0), (64, 4, 8, 0.0), (64, 2, 8, 0.0),
                                   (128, 8, 8, 0.0), (32, 8, 4, 0.0), (64, 8, 4, 0.0)]]
    head = f"{'E':>4} {'K':>3} {'ep':>3} {'skew':>5} | {'fmoe rows':>10} {'ref rows':>10} {'ratio':>6} | {'incl. local':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['E']:>4} {r['K']:>3} {r['ep']:>3} {r['skew']:>5.1f} | {r['fmoe_remote_rows']:>10.0f} "
              f"{r['reference_remote_rows']:>10.0f} {r['ratio_remote']:>6.3f} | {r['ratio_incl_local']:>11.3f}")
    os.makedirs("benchmarks/out", exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=platform.platform(), cpus=os.cpu_count(),
                torch=torch.__version__, tokens_per_rank=args.tokens, routing="top-k of gaussian logits")
    with open("benchmarks/out/dispatch_rows.json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
