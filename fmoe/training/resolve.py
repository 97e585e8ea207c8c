"""From a :class:`~fmoe.training.job.JobConfig` to the job that runs: every check that needs more
than one field, the launcher's world or the disk, before any rank starts.

:func:`resolve` checks the mesh (by :func:`fmoe.mesh.check_layout`, the rules :class:`fmoe.Mesh`
enforces, with the fields named as flags), values across fields, the ``--resume`` checkpoint
(:mod:`fmoe.training.resume` says what it may change and fills in what it keeps), the balancing
settings (:mod:`fmoe.training.balancing`) and ``--out`` (a run directory holds one run;
:mod:`fmoe.training.outdir`). A problem is a :class:`~fmoe.training.job.JobConfigError` naming
the flag, its value and what is valid; the program turns it into a usage error (exit code 2).

The result is a :class:`Job`: every setting with the value the job uses (defaults and a resume's
kept values filled in) and what resolving found (``world``, ``resume_path`` ...).
"""

from __future__ import annotations

import os
import types
from typing import Any, Callable, Optional

from ..mesh import check_layout
from ..models import SHIPPED, get, hf_model
from . import balancing, identity, options, parallel, resume
from .job import FIELDS, JobConfig, JobConfigError

FLAG_NAMES = {"tp": "--tp", "ep": "--ep", "dp_replicate": "--dp-replicate", "pp": "--pp", "cp": "--cp"}   # mesh fields as flags

__all__ = ["Job", "resolve", "check_plan", "launcher_world", "inside"]


class Job(types.SimpleNamespace):
    """The resolved job: every :class:`JobConfig` field by name, with the value in use, and
    ``config`` (the JobConfig as given), ``explicit`` (the fields given, not None), ``world``
    (ranks), ``schedule_total`` (the step the lr schedule ends at), ``resume_path`` /
    ``resume_meta`` (the checkpoint continued, or None), ``step_config`` (a replacing
    :class:`fmoe.training.StepConfig`, or None) and ``declared`` (the model's
    :class:`fmoe.model.Model`, resolved once here: the ranks run it, so a model registered in
    this process reaches spawned ranks)."""


def _error(message: str) -> None:
    raise JobConfigError(message)


