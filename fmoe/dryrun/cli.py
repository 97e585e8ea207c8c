"""``python -m fmoe.plan --dry-run``: the flags the dry run adds to the memory plan, and its report.

The memory-plan program calls :func:`add_arguments` on its parser and, with ``--dry-run``,
:func:`report` after it has planned: every rank then reports ``planned`` (the analytic plan's
bytes by category at its predicted peak) beside ``measured`` (:func:`fmoe.dryrun.dry_run`).
``--json`` prints ``{"ranks": [{"rank", "role", "planned": {"total_bytes", "params_bytes",
...}, "measured": {"peak_bytes", "params_bytes", ...}}], ...}``. ``--memory-gb G`` makes the
dry run exit with code 1 when a rank's measured peak exceeds ``G * 1e9`` bytes (the plan alone
only warns).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "report", "format_report", "CATEGORY_KEYS"]

CATEGORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The precision, loss and dry-run flags (the job's names)."""
    g = ap.add_argument_group("precision, loss, dry run")
    g.add_argument("--master-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the weights the optimizer updates (and their gradients)")
    g.add_argument("--optim-dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of AdamW's moments")
    g.add_argument("--loss-chunks", type=int, default=1, help="compute the loss by N chunks of tokens")
    g.add_argument("--dry-run", action="store_true",
                   help="also run the real train step of each rank role on fake tensors and report measured bytes")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="device of the dry run's fake tensors (auto: cuda on a CUDA build of torch, else cpu)")


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.backends.cuda.is_built() else "cpu"
    return name


def report(plan: dict, model: Any, cfg: Any, args: argparse.Namespace) -> tuple[dict, int]:
    """Run the dry run for the planned job; returns the combined report and the exit code
    (1 when ``--memory-gb`` is given and a measured peak exceeds it)."""
    from . import dry_run

    m = plan["mesh"]
    out = dry_run(model, cfg, nproc=m["nproc"], tp=m["tp"], ep=m["ep"], dp_replicate=m["dp_replicate"],
                  batch=args.batch, seq=args.seq, dtype=args.dtype, master_dtype=args.master_dtype,
                  optim_dtype=args.optim_dtype, remat=args.remat, grad_accum=args.grad_accum,
                  loss_chunks=args.loss_chunks, device=_device(args.device))
    ranks = []
    for planned, measured in zip(plan["ranks"], out["ranks"]):
        ranks.append({"rank": planned["rank"], "role": measured["role"], "measured_rank": measured["measured_rank"],
                      "planned": {**planned["peak"], "collective_bytes": planned["collective_bytes"]},
                      "measured": measured["measured"], "seconds": measured["seconds"]})
    result = {**{k: v for k, v in plan.items() if k != "ranks"}, "dry_run": True, "device": _device(args.device),
              "roles": out["roles"], "ranks": ranks,
              "max_peak_bytes": max(r["measured"]["peak_bytes"] for r in ranks)}
    code = 0
    if args.memory_gb is not None:
        result["fits"] = result["max_peak_bytes"] <= args.memory_gb * 1e9
        code = 0 if result["fits"] else 1
    return result, code


def format_report(result: dict, memory_gb: Any = None) -> str:
    """A table: per rank role, planned and measured GB by category."""
    m = result["mesh"]
    lines = [f"dry run: {result['model']} on {m['nproc']} ranks (tp={m['tp']} ep={m['ep']} fsdp={m['fsdp']}), "
             f"batch {result['batch']} x seq {result['seq']}, dtype {result['dtype']}, master "
             f"{result['master_dtype']}, optim {result['optim_dtype']}, remat {result['remat']}, device "
             f"{result['device']}; GB = 1e9 bytes, planned / measured",
             f"{'ranks':>12} {'peak':>13} " + " ".join(f"{k[:-6]:>13}" for k in CATEGORY_KEYS) + f" {'sent':>13}"]
    for members in result["roles"]:
        r = result["ranks"][members[0]]
        p, x = r["planned"], r["measured"]
        cells = [f"{p['total_bytes'] / 1e9:6.2f}/{x['peak_bytes'] / 1e9:<6.2f}"]
        cells += [f"{p[k] / 1e9:6.2f}/{x[k] / 1e9:<6.2f}" for k in CATEGORY_KEYS]
        cells.append(f"{p['collective_bytes'] / 1e9:6.2f}/{x['collective_bytes'] / 1e9:<6.2f}")
        name = ",".join(map(str, members)) if len(members) <= 3 else f"{members[0]}..{members[-1]}"
        lines.append(f"{name:>12} " + " ".join(f"{c:>13}" for c in cells))
    if memory_gb is not None and not result.get("fits", True):
        lines.append(f"DOES NOT FIT: measured peak {result['max_peak_bytes'] / 1e9:.3g} GB exceeds --memory-gb {memory_gb}")
    return "\n".join(lines)
