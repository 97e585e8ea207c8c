"""``python -m fmoe.plan``: per-rank memory and traffic of a training job, before running it.

The program only reads flags and reports: the model comes from the registry
(:func:`fmoe.models.get`), the job's config is the model's preset widened as the main job widens
it (:meth:`fmoe.model.Model.preset`) or a Hugging Face ``--config`` (KV heads widened by the same
rule, :meth:`fmoe.model.Model.widen_kv_heads`), and the estimate is the library's
:func:`fmoe.memory.plan.memory_plan`.

Example:
    python -m fmoe.plan --model qwen3_moe --preset small --nproc 4 --ep 4 --batch 4 --seq 256 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from ..checkpoint.config_check import read_config
from ..dryrun import cli as dry
from ..memory.dry_run import format_report
from ..memory.plan import format_plan, memory_plan
from ..model import PRESETS, Model
from ..models import NAMES, get

__all__ = ["main", "build_parser"]


def _load_config(model: Model, args: argparse.Namespace) -> Any:
    if not args.config:
        return model.preset(args.preset, args.tp)
    cfg = read_config(model, args.config)                 # checked field by field, one-line errors
    wide = model.widen_kv_heads(cfg, args.tp)
    if wide != cfg:
        kv = model.widths(cfg).G
        print(f"note: tp={args.tp} does not divide num_key_value_heads={kv}; planned with {args.tp} KV heads "
              "(each KV head replicated)", file=sys.stderr)
    return wide


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m fmoe.plan``."""
    ap = argparse.ArgumentParser(prog="python -m fmoe.plan",
                                 description="Per-rank memory and traffic of a training job, before running it.")
    ap.add_argument("--model", choices=NAMES, default="qwen3_moe", help="a model of fmoe.models")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, default="tiny")
    src.add_argument("--config", default=None, help="a Hugging Face config.json")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=None, help="default: tp")
    ap.add_argument("--dp-replicate", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4, help="sequences per data-parallel micro-batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--remat", choices=("none", "layer", "moe"), default="none")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--memory-gb", type=float, default=None, help="warn when a rank needs more")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    dry.add_arguments(ap)                                 # --master-dtype --optim-dtype --loss-chunks --dry-run
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m fmoe.plan``: print the per-rank memory plan of a training job (``--json``:
    one JSON object; ``--dry-run``: also the measured bytes of the real step on fake tensors,
    :mod:`fmoe.memory.dry_run`). Exit code 0, 2 for bad flags, 1 when a dry-run rank does not fit
    ``--memory-gb``."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.loss_chunks < 1:
        ap.error(f"--loss-chunks must be >= 1, got {args.loss_chunks}")
    for name in ("nproc", "tp", "dp_replicate", "batch", "seq", "grad_accum") + (("ep",) if args.ep else ()):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model = get(args.model)
    try:
        cfg = _load_config(model, args)
        plan = memory_plan(model, cfg, nproc=args.nproc, tp=args.tp, ep=args.ep, dp_replicate=args.dp_replicate,
                           batch=args.batch, seq=args.seq, dtype=args.dtype, remat=args.remat,
                           grad_accum=args.grad_accum, master_dtype=args.master_dtype,
                           optim_dtype=args.optim_dtype, loss_chunks=args.loss_chunks)
        if args.dry_run:
            result, code = dry.report(plan, model, cfg, args)
    except (ValueError, TypeError, OSError) as e:
        ap.error(str(e))
    if args.dry_run:
        print(json.dumps(result) if args.json else format_report(result, args.memory_gb))
        return code
    if args.memory_gb is not None:
        plan["memory_gb"] = args.memory_gb
        plan["fits"] = plan["max_total_bytes"] <= args.memory_gb * 1e9
    print(json.dumps(plan) if args.json else format_plan(plan, args.memory_gb))
    return 0