def launcher_world() -> Optional[int]:
    """The launcher's world size under torchrun (``RANK`` and ``WORLD_SIZE`` set, not by our own
    spawn); None when the job spawns its ranks itself."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "FMOE_SPAWNED" not in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def resolve(cfg: JobConfig) -> Job:
    """The job ``cfg`` describes, checked against itself, the launcher, a resume and ``OUT``.

    Args:
        cfg: the settings (each field already checked alone).
    Returns:
        the :class:`Job` (module docstring).
    Raises:
        JobConfigError: a problem found before anything starts, naming the flag and the value.
    """
    job = _job(cfg)
    found = _find_resume(job) if job.resume else None
    taken = resume.take_mesh(job, found[1], found[0], _error) if found else []   # mesh flags not given
    ep = _check_mesh(job, launcher_world(), f" ({', '.join(taken)} taken from the checkpoint {found[0]}; give them "
                     "to choose another mesh)" if taken else "")
    if job.init_hf and not os.path.isdir(job.init_hf):
        _error(f"--init-hf {job.init_hf!r} is not a directory")
    if job.init_hf and not job.upcycle:                # config.json's model_type names the model (fmoe.models)
        _check_init_hf(job)
    if job.impl != "auto":
        import fmoe.ep
        if job.impl not in fmoe.ep.registered():
            _error(f"--impl {job.impl!r} is not a registered MoE implementation; choose from "
                   f"{['auto'] + fmoe.ep.registered()}")
    if job.dp_batches > 1 and job.world > 1:
        _error(f"--dp-batches {job.dp_batches}: one process reads the batches of {job.dp_batches} ranks; it runs "
               f"with --nproc 1 only (this job has {job.world} ranks)")
    check_options(job, _error)
    job.ep = ep
    job.schedule_total = job.steps
    job.resume_path = job.resume_meta = None
    if found:
        _check_resume(job, *found)
    else:
        _check_sizes(job, 256)
        identity.record(job, _error)                   # --data: an absolute path and its digest
    _check_profile(job)
    parallel.check_options(job, _error)
    job.declared = get(job.model)                      # the Model the ranks run (a registered one reaches them)
    balancing.resolve(job, _error, {**SHIPPED, job.model: job.declared})   # after a resume filled in the kept settings
    _check_upcycle(job)
    parallel.check_stages(job, _error, found)
    options.check_data_length(job, _error)             # a sequence per data-parallel batch
    _check_out(job)
    return job


def _job(cfg: JobConfig) -> Job:
    if not isinstance(cfg, JobConfig):
        raise TypeError(f"fmoe.training: the job is a fmoe.training.JobConfig, got {type(cfg).__name__}")
    explicit = {n for n in FIELDS if getattr(cfg, n) is not None}
    return Job(**{n: cfg.get(n) for n in FIELDS}, config=cfg, explicit=explicit, step_config=None)


def _check_mesh(job: Job, launched: Optional[int], note: str = "") -> int:
    """``job.world`` and the mesh by :class:`fmoe.Mesh`'s own rules (``note`` ends a message);
    returns ``--ep`` (default ``--tp``)."""
    job.world = launched or job.nproc
    ep = job.tp if job.ep is None else job.ep
    try:                                               # Mesh's own rules, before any rank starts
        check_layout(job.world, tp=job.tp, ep=ep, dp_replicate=job.dp_replicate, pp=job.pp, cp=job.cp,
                     names={**FLAG_NAMES, "world": "WORLD_SIZE" if launched else "--nproc"})
    except ValueError as e:
        _error(str(e) + note)
    return ep


def check_plan(cfg: JobConfig, model_cfg: Any) -> Job:
    """The job ``cfg`` as far as ``fmoe memory`` plans it: the mesh, batch and parallelism checks of
    :func:`resolve` (one code path; no launcher, checkpoint, data or ``OUT``), the stages against
    ``model_cfg`` (the preset's or a ``config.json``'s model config).

    Raises:
        JobConfigError: what the job would refuse, naming the flag.
    """
    job = _job(cfg)
    job.ep = _check_mesh(job, None)
    parallel.check_options(job, _error)
    parallel.check_stages(job, _error, None, model_cfg)
    return job


def check_options(job: Job, error: Callable[[str], Any]) -> None:
    """What the data, device, tokenizer, remat and router settings need beyond their own range
    (also re-run on the values a resume keeps; ``error`` raises)."""
    import torch

    if job.data is not None and not os.path.exists(job.data):
        error(f"--data {job.data!r} does not exist")
    if job.device == "cuda" and not torch.cuda.is_available():
        error("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if job.device == "cuda" and job.nproc > 1 and "RANK" not in os.environ:
        error(f"--device cuda --nproc {job.nproc}: launch several GPUs with torchrun --nproc-per-node "
              f"{job.nproc} (one GPU per rank over NCCL); --nproc spawns local gloo ranks")
    if job.tokenizer not in (None, "bytes"):
        from ..data import find_tokenizer_file
        if find_tokenizer_file(job.tokenizer) is None:
            error(f"--tokenizer {job.tokenizer!r}: not 'bytes', a tokenizer.json, or a directory holding one")
    if job.cp > 1 and not get(job.model).context_parallel:
        error(f"--cp {job.cp}: model {job.model} does not declare context_parallel (its forward must start with "
              "fmoe.model.start and pass cp=ctx.cp to fmoe.nn.attention); use --cp 1")
    blocks = ("none",) + get(job.model).remat_blocks      # declared on the model's Model
    if job.remat not in blocks:
        error(f"--remat {job.remat}: model {job.model} has no such block to recompute; it supports "
              f"--remat {' / '.join(blocks)}")
    if job.router is not None:
        from ..routing.spec import from_spec

        try:
            from_spec(job.router, "--router")
        except (ValueError, TypeError) as e:
            error(str(e))


def _check_sizes(job: Job, vocab: int) -> None:
    """The step's logits (``--batch * --seq`` rows of ``vocab`` fp32, with their gradient) fit
    in this machine's memory: checked by arithmetic, before anything is allocated."""
    from ..checkpoint.config_check import memory_bytes

    need = 2 * 4 * job.batch * job.seq * vocab
    if need > memory_bytes():
        _error(f"--batch {job.batch} x --seq {job.seq} x vocabulary {vocab}: one step's logits and their gradient "
               f"need {need / 1e9:.3g} GB, more than this machine's {memory_bytes() / 1e9:.3g} GB; lower --batch "
               "or --seq (or use --grad-accum)")


def _check_profile(job: Job) -> None:
    """``--profile-steps A:B`` must meet the steps this run trains (a window a resume took from its
    checkpoint that lies behind it is dropped: that run profiled it)."""
    from .observe import parse_steps

    if job.profile_steps is None:
        return
    first, last = (job.resume_meta["step"] if job.resume_meta else 0) + 1, job.steps
    a, b = parse_steps(job.profile_steps)
    if b < first or a > last:
        if "profile_steps" not in job.explicit:
            job.profile_steps = None
            return
        _error(f"--profile-steps {job.profile_steps} is outside the steps this run trains ({first}..{last}): "
               "nothing would be profiled")


