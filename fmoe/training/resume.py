"""What ``--resume`` keeps, what it may change, and the check that enforces it.

A checkpoint's ``meta.json`` records the job that wrote it: ``settings``, every
:class:`~fmoe.training.job.JobConfig` setting with the value the job used (defaults and filled-in
values resolved). Resuming continues *that* job: a setting not given takes the checkpoint's value,
never a default. Every setting is in exactly one of these groups (``tests/cli/test_resume_job.py``
walks them all):

- **kept** (:data:`KEPT`): what each step computes — model, preset, seed, batch (with the
  micro-batches of ``--grad-accum`` / ``--microbatches`` / ``--dp-batches``), seq, the data, its
  tokenizer and held-out cut (``--eval-fraction --eval-seed``), learning-rate schedule, optimizer,
  router (``--router-changed`` switches it, keeping parameters and optimizer state), balancing
  and precision settings. A flag given with another value is an error naming both. ``--data`` and ``--tokenizer`` are compared by content (the checkpoint records the data's
  absolute path and digest, :func:`fmoe.data.data_digest`, and the tokenizer's digest), so a moved
  corpus is the same data and an edited one is refused, naming the file. The model config itself
  comes from the checkpoint (``hf_config``), never from the flags. A pipeline's ``--batch B
  --microbatches M`` and ``--batch B/M --grad-accum M`` read the same rows the same way: they are
  one batch shape (:func:`batch_shape`), so the original command line plus ``--resume`` works,
  and so does a resume from ``--pp`` to ``--grad-accum`` and back;
- **may change** (:data:`CHANGEABLE`: they do not change what a step computes, or change it to
  float noise only, or only watch the run), left out taking the checkpoint's values too:
  ``--steps`` (beyond the saved step; equal to it with ``--export-hf``: export without training),
  saving, logging, evaluation cadence, ``--impl --compile --remat --loss-chunks`` and the like;
- **the mesh** (:data:`MESH`: ``--nproc --tp --ep --dp-replicate --pp --cp``, with ``--sp``
  following ``--tp`` and ``--pp-layers`` following ``--pp``): the checkpoint is resharded, as long
  as the data-parallel batches of sequences per step stay (``world / (tp * pp * cp) *
  --dp-batches``); a mesh flag not given takes the checkpoint's value (:func:`take_mesh`; ``--ep`` only when
  ``--tp`` is not given either, else it follows ``--tp``; ``--pp`` and ``--cp`` only when ``--nproc``
  is not given), so ``--resume OUT --steps N`` continues on the mesh the run had, pipeline included;
- **this invocation's** (:data:`FRESH`, never taken from the checkpoint): ``--resume --out``
  (default: the checkpoint's own run directory) ``--overwrite --export-hf --record-routing
  --data-changed --router-changed --threads --quiet --debug``;
- **refused** (:data:`REFUSED`): ``--init-hf`` and ``--upcycle`` chose the starting weights,
  which a resume takes from the checkpoint: another value is refused, the run's own let by;
- **nothing from a checkpoint is run, and every kept value is checked like its flag**: a kept
  value must pass the flag's own type and range check (``lr`` NaN or negative is refused naming
  ``meta.json``, the field and the value); a recorded ``--router`` is only a *name* of
  :mod:`fmoe.routing` with literal arguments, rebuilt and re-validated. A ``module:function``
  router names code, which a checkpoint never chooses: it must be passed again as ``--router``
  on the command line (:func:`check_router`); so must ``--model`` for a model fmoe does not ship
  (:func:`check_model`: registered, an entry point or ``module:attr``), a mismatch refused by name;
- **schedule rule**: the warmup + cosine schedule stays the one of the run that was started
  (its ``--steps``, recorded as ``schedule.total``); steps beyond that total train at the final
  learning rate (``0.1 * --lr``). So ``--steps 10`` then ``--resume --steps 20`` trains steps
  11..20 at the lr of step 10, with no jump.

Example:
    >>> "seed" in KEPT and "steps" in CHANGEABLE and "pp" in MESH
    True
    >>> batch_shape({"pp": 2, "batch": 4, "microbatches": 2}), batch_shape({"pp": 1, "batch": 2, "grad_accum": 2})
    ((2, 2), (2, 2))
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional

from . import identity
from .job import DEFAULTS, FIELDS, check_value, flag

__all__ = ["KEPT", "CHANGEABLE", "MESH", "FRESH", "REFUSED", "take_mesh", "apply", "batch_shape", "check_router",
           "check_model", "check_kept_value", "schedule_record"]

#: settings a resumed run keeps (taken from the checkpoint; another value given is refused)
KEPT = ("model", "preset", "seed", "batch", "seq", "data", "tokenizer", "eval_fraction", "eval_seed",
        "lr", "warmup", "weight_decay", "clip", "grad_accum", "microbatches", "dp_batches", "router",
        "aux_weight", "balance", "z_weight", "bias_rate", "bias_update", "dtype", "master_dtype", "optim_dtype")
#: settings a resumed run may change (taken from the checkpoint when not given)
CHANGEABLE = ("steps", "save_every", "keep_last", "eval_every", "eval_batches", "profile_steps", "tensorboard",
              "memory_gb", "skip_nonfinite", "impl", "compile", "remat", "loss_chunks", "optim_in_backward",
              "pp_schedule", "device", "timeout")
#: mesh flag dest -> key of meta.json's ``mesh`` record: the mesh a resumed run keeps unless given;
#: ``--sp`` and ``--pp-layers`` (:data:`MESH_FOLLOWERS`) come with the ``--tp`` / ``--pp`` they need
MESH: dict[str, str] = {"nproc": "world", "tp": "tp", "ep": "ep", "dp_replicate": "dp_replicate", "pp": "pp",
                        "cp": "cp"}
MESH_FOLLOWERS = {"sp": "tp", "pp_layers": "pp"}
#: this invocation's own settings, never taken from a checkpoint
FRESH = ("resume", "out", "overwrite", "export_hf", "record_routing", "data_changed", "router_changed", "threads",
         "quiet", "debug")
#: settings a resume refuses (they choose the starting weights)
REFUSED = ("init_hf", "upcycle")
_BATCH = ("batch", "grad_accum", "microbatches", "dp_batches")     # compared as one batch shape
_BY_CONTENT = ("data", "tokenizer")                # compared by their digests (fmoe.training.identity)
MIN_RATIO = 0.1     # the cosine ends at MIN_RATIO * lr

def take_mesh(job: Any, meta: dict, where: str, error: Callable[[str], Any]) -> list[str]:
    """Fill in the mesh settings not given from the checkpoint's ``mesh`` record (before the mesh
    is checked); ``--ep`` comes from it only when ``--tp`` does too (a given ``--tp`` brings the
    default ``--ep`` = ``--tp``), ``--pp`` only when ``--nproc`` does too (``--nproc 1`` is one
    process, no pipeline).

    Args:
        job: the resolved job (``job.explicit``: the settings given).
        meta: the checkpoint's ``meta.json``.
        where: the checkpoint path (for messages).
        error: called with the message of a bad record; raises.
    Returns:
        the settings taken that are not their defaults, as ``--flag value`` (for messages).
    """
    mesh = meta.get("mesh")
    if not isinstance(mesh, dict):
        error(f"--resume: {where}/meta.json: 'mesh' is {mesh!r}, not the mesh record fmoe train writes")
    taken = []
    for dest, key in MESH.items():
        if dest in job.explicit or (dest == "ep" and "tp" in job.explicit) or \
                (dest in ("pp", "cp") and "nproc" in job.explicit):
            continue
        try:
            value = check_value(dest, mesh.get(key))
        except ValueError as e:
            error(f"--resume: {where}/meta.json: mesh {key!r} is {mesh.get(key)!r}, not a value {flag(dest)} "
                  f"accepts ({e})")
        setattr(job, dest, value)
        taken += [f"{flag(dest)} {value}"] if value != DEFAULTS.get(dest) else []
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


def check_model(saved: Any, job: Any, file: str) -> Optional[str]:
    """Why the recorded model ``saved`` cannot be used, or None (:func:`fmoe.models.recorded`: a
    model fmoe does not ship needs ``--model`` from the user; a mismatch is refused by name)."""
    from ..models import recorded

    try:
        recorded(saved, job.model if "model" in job.explicit else None, file)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def batch_shape(settings: Mapping[str, Any]) -> tuple[int, int]:
    """``(rows, micro-batches)`` of one data-parallel batch per step: ``--batch B --microbatches M``
    under ``--pp`` is ``(B / M, M)``, as ``--batch B/M --grad-accum M`` without a pipeline."""
    if (settings.get("pp") or 1) > 1:
        m = settings.get("microbatches") or settings["pp"]
        return settings["batch"] // m, m
    return settings["batch"], settings.get("grad_accum") or 1


def _settings(meta: dict, where: str, error: Callable[[str], Any]) -> dict:
    """The checkpoint's recorded settings, each checked like its flag."""
    file = os.path.join(where, "meta.json")
    saved = meta.get("settings")
    if not isinstance(saved, dict):
        error(f"--resume {where}: meta.json has no 'settings' record; it was not written by this version of "
              "fmoe and cannot be continued")
    recorded = FRESH + REFUSED + tuple(MESH)
    for name in FIELDS:
        if name in recorded or name in ("nproc", "threads"):
            continue
        if name not in saved:
            error(f"--resume {where}: meta.json's settings have no {name!r}; it was not written by this version "
                  "of fmoe and cannot be continued")
        # (the router and the model are checked against the job's --router / --model by apply: no import)
        problem = None if name in ("router", "model") else check_kept_value(name, f"settings.{name}", saved[name], file)
        if problem:
            error(f"--resume: {problem}")
    return saved


