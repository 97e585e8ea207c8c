"""``fmoe.training.run(cfg, step_config=None)``: the main job as a library call.

``run`` resolves the :class:`~fmoe.training.job.JobConfig` (every check before anything starts,
:func:`fmoe.training.resolve.resolve`), holds ``OUT``'s lock (:class:`fmoe.training.outdir.OutLock`),
makes ``OUT`` hold exactly the run this job continues, and runs :func:`fmoe.training.loop.run` on
every rank: ``nproc`` local gloo ranks it spawns itself (:func:`fmoe.launch.run`), one process for
``nproc == 1``, or the launcher's ranks under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set; a
process group it creates is torn down before it returns). It returns rank 0's last log row.

A research loop that needs more than the settings passes ``step_config=`` (a
:class:`fmoe.training.StepConfig`): it replaces the one the settings would build (optimizer
settings, router, bias rate, ...). With ``nproc > 1`` it travels to the spawned ranks with the
job (by cloudpickle, so a router defined in a notebook works). The model config's own
router-loss switch is off in the job (the settings' router carries the balance losses), so a
replacing router brings its own losses (:func:`fmoe.routing.with_losses`).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Optional

from .job import JobConfig
from .loop import run as run_rank
from .resolve import Job, inside, launcher_world, resolve
from .step import StepConfig
from .threads import threads_of

__all__ = ["run"]


def _prepare_out(job: Job) -> None:
    """With OUT's lock held: refuse links, remove what killed writes left, then make OUT hold
    exactly the run this job continues (its log trimmed to the checkpoint's step)."""
    from .outdir import clear_run, drop_after, links, remove_temporaries, trim_log

    linked = links(job.out)                            # checked again under the lock
    if linked:
        raise OSError(f"--out {job.out}: {linked[0]} is a symbolic link; fmoe train never writes through a link")
    remove_temporaries(job.out)
    own = bool(job.resume_path) and inside(job.resume_path, job.out)
    if job.overwrite and own:
        drop_after(job.out, job.resume_meta["step"])    # the run continues from there
    elif job.overwrite:
        clear_run(job.out)
    if own:                                            # rows after the checkpoint are trained again
        for note in trim_log(job.out, job.resume_meta["step"]):
            print(f"fmoe train: note: {note}", file=sys.stderr)


def _destroy_group() -> None:
    """Tear the process group down before the interpreter does: a gloo group left alive at exit
    can abort the process in its worker threads' teardown ("terminate called without an active
    exception", exit 1 after the final line)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run(cfg: JobConfig, step_config: Optional[StepConfig] = None) -> Optional[dict]:
    """Run the job (module docstring).

    Args:
        cfg: the job's settings.
        step_config: a step replacing the one the settings build (optional).
    Returns:
        rank 0's last log row (None on the other ranks under torchrun).
    Raises:
        JobConfigError: the settings do not fit together, the launcher, the checkpoint or ``OUT``
            (before anything starts).
        TypeError: ``cfg`` or ``step_config`` of another type.
    """
    if step_config is not None and not isinstance(step_config, StepConfig):
        raise TypeError(f"fmoe.training.run: step_config must be a fmoe.training.StepConfig, got "
                        f"{type(step_config).__name__}")
    job = resolve(cfg)
    job.step_config = step_config
    from .outdir import OutLock

    world = launcher_world()
    if world is not None:                              # torchrun: its ranks, rank 0 holds the lock
        import datetime

        import torch.distributed as dist

        from ..checkpoint import training as ckpt
        from .options import resolve_device
        from .failure import annotate, leave_node_line, node_reason
        from .settings import check_same, of_job

        if "TORCHELASTIC_RUN_ID" in os.environ:        # a torchrun agent is the parent: die with it
            from ..launch import die_with_parent

            die_with_parent(os.getppid())
        owned = world > 1 and not dist.is_initialized()
        if owned:
            backend = "nccl" if resolve_device(job.device, int(os.environ.get("LOCAL_RANK", 0))).type == "cuda" \
                else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=job.timeout))
        rank = int(os.environ["RANK"])
        lock = OutLock(job.out)
        try:
            try:                                       # every node started with the same settings
                check_same(of_job(job))
                ckpt.on_rank0(lambda: (lock.acquire(), _prepare_out(job)), f"locking --out {job.out}")
                last = run_rank(rank, world, job)
                if owned:
                    from ..collectives import barrier

                    barrier()                          # every rank is done with every collective
            except Exception as e:                     # the first failing rank, named once
                error = annotate(e, rank)
                leave_node_line(error)                 # for the node's printing rank, if torchrun stops it
                if error is e:
                    raise
                raise error from e
        except BaseException as e:                     # a signal: torchrun's, after a sibling failed?
            reason = node_reason(e)
            if reason is None:
                raise
            raise reason from e
        finally:
            lock.release()                             # (a no-op where it was not taken)
            if owned:
                _destroy_group()
        return last if rank == 0 else None
    with OutLock(job.out):
        _prepare_out(job)
        if job.nproc == 1:
            return run_rank(0, 1, job)
        from .. import launch

        previous = os.environ.get("FMOE_SPAWNED")
        os.environ["FMOE_SPAWNED"] = "1"      # read by the ranks; not left behind in this process,
        try:                                   # whose later torchrun children must not inherit it
            # --timeout bounds each collective (a stuck rank fails within it), never the whole job
            return launch.run(run_rank, job.nproc, job, timeout=math.inf, collective_timeout=job.timeout,
                              threads=threads_of(job))[0]
        finally:
            if previous is None:
                os.environ.pop("FMOE_SPAWNED", None)
            else:
                os.environ["FMOE_SPAWNED"] = previous
