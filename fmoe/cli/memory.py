"""``fmoe memory``: per-rank memory and traffic of a training job, before running it; with
``--dry-run`` also the bytes the real step measures on fake tensors.

The program only reads flags and reports: the model comes from the registry
(:func:`fmoe.models.get`), the job's config is the model's preset widened as the main job widens
it (:meth:`fmoe.model.Model.preset`) or a Hugging Face ``--config`` (KV heads widened by the same
rule, :meth:`fmoe.model.Model.widen_kv_heads`), and the estimate is the library's
:func:`fmoe.memory.plan.memory_plan`. The flags are the job's (``fmoe train``'s names), built into a
:class:`fmoe.training.JobConfig` and checked by the job's own cross-flag rules
(:func:`fmoe.training.resolve.check_plan`), so it plans nothing ``fmoe train`` refuses. With ``--dry-run`` every rank reports ``planned``
(the plan's bytes by category at its predicted peak) beside ``measured``
(:func:`fmoe.memory.dry_run.dry_run_report`); ``--json`` prints ``{"ranks": [{"rank", "role",
"planned": {"total_bytes", ...}, "measured": {"peak_bytes", ...}}], ...}``, and ``--memory-gb G``
makes the dry run exit with code 1 when a rank's measured peak exceeds ``G * 1e9`` bytes (the
plan alone only warns).

Example:
    fmoe memory --model qwen3_moe --preset small --nproc 4 --ep 4 --batch 4 --seq 256 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from ..checkpoint.config_check import read_config
from ..memory.dry_run import dry_run_report, format_report
from ..memory.plan import format_plan, memory_plan
from ..model import PRESETS, Model
from ..models import get, hf_model
from ..training import JobConfig
from ..training.parallel import stage_sizes
from ..training.resolve import check_plan

__all__ = ["main", "build_parser"]


#: flags of fmoe memory that are fmoe train's settings (built into a JobConfig and checked as the job does)
JOB_FLAGS = ("model", "preset", "nproc", "tp", "ep", "dp_replicate", "batch", "seq", "dtype", "remat", "grad_accum",
             "memory_gb", "master_dtype", "optim_dtype", "loss_chunks", "clip", "optim_in_backward", "sp", "cp", "pp",
             "microbatches", "pp_schedule", "pp_layers")


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
    """The flags of ``fmoe memory``."""
    ap = argparse.ArgumentParser(prog="fmoe memory",
                                 description="Per-rank memory and traffic of a training job, before running it.")
    ap.add_argument("--model", default=None, metavar="NAME", help="the model: a name of fmoe.models (shipped, "
                    "registered or an installed entry point) or module:attr, an import path to an fmoe.model.Model "
                    "(default: --config's model_type, else qwen3_moe)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, default="tiny")
    src.add_argument("--config", default=None, help="a Hugging Face config.json")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=None, help="default: tp")
    ap.add_argument("--dp-replicate", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4, help="sequences per data-parallel batch (with --pp: all "
                    "--microbatches' rows, as fmoe train's --batch)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--remat", choices=("none", "layer", "moe"), default="none")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--memory-gb", type=float, default=None, help="warn when a rank needs more")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    g = ap.add_argument_group("precision, loss, dry run")
    g.add_argument("--master-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the weights the optimizer updates (and their gradients)")
    g.add_argument("--optim-dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of AdamW's moments")
    g.add_argument("--loss-chunks", type=int, default=1, help="compute the loss by N chunks of tokens")
    g.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: none; with "
                   "--optim-in-backward a clip takes a second backward pass)")
    g.add_argument("--optim-in-backward", action="store_true", help="update each layer inside backward")
    g.add_argument("--sp", action="store_true", help="sequence parallelism over --tp")
    g.add_argument("--cp", type=int, default=1, help="context parallelism: each sequence split over N ranks")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--microbatches", type=int, default=None, help="micro-batches of a pipeline (default: --pp)")
    g.add_argument("--pp-schedule", choices=("1f1b", "gpipe"), default="1f1b")
    g.add_argument("--pp-layers", metavar="N,N", default=None,
                   help="decoder layers of each stage (default: equal blocks; the plan only, not --dry-run)")
    g.add_argument("--dry-run", action="store_true",
                   help="also run the real train step of each rank role on fake tensors and report measured bytes")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="device of the dry run's fake tensors (auto: cuda on a CUDA build of torch, else cpu)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``fmoe memory``: print the per-rank memory plan of a training job (``--json``:
    one JSON object; ``--dry-run``: also the measured bytes of the real step on fake tensors,
    :mod:`fmoe.memory.dry_run`). Exit code 0, 2 for bad flags, 1 when a dry-run rank does not fit
    ``--memory-gb``."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:                                                # a --config's model_type names the model, as --init-hf's
        args.model = hf_model(args.config, args.model) if args.config else args.model or "qwen3_moe"
    except (ValueError, TypeError) as e:
        ap.error(f"--config: {e}")
    try:                                                # the job's own settings and checks (one code path)
        settings = JobConfig(**{name: getattr(args, name) for name in JOB_FLAGS})
    except ValueError as e:
        ap.error(str(e))
    try:
        model = get(args.model)
    except (ValueError, TypeError) as e:
        ap.error(f"--model: {e}")
    try:
        cfg = _load_config(model, args)
        job = check_plan(settings, cfg)                  # what fmoe train refuses is refused here too
        plan = memory_plan(model, cfg, nproc=job.world, tp=job.tp, ep=job.ep, dp_replicate=job.dp_replicate,
                           batch=job.batch, seq=job.seq, dtype=job.dtype, remat=job.remat,
                           grad_accum=job.grad_accum, master_dtype=job.master_dtype,
                           optim_dtype=job.optim_dtype, loss_chunks=job.loss_chunks,
                           optim_in_backward=job.optim_in_backward, clip=job.clip, sp=job.sp, pp=job.pp,
                           microbatches=job.microbatches, pp_schedule=job.pp_schedule,
                           pp_layers=stage_sizes(job.pp_layers), cp=job.cp)
        if args.dry_run and args.pp_layers is not None and len(set(stage_sizes(args.pp_layers))) > 1:
            raise ValueError(f"--pp-layers {args.pp_layers} with --dry-run: the dry run splits the layers into equal "
                             "stages; plan uneven stages without --dry-run")
        if args.dry_run:
            result = dry_run_report(plan, model, cfg, device=args.device, memory_gb=args.memory_gb)
    except (ValueError, TypeError, OSError) as e:
        ap.error(str(e))
    if args.dry_run:
        print(json.dumps(result) if args.json else format_report(result, args.memory_gb))
        return 0 if result.get("fits", True) else 1
    if args.memory_gb is not None:
        plan["memory_gb"] = args.memory_gb
        plan["fits"] = plan["max_total_bytes"] <= args.memory_gb * 1e9
    print(json.dumps(plan) if args.json else format_plan(plan, args.memory_gb))
    return 0