def _refuse(where: str, name: str, saved: Any, given: Any) -> str:
    return (f"--resume {where} was trained with {flag(name)} {saved}, this run has {flag(name)} {given}; a resumed run "
            "keeps it (drop the flag, or start a new run). Changeable on resume: the mesh (--nproc --tp --ep "
            "--dp-replicate --pp, the same data-parallel batches), " + " ".join(flag(n) for n in CHANGEABLE + FRESH))


def _restore_batch(job: Any, saved: dict, where: str, error: Callable[[str], Any]) -> None:
    """The batch settings: one shape (:func:`batch_shape`) under any ``--pp``; ``--dp-batches``
    the checkpoint's on one process (the data-parallel batches are :func:`apply`'s check)."""
    rows0, micro0 = batch_shape(saved)
    own = "microbatches" if job.pp > 1 else "grad_accum"            # the mesh's micro-batch flag
    micro = getattr(job, own) if own in job.explicit else micro0
    rows = job.batch if "batch" in job.explicit else rows0 * (micro if job.pp > 1 else 1)
    rows = rows // micro if job.pp > 1 and rows % micro == 0 else (rows if job.pp == 1 else None)
    if (rows, micro) != (rows0, micro0):
        had = (f"--batch {saved['batch']} --microbatches {micro0} (--pp {saved['pp']})" if (saved.get("pp") or 1) > 1
               else f"--batch {rows0} --grad-accum {micro0}")
        has = " ".join(f"{flag(n)} {getattr(job, n)}" for n in ("batch", own) if n in job.explicit)
        error(f"--resume {where} was trained with {had}: {micro0} micro-batches of {rows0} rows per step; this run "
              f"has {has} (--pp {job.pp}); a resumed run keeps its batches (drop the flags, or give the same: under "
              "--pp, --batch counts the rows of all --microbatches)")
    if "dp_batches" not in job.explicit:
        job.dp_batches = (saved.get("dp_batches") or 1) if job.world == 1 else 1
    if job.pp > 1:                                  # a --grad-accum given stays, for the mesh check to refuse
        job.batch, job.microbatches = rows0 * micro0, micro0
        job.grad_accum = job.grad_accum if "grad_accum" in job.explicit else 1
    else:
        job.batch, job.grad_accum = rows0, micro0
        job.microbatches = job.microbatches if "microbatches" in job.explicit else None


