"""``python -m fmoe.plan --dry-run``: the flags the dry run adds to the memory plan, and its report.

The memory-plan program calls :func:`add_arguments` on its parser and, with ``--dry-run``,
:func:`report` after it has planned: every rank then reports ``planned`` (the analytic plan's
bytes by category at its predicted peak) beside ``measured`` (:func:`fmoe.memory.dry_run.dry_run`).
``--json`` prints ``{"ranks": [{"rank", "role", "planned": {"total_bytes", "params_bytes",
...}, "measured": {"peak_bytes", "params_bytes", ...}}], ...}``. ``--memory-gb G`` makes the
dry run exit with code 1 when a rank's measured peak exceeds ``G * 1e9`` bytes (the plan alone
only warns).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_arguments", "report"]


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


def report(plan: dict, model: Any, cfg: Any, args: argparse.Namespace) -> tuple[dict, int]:
    """The library's :func:`fmoe.memory.dry_run.dry_run_report` for the parsed flags, and the
    exit code (1 when ``--memory-gb`` is given and a measured peak exceeds it)."""
    from ..memory.dry_run import dry_run_report

    result = dry_run_report(plan, model, cfg, device=args.device, memory_gb=args.memory_gb)
    return result, 0 if result.get("fits", True) else 1
