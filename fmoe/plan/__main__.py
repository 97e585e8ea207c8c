"""``python -m fmoe.plan``: per-rank memory and traffic of a training job, before running it.

The sharding :class:`fmoe.plan.Plan` lives in this package; the memory estimate lives in
:mod:`fmoe.memory_plan`; this entry point builds the job's config (a ``--preset`` widened as the
main job widens it, or a Hugging Face ``--config``) and prints the plan.

Example:
    python -m fmoe.plan --model qwen3_moe --preset small --nproc 4 --ep 4 --batch 4 --seq 256 --dtype bf16
"""

from __future__ import annotations

import sys
from typing import Any

from ..memory_plan import format_plan, memory_plan


def _load_config(model: Any, args) -> Any:
    import json

    from ..train.cli import _preset                           # the main job's preset widening

    if not args.config:
        return _preset(model, args.preset, args.tp)
    with open(args.config) as f:
        cfg = model.Config.from_hf(json.load(f))
    kv, heads = getattr(cfg, "num_key_value_heads", None), getattr(cfg, "num_attention_heads", None)
    if kv is not None and kv % args.tp and heads % args.tp == 0:    # replicate KV heads, as the reference does
        import dataclasses
        import sys

        print(f"note: tp={args.tp} does not divide num_key_value_heads={kv}; planned with {args.tp} KV heads "
              "(each KV head replicated)", file=sys.stderr)
        cfg = dataclasses.replace(cfg, num_key_value_heads=args.tp)
    return cfg


def main(argv=None) -> int:
    """``python -m fmoe.plan``: print the per-rank memory plan of a training job (``--json``:
    one JSON object). Exit code 0, or 2 for bad flags."""
    import argparse
    import importlib
    import json

    ap = argparse.ArgumentParser(prog="python -m fmoe.plan",
                                 description="Per-rank memory and traffic of a training job, before running it.")
    ap.add_argument("--model", default="qwen3_moe", help="a model of fmoe.models (qwen3_moe, mixtral, ...)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=("tiny", "small"), default="tiny")
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
    from ..dryrun import cli as dry                         # --master-dtype --optim-dtype --loss-chunks --dry-run
    dry.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.loss_chunks < 1:
        ap.error(f"--loss-chunks must be >= 1, got {args.loss_chunks}")
    for name in ("nproc", "tp", "dp_replicate", "batch", "seq", "grad_accum") + (("ep",) if args.ep else ()):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        model = importlib.import_module(f"fmoe.models.{args.model}")
    except ImportError:
        ap.error(f"--model {args.model!r} is not a model of fmoe.models")
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
        print(json.dumps(result) if args.json else dry.format_report(result, args.memory_gb))
        return code
    if args.memory_gb is not None:
        plan["memory_gb"] = args.memory_gb
        plan["fits"] = plan["max_total_bytes"] <= args.memory_gb * 1e9
    print(json.dumps(plan) if args.json else format_plan(plan, args.memory_gb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