def apply(job: Any, meta: dict, where: str, error: Callable[[str], Any]) -> None:
    """Check a resume against the checkpoint's ``meta`` and fill in every setting not given
    (module docstring: kept, changeable, mesh followers).

    Args:
        job: the resolved job (:class:`fmoe.training.resolve.Job`; ``job.explicit``: the settings given).
        meta: the checkpoint's ``meta.json`` (already read and checked by ``ckpt.read_meta``).
        where: the checkpoint path (for messages).
        error: called with the message of a mismatch; raises (a usage error).
    """
    file = os.path.join(where, "meta.json")
    saved = _settings(meta, where, error)
    for name in REFUSED:                               # the run's own (its command line again) is let by
        if name in job.explicit and getattr(job, name) != saved.get(name):
            error(f"{flag(name)} {getattr(job, name)} chooses the starting weights; --resume {where} continues from "
                  f"the checkpoint's (its run was started with {flag(name)} {saved.get(name)})")
        setattr(job, name, saved.get(name))            # recorded again; the weights are the checkpoint's
    for name in KEPT + CHANGEABLE + tuple(MESH_FOLLOWERS):
        if name in _BATCH or name in _BY_CONTENT:
            continue
        if name in MESH_FOLLOWERS and getattr(job, MESH_FOLLOWERS[name]) != saved.get(MESH_FOLLOWERS[name]):
            continue                                   # another --tp / --pp: its followers are this run's own
        value = saved[name]
        if name in ("router", "model") and not (name == "router" and job.router_changed and job.router):
            problem = (check_router if name == "router" else check_model)(value, job, file)
            if problem:
                error(f"--resume: {problem}")
            if name == "model" and name in job.explicit:
                continue                               # the --model given names the recorded model
        if name not in job.explicit:
            setattr(job, name, value)
        elif name in KEPT and getattr(job, name) != value and not (name == "router" and job.router_changed):
            error(_refuse(where, name, repr(value), repr(getattr(job, name))))
    _restore_batch(job, saved, where, error)
    identity.restore(job, saved, meta, where, error)      # --data and --tokenizer by content
    step = meta["step"]
    if job.steps < step or (job.steps == step and not job.export_hf):
        error(f"--steps {job.steps} is not beyond the checkpoint's step {step} ({where}); pass "
              f"--steps > {step} to train further (or --steps {step} --export-hf DIR to export it as it is)")
    mesh = meta.get("mesh")
    if not isinstance(mesh, dict):
        error(f"--resume: {file}: 'mesh' is {mesh!r}, not the mesh record fmoe train writes")
    batches = job.world // (job.tp * job.pp * job.cp) * job.dp_batches      # distinct batches of sequences
    had = mesh.get("num_sequences")
    if isinstance(had, int) and not isinstance(had, bool):
        had *= saved.get("dp_batches") or 1
    if had != batches:
        error(f"--resume {where} was trained with {had} data-parallel batches per step "
              f"(mesh {mesh}, --dp-batches {saved.get('dp_batches')}); this mesh (world {job.world}, --tp {job.tp}, "
              f"--pp {job.pp}, --cp {job.cp}, --dp-batches {job.dp_batches}) has {batches}: every step would see "
              f"other data. Choose --nproc/--tp/--pp/--cp with world / (tp * pp * cp) = {had}")
    schedule = meta.get("schedule")
    total = schedule.get("total") if isinstance(schedule, dict) else None
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        error(f"--resume {where}: meta.json has no valid schedule.total ({total!r})")
    job.schedule_total = total