def _find_resume(job: Job) -> tuple[str, dict]:
    """The checkpoint ``--resume`` names (the latest complete one of a run directory) and its
    ``meta.json``, checked as far as reading it."""
    from ..checkpoint import training as ckpt

    if not os.path.exists(job.resume):
        _error(f"--resume {job.resume!r} does not exist")
    for _ in range(3):               # a job pruning that run (--keep-last) may remove the latest meanwhile
        path = ckpt.latest(job.resume)
        if path is None:
            _error(f"--resume {job.resume!r}: no complete step-N checkpoint there")
        try:
            return path, ckpt.read_meta(path)
        except ValueError as e:
            if os.path.exists(path) or path == job.resume:
                _error(f"--resume: {e}")
    _error(f"--resume {job.resume!r}: its checkpoints keep being removed (a job pruning it with --keep-last?)")


def _check_resume(job: Job, path: str, meta: dict) -> None:
    from ..checkpoint.config_check import config_from_dict

    file = os.path.join(path, "meta.json")
    resume.apply(job, meta, path, _error)              # kept values, each checked like its flag

    def prefixed(message: str) -> None:
        _error(f"--resume {path}: meta.json holds a value its flag refuses: {message}")

    check_options(job, prefixed)
    try:                                               # the kept model config, before any allocation
        cfg = config_from_dict(get(job.model), meta.get("hf_config"), f"{file} 'hf_config'", fits=True)
    except ValueError as e:
        _error(f"--resume: {e}")
    _check_sizes(job, cfg.vocab_size)
    if "out" not in job.explicit:                      # continue in the run's own directory
        job.out = os.path.dirname(os.path.abspath(path))
    job.resume_path, job.resume_meta = path, meta


def _check_init_hf(job: Job) -> None:
    """The model of ``--init-hf DIR``: its ``model_type``, or the ``--model`` given, which must load it."""
    try:
        job.model = hf_model(job.init_hf, job.model if "model" in job.explicit else None)
    except (ValueError, TypeError) as e:
        _error(f"--init-hf: {e}")


def _check_upcycle(job: Job) -> None:
    if job.upcycle is None or job.resume_path:         # a resume's weights are its checkpoint's
        return
    from .upcycle import parse_upcycle

    if job.model != "mixtral" or not job.init_hf:
        _error(f"--upcycle {job.upcycle}: upcycles a dense llama checkpoint into mixtral; give --model mixtral "
               f"--init-hf LLAMA_DIR (this run: --model {job.model}, --init-hf {job.init_hf})")
    try:
        parse_upcycle(job.upcycle)
    except ValueError as e:
        _error(str(e))


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies under it (links resolved)."""
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def _check_out(job: Job) -> None:
    from ..checkpoint.atomic import check_target
    from .outdir import holds_run, links, newer_steps

    if os.path.exists(job.out) and not os.path.isdir(job.out):
        _error(f"--out {job.out!r} exists and is not a directory")
    linked = links(job.out)
    if linked:
        name = linked[0]
        _error(f"--out {job.out!r}: {name} is a symbolic link (to {os.readlink(os.path.join(job.out, name))!r}); "
               "fmoe train never writes, removes or resumes through a link in OUT: remove it "
               f"({len(linked)} link(s): {', '.join(linked[:6])})")
    previous = holds_run(job.out)
    own = bool(job.resume_path) and inside(job.resume_path, job.out)    # continues OUT's run
    if previous and not own and not job.overwrite:
        from ..checkpoint.retention import complete_steps

        what = f"not the run --resume {job.resume_path} continues" if job.resume_path else "another run"
        cont = (f"pass --resume {job.out} to continue it, " if complete_steps(job.out) else
                "it has no complete checkpoint to continue from (its saves were cut short); ")
        _error(f"--out {job.out!r} holds {what} ({', '.join(previous[:6])}); {cont}--overwrite to replace "
               "it, or choose another --out")
    newer = newer_steps(job.out, job.resume_meta["step"]) if own else []
    if newer and not job.overwrite:
        _error(f"--out {job.out!r} holds newer checkpoints ({', '.join(newer[:6])}) than the one --resume "
               f"continues ({job.resume_path}); they would mix with this run. Resume from the latest, "
               "pass --overwrite to remove them (and their log.jsonl rows), or choose another --out")
    if job.export_hf:
        if os.path.realpath(job.export_hf) == os.path.realpath(job.out) and not job.overwrite:
            _error(f"--export-hf {job.export_hf!r} is the run directory --out; the export would sit "
                   "among the run's files. Choose another directory, or pass --overwrite to write "
                   "config.json and the safetensors files beside them")
        try:
            check_target(job.export_hf, overwrite=job.overwrite, what="--export-hf")
        except ValueError as e:
            _error(str(e))

