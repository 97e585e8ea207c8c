"""What ``--resume`` keeps, what it may change, and the check that enforces it.

A checkpoint's ``meta.json`` records the job that wrote it. Resuming continues *that* job, so:

- **kept** (:data:`KEPT`): model, preset, seed, batch, seq, learning-rate schedule, optimizer
  settings, aux-loss weight. A flag not given on the command line takes the checkpoint's value;
  a flag given with another value is an error naming both. The model config itself comes from
  the checkpoint (``hf_config``), never from the flags;
- **may change**: the mesh (``--nproc --tp --ep --dp-replicate``: the checkpoint is resharded)
  as long as the number of data-parallel batches per step stays the same (otherwise each step
  would see other data). A mesh flag not given takes the checkpoint's value (:data:`MESH`,
  :func:`take_mesh`; ``--ep`` only when ``--tp`` is not given either, else it follows ``--tp``),
  so ``--resume OUT --steps N`` continues on the mesh the run had; ``--steps`` (must be beyond the saved step; equal to it with
  ``--export-hf``: export the checkpoint without training), ``--out`` (default: the
  checkpoint's own run directory, so a resumed run continues there),
  ``--save-every``, ``--impl``, ``--timeout``, ``--quiet``, ``--debug``, ``--export-hf``;
- **nothing from a checkpoint is run, and every kept value is checked like its flag**: a kept
  value must pass the flag's own type and range check (``lr`` NaN or negative is refused naming
  ``meta.json``, the field and the value); a recorded ``--router`` is only a *name* of
  :mod:`fmoe.routing` with literal arguments, rebuilt and re-validated. A ``module:function``
  router names code, which a checkpoint never chooses: it must be passed again as ``--router``
  on the command line (:func:`check_router`);
- **schedule rule**: the warmup + cosine schedule stays the one of the run that was started
  (its ``--steps``, recorded as ``schedule.total``); steps beyond that total train at the final
  learning rate (``0.1 * --lr``). So ``--steps 10`` then ``--resume --steps 20`` trains steps
  11..20 at the lr of step 10, with no jump.

Example:
    >>> KEPT["seed"]
    'seed'
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from .job import DEFAULTS, check_value, flag

__all__ = ["KEPT", "MESH", "take_mesh", "apply", "check_router", "check_kept_value", "schedule_record"]

#: flag dest -> meta.json key of the settings a resumed run keeps (extend for new flags)
KEPT: dict[str, str] = {
    "model": "model", "preset": "preset", "seed": "seed", "batch": "batch", "seq": "seq",
    "lr": "lr", "warmup": "warmup", "weight_decay": "weight_decay", "clip": "clip",
    "aux_weight": "aux_weight",
    # the data stream (fmoe.training.options): same files, tokenizer, held-out cut and rows per step
    "data": "data", "tokenizer": "tokenizer_flag", "eval_fraction": "eval_fraction", "grad_accum": "grad_accum",
    "router": "router",
    # load balancing (fmoe.training.balancing)
    "balance": "balance", "z_weight": "z_weight", "bias_rate": "bias_rate", "bias_update": "bias_update",
    # the precision policy (fmoe.precision): the checkpoint holds weights and moments in these dtypes
    "dtype": "dtype", "master_dtype": "master_dtype", "optim_dtype": "optim_dtype",
}

#: mesh flag dest -> key of meta.json's ``mesh`` record: the mesh a resumed run keeps unless given
MESH: dict[str, str] = {"nproc": "world", "tp": "tp", "ep": "ep", "dp_replicate": "dp_replicate"}

MIN_RATIO = 0.1     # the cosine ends at MIN_RATIO * lr


def take_mesh(job: Any, meta: dict, where: str, error: Callable[[str], Any]) -> list[str]:
    """Fill in the mesh settings not given from the checkpoint's ``mesh`` record (before the mesh
    is checked); ``--ep`` comes from it only when ``--tp`` does too (a given ``--tp`` brings the
    default ``--ep`` = ``--tp``).

    Args:
        job: the resolved job (``job.explicit``: the settings given).
        meta: the checkpoint's ``meta.json``.
        where: the checkpoint path (for messages).
        error: called with the message of a bad record; raises.
    Returns:
        the settings taken, as ``--flag value`` (for messages).
    """
    file = os.path.join(where, "meta.json")
    mesh = meta.get("mesh")
    if not isinstance(mesh, dict):
        error(f"--resume: {file}: 'mesh' is {mesh!r}, not the mesh record fmoe train writes")
    taken = []
    for dest, key in MESH.items():
        if dest in job.explicit or (dest == "ep" and "tp" in job.explicit):
            continue
        try:
            value = check_value(dest, mesh.get(key))
        except ValueError as e:
            error(f"--resume: {file}: mesh {key!r} is {mesh.get(key)!r}, not a value {flag(dest)} accepts ({e})")
        setattr(job, dest, value)
        taken.append(f"{flag(dest)} {value}")
    return taken


def schedule_record(job: Any) -> dict:
    """The ``schedule`` entry of ``meta.json`` for this run."""
    return {"kind": "warmup-cosine", "lr": job.lr, "warmup": job.warmup,
            "total": job.schedule_total, "min_ratio": MIN_RATIO}


#: kept values that may be null: the preset of an --init-hf run, and the balancing weights a run's
#: methods did not use (fmoe.training.balancing records them as None, then re-resolves them).
NULLABLE = ("preset", "aux_weight", "z_weight", "bias_rate", "bias_update")


def check_kept_value(name: str, key: str, value: Any, file: str) -> Optional[str]:
    """Why ``meta.json``'s ``value`` for ``key`` is not one the setting ``name`` accepts, or None.

    Example:
        >>> check_kept_value("lr", "lr", float("nan"), "meta.json")
        "meta.json: 'lr' is nan, not a value --lr accepts (--lr must be a finite number > 0, got nan)"
    """
    if value is None:                # no preset (--init-hf); a balancing weight that did not apply
        needed = name in DEFAULTS and key not in NULLABLE
        return f"{file}: {key!r} is null; {flag(name)} needs a value" if needed else None
    try:
        check_value(name, value)
    except ValueError as e:
        return f"{file}: {key!r} is {value!r}, not a value {flag(name)} accepts ({e})"
    return None


def check_router(saved: Any, job: Any, file: str) -> Optional[str]:
    """Why the recorded router ``saved`` cannot be used as it is, or None (see the module
    docstring: only ``fmoe.routing`` names with literal arguments; code must be passed again)."""
    from ..routing.spec import from_spec, parse_spec

    if saved is None:
        return None
    if not isinstance(saved, str):
        return f"{file}: 'router' is {saved!r}; a router is recorded as a NAME[:k=v,...] string"
    try:
        module, _, _ = parse_spec(saved)
    except ValueError as e:
        return f"{file}: 'router' {saved!r} is not a router name ({e})"
    if module != "fmoe.routing":
        if "router" in job.explicit and job.router == saved:
            return None                              # the user names the code, not the checkpoint
        return (f"{file}: 'router' is {saved!r}, code from module {module!r}; a checkpoint never chooses code "
                f"to import and run. If you trust it, pass --router {saved} again")
    try:
        from_spec(saved)                             # a built-in name and its literal arguments
    except (ValueError, TypeError) as e:
        return f"{file}: 'router' {saved!r} is not a valid router ({e})"
    return None


def apply(job: Any, meta: dict, where: str, error: Callable[[str], Any]) -> None:
    """Check a resume against the checkpoint's ``meta`` and fill in the kept settings.

    Args:
        job: the resolved job (:class:`fmoe.training.resolve.Job`; ``job.explicit``: the settings given).
        meta: the checkpoint's ``meta.json`` (already read and checked by ``ckpt.read_meta``).
        where: the checkpoint path (for messages).
        error: called with the message of a mismatch; raises (a usage error).
    """
    file = os.path.join(where, "meta.json")
    for dest, key in KEPT.items():
        if key not in meta:
            error(f"--resume {where}: meta.json has no {key!r}; it was not written by this version of "
                  "fmoe and cannot be checked")
        saved = meta[key]
        problem = check_router(saved, job, file) if dest == "router" else check_kept_value(dest, key, saved, file)
        if problem:
            error(f"--resume: {problem}")
        if dest in job.explicit and getattr(job, dest) != saved:
            error(f"--resume {where} was trained with {flag(dest)} {saved!r}, this run has "
                  f"{flag(dest)} {getattr(job, dest)!r}; a resumed run keeps it (drop the flag, or "
                  "start a new run). Changeable on resume: the mesh (same number of data-parallel "
                  "batches), --steps, --out, --save-every, --impl, --timeout, --quiet, --export-hf")
        setattr(job, dest, saved)
    step = meta["step"]
    if job.steps < step or (job.steps == step and not job.export_hf):
        error(f"--steps {job.steps} is not beyond the checkpoint's step {step} ({where}); pass "
              f"--steps > {step} to train further (or --steps {step} --export-hf DIR to export it as it is)")
    mesh = meta.get("mesh")
    if not isinstance(mesh, dict):
        error(f"--resume: {file}: 'mesh' is {mesh!r}, not the mesh record fmoe train writes")
    batches = job.world // (job.tp * job.pp)
    if mesh.get("num_batches") != batches:
        error(f"--resume {where} was trained with {mesh.get('num_batches')} data-parallel batches per step "
              f"(mesh {mesh}); this mesh (world {job.world}, --tp {job.tp}, --pp {job.pp}) has {batches}: every "
              f"step would see other data. Choose --nproc/--tp/--pp with world / (tp * pp) = {mesh.get('num_batches')}")
    schedule = meta.get("schedule")
    total = schedule.get("total") if isinstance(schedule, dict) else None
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        error(f"--resume {where}: meta.json has no valid schedule.total ({total!r})")
    job.schedule_total = total
