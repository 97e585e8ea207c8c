"""Full-size dry runs of the reference workload (issue 21): Qwen3-30B-A3B, 8 ranks, seq 2048.

Runs ``fmoe memory --dry-run --json`` (in process) for each layout and prints a
markdown table of the measured peak per rank beside the analytic plan and the reference's
reported peak; the raw JSON goes to ``benchmarks/out/dryrun-<layout>.json``.

Example:
    python benchmarks/bench_dryrun.py                         # the five layouts, pure bf16, --loss-chunks 8
    python benchmarks/bench_dryrun.py --layouts tp8/ep8 --loss-chunks 1 --master-dtype fp32 --optim-dtype fp32
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import time

from fmoe.cli.memory import main as plan_main

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "configs", "qwen3-30b-a3b.json")
LAYOUTS = {"tp8/ep8": (8, 8), "tp4/fsdp2/ep4": (4, 4), "tp2/fsdp4/ep4": (2, 4), "tp1/fsdp8/ep8": (1, 8),
           "tp2/fsdp4/ep8": (2, 8)}
REFERENCE_GB = {"tp8/ep8": 38.6, "tp4/fsdp2/ep4": 34.2, "tp2/fsdp4/ep4": 32.3}


def run(layout: str, args) -> dict:
    tp, ep = LAYOUTS[layout]
    flags = ["--model", "qwen3_moe", "--config", args.config, "--nproc", "8", "--tp", str(tp), "--ep", str(ep),
             "--batch", "1", "--seq", str(args.seq), "--dtype", args.dtype, "--master-dtype", args.master_dtype,
             "--optim-dtype", args.optim_dtype, "--loss-chunks", str(args.loss_chunks), "--remat", args.remat,
             "--dry-run", "--device", args.device, "--json"] + args.flag
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        plan_main(flags)
    out = json.loads(buf.getvalue())
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["flags"] = flags
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--master-dtype", default="bf16")
    ap.add_argument("--optim-dtype", default="bf16")
    ap.add_argument("--loss-chunks", type=int, default=8)
    ap.add_argument("--remat", default="none")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tag", default="")
    ap.add_argument("--flag", action="append", default=[], help="one more fmoe memory flag, e.g. --flag=--sp "
                    "--flag=--optim-in-backward (issue 34)")
    args = ap.parse_args()
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    print("| layout | reference GB | planned peak GB | measured peak GB (max over ranks) | measured / reference "
          "| params / grads / optimizer / activations / temporaries at the peak, GB | roles | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        out = run(layout, args)
        name = layout.replace("/", "-") + (f"-{args.tag}" if args.tag else "")
        with open(os.path.join(HERE, "out", f"dryrun-{name}.json"), "w") as f:
            json.dump(out, f)
        worst = max(out["ranks"], key=lambda r: r["measured"]["peak_bytes"])
        m, p = worst["measured"], worst["planned"]
        ref = REFERENCE_GB.get(layout)
        cats = " / ".join(f"{m[k] / 1e9:.2f}" for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                         "activations_bytes", "temporaries_bytes"))
        print(f"| {layout} | {ref if ref else '-'} | {p['total_bytes'] / 1e9:.2f} | {m['peak_bytes'] / 1e9:.2f} | "
              f"{(m['peak_bytes'] / 1e9 / ref) if ref else float('nan'):.2f} | {cats} | {len(out['roles'])} | "
              f"{out['wall_s']} |", flush=True)


if __name__ == "__main__":
    main()
