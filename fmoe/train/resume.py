"""What ``--resume`` keeps, what it may change, and the check that enforces it.

A checkpoint's ``meta.json`` records the job that wrote it. Resuming continues *that* job, so:

- **kept** (:data:`KEPT`): model, preset, seed, batch, seq, learning-rate schedule, optimizer
  settings, aux-loss weight. A flag not given on the command line takes the checkpoint's value;
  a flag given with another value is an error naming both. The model config itself comes from
  the checkpoint (``hf_config``), never from the flags;
- **may change**: the mesh (``--nproc --tp --ep --dp-replicate``: the checkpoint is resharded)
  as long as the number of data-parallel batches per step stays the same (otherwise each step
  would see other data); ``--steps`` (must be beyond the saved step), ``--out``,
  ``--save-every``, ``--impl``, ``--timeout``, ``--quiet``, ``--debug``, ``--export-hf``;
- **schedule rule**: the warmup + cosine schedule stays the one of the run that was started
  (its ``--steps``, recorded as ``schedule.total``); steps beyond that total train at the final
  learning rate (``0.1 * --lr``). So ``--steps 10`` then ``--resume --steps 20`` trains steps
  11..20 at the lr of step 10, with no jump.

Example:
    >>> KEPT["seed"]
    'seed'
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

__all__ = ["KEPT", "apply", "schedule_record"]

#: flag dest -> meta.json key of the settings a resumed run keeps (extend for new flags)
KEPT: dict[str, str] = {
    "model": "model", "preset": "preset", "seed": "seed", "batch": "batch", "seq": "seq",
    "lr": "lr", "warmup": "warmup", "weight_decay": "weight_decay", "clip": "clip",
    "aux_weight": "aux_weight",
    # the data stream (fmoe.train.options): same files, tokenizer, held-out cut and rows per step
    "data": "data", "tokenizer": "tokenizer_flag", "eval_fraction": "eval_fraction", "grad_accum": "grad_accum",
    "router": "router",
    # the precision policy (fmoe.precision): the checkpoint holds weights and moments in these dtypes
    "dtype": "dtype", "master_dtype": "master_dtype", "optim_dtype": "optim_dtype",
}

MIN_RATIO = 0.1     # the cosine ends at MIN_RATIO * lr


def schedule_record(args: argparse.Namespace) -> dict:
    """The ``schedule`` entry of ``meta.json`` for this run."""
    return {"kind": "warmup-cosine", "lr": args.lr, "warmup": args.warmup,
            "total": args.schedule_total, "min_ratio": MIN_RATIO}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def apply(args: argparse.Namespace, meta: dict, where: str, error: Callable[[str], Any]) -> None:
    """Check a resume against the checkpoint's ``meta`` and fill in the kept settings.

    Args:
        args: parsed flags; ``args.explicit`` is the set of dests given on the command line.
        meta: the checkpoint's ``meta.json`` (already read and checked by ``ckpt.read_meta``).
        where: the checkpoint path (for messages).
        error: called with the message of a mismatch (``ArgumentParser.error``: exit 2).
    """
    for dest, key in KEPT.items():
        if key not in meta:
            error(f"--resume {where}: meta.json has no {key!r}; it was not written by this version of "
                  "fmoe.train and cannot be checked")
        saved = meta[key]
        if dest in args.explicit and getattr(args, dest) != saved:
            error(f"--resume {where} was trained with {_flag(dest)} {saved!r}, this run has "
                  f"{_flag(dest)} {getattr(args, dest)!r}; a resumed run keeps it (drop the flag, or "
                  "start a new run). Changeable on resume: the mesh (same number of data-parallel "
                  "batches), --steps, --out, --save-every, --impl, --timeout, --quiet, --export-hf")
        setattr(args, dest, saved)
    step = meta["step"]
    if args.steps <= step:
        error(f"--steps {args.steps} is not beyond the checkpoint's step {step} ({where}); pass "
              f"--steps > {step} to train further")
    mesh = meta.get("mesh", {})
    batches = args.world // args.tp
    if mesh.get("num_batches") != batches:
        error(f"--resume {where} was trained with {mesh.get('num_batches')} data-parallel batches per step "
              f"(mesh {mesh}); this mesh (world {args.world}, --tp {args.tp}) has {batches}: every step "
              "would see other data. Choose --nproc/--tp with world / tp = "
              f"{mesh.get('num_batches')}")
    total = meta.get("schedule", {}).get("total")
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        error(f"--resume {where}: meta.json has no valid schedule.total ({total!r})")
    args.schedule_total = total
