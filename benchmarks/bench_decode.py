"""Decode-time expert parallelism: which ``fmoe.moe`` implementation ``impl="auto"`` runs when
generating, how many token rows each MoE layer sends to other ranks per generated token, and the
time per token, on 4 local gloo ranks.

Usage: ``python benchmarks/bench_decode.py [--tokens 16] [--batch 4]``. Prints a table and
writes ``benchmarks/out/decode.json``. The model is Qwen3-MoE ``Config.small()`` (D=256, 32
experts, top-4), random weights, greedy decoding of ``--tokens`` tokens after an 8-token prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

import fmoe
from fmoe.models import qwen3_moe
from fmoe.testing import spawn

MESHES = (dict(tp=1, ep=4), dict(tp=2, ep=4), dict(tp=2, ep=2), dict(tp=4, ep=4))


def _rank(rank: int, world: int, tokens: int, batch: int) -> list[dict]:
    cfg = qwen3_moe.Config.small()
    full = qwen3_moe.init(cfg, seed=0)
    prompts = torch.randint(0, cfg.vocab_size, (batch, 8), generator=torch.Generator().manual_seed(1))
    out = []
    for kw in MESHES:
        mesh = fmoe.Mesh(**kw)
        params = qwen3_moe.shard(full, cfg, mesh)
        seen = {"impl": set(), "rows": 0, "calls": 0}
        saved = {name: fmoe.ep.declared(name) for name in ("all_to_all", "all_reduce")}
        for name, d in saved.items():
            impl = d.impl

            def spy(*a, _impl=impl, _name=name, **k):
                seen["impl"].add(_name)
                res = _impl(*a, **k)
                if isinstance(res, tuple) and "dispatch_rows" in res[1]:
                    seen["rows"] += int(res[1]["dispatch_rows"])
                seen["calls"] += 1
                return res

            fmoe.ep.register(name, spy, **d.properties)      # the same declared properties
        with torch.no_grad():                       # one decode step first: warm-up and the prefill
            cache = qwen3_moe.init_cache(cfg, batch, 8 + tokens, mesh)
            logits, cache = qwen3_moe.forward(params, prompts, cfg, mesh, cache=cache)
            seen.update(rows=0, calls=0)
            t0 = time.perf_counter()
            for t in range(tokens):
                ids = logits[:, -1].argmax(-1, keepdim=True)
                logits, cache = qwen3_moe.forward(params, ids, cfg, mesh, cache=cache)
            dt = time.perf_counter() - t0
        for name, d in saved.items():
            fmoe.ep.register(name, d.impl, **d.properties)
        out.append({"mesh": kw, "impl": sorted(seen["impl"]), "rows_sent": seen["rows"],
                    "moe_calls": seen["calls"], "ms_per_token": 1000 * dt / tokens})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    results = spawn(_rank, 4, args.tokens, args.batch, timeout=1800)
    cfg = qwen3_moe.Config.small()
    rows = []
    print(f"Qwen3-MoE small (D={cfg.hidden_size}, E={cfg.num_experts}, top-{cfg.num_experts_per_tok}), "
          f"batch {args.batch}, {args.tokens} greedy tokens, 4 gloo ranks")
    print("| mesh | impl (auto) | rows sent to other ranks per token per MoE layer | ms per token (max over ranks) |")
    print("|---|---|---|---|")
    for i, kw in enumerate(MESHES):
        per = [r[i] for r in results]
        layers = cfg.num_hidden_layers
        batches = 4 // kw["tp"]                     # distinct data-parallel batches (tp ranks share one)
        rows_tok = sum(p["rows_sent"] for p in per) / (args.tokens * args.batch * batches * layers)
        row = {"mesh": kw, "impl": per[0]["impl"], "rows_per_token_per_layer": rows_tok,
               "ms_per_token": max(p["ms_per_token"] for p in per)}
        rows.append(row)
        print(f"| tp={kw['tp']}, ep={kw['ep']} | {', '.join(row['impl'])} | {rows_tok:.2f} | {row['ms_per_token']:.1f} |")
    os.makedirs(os.path.join(os.path.dirname(__file__), "out"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "out", "decode.json"), "w") as f:
        json.dump({"machine": platform.platform(), "torch": torch.__version__, "args": vars(args), "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
