"""The main job: ``python -m fmoe.train --model qwen3_moe --preset tiny --nproc 4 --ep 4``.

Without a launcher it spawns ``--nproc`` local gloo ranks itself; under ``torchrun`` (``RANK``
and ``WORLD_SIZE`` set) it joins the launcher's process group instead. Each step trains on the
built-in corpus (the Python standard library's source, byte tokens), rank 0 shows a progress
bar and appends one JSON line per step to ``OUT/log.jsonl``; checkpoints go to
``OUT/step-N`` every ``--save-every`` steps and at the end. ``--resume`` continues from a
checkpoint (same mesh: bitwise; another mesh: resharded; see :mod:`fmoe.train.resume` for what
may change), ``--init-hf`` starts from a Hugging Face checkpoint, ``--export-hf`` writes one at
the end.

Failure policy: a bad flag or flag combination (also: OUT holding another run, a resume that
does not match its checkpoint) is a usage error, exit 2, before anything starts; any failure
while running prints one ``fmoe.train: error: ...`` line (the traceback with ``--debug``) and
exits 1; SIGINT / SIGTERM stop every rank and exit 130 / 143. ``OUT`` is guarded by
:mod:`fmoe.train.outdir`; a non-finite loss or gradient norm stops the job before the update
(``--skip-nonfinite N`` skips up to N such steps instead).

This module is the command itself: :func:`main` reads the command line
(:func:`fmoe.train.parse.parse_args`), holds the ``OUT`` lock, starts the ranks (spawned, or
torchrun's), turns SIGINT / SIGTERM and every failure into the exit codes above and prints the
``{"final": ...}`` line. The other jobs have their own modules:

- :mod:`fmoe.train.flags`: the flag parser (:func:`build_parser`), help and epilog; adding a
  flag starts there;
- :mod:`fmoe.train.parse`: every usage error, before anything starts;
- :mod:`fmoe.train.loop`: what each rank runs (:func:`run`): model, plan, steps, log, checkpoints.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from typing import Optional, Sequence

from . import options
from .flags import DEFAULT_OUT, build_parser
from .loop import NonFiniteStep, log_row, run
from .parse import inside, launcher_world, parse_args
from .threads import threads_of

__all__ = ["build_parser", "parse_args", "main", "run", "DEFAULT_OUT"]


def _spawned(rank: int, world: int, args: argparse.Namespace) -> dict:
    return run(rank, world, args)


class Interrupted(BaseException):
    """SIGINT / SIGTERM reached the job (raised in the main thread by the signal handler)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


def _describe(e: BaseException) -> str:
    """One line for an error: OSErrors by their message, others as ``Type: message``."""
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror + (f": {e.filename}" if e.filename else "")
    elif isinstance(e, (NonFiniteStep,)):
        text = str(e)
    else:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def _prepare_out(args: argparse.Namespace) -> None:
    """With OUT's lock held: refuse links, remove what killed writes left, then make OUT hold
    exactly the run this job continues (its log trimmed to the checkpoint's step)."""
    from fmoe.train.outdir import clear_run, drop_after, links, remove_temporaries, trim_log

    linked = links(args.out)                           # checked again under the lock
    if linked:
        raise OSError(f"--out {args.out}: {linked[0]} is a symbolic link; fmoe.train never writes through a link")
    remove_temporaries(args.out)
    own = bool(args.resume_path) and inside(args.resume_path, args.out)
    if args.overwrite and own:
        drop_after(args.out, args.resume_meta["step"])     # the run continues from there
    elif args.overwrite:
        clear_run(args.out)
    if own:                                            # rows after the checkpoint are trained again
        for note in trim_log(args.out, args.resume_meta["step"]):
            print(f"fmoe.train: note: {note}", file=sys.stderr)


def _destroy_group() -> None:
    """Tear the process group down before the interpreter does: a gloo group left alive at exit
    can abort the process in its worker threads' teardown ("terminate called without an active
    exception", exit 1 after the final line)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _train(args: argparse.Namespace) -> Optional[dict]:
    """Run the job (launcher side); returns rank 0's last metrics, None on other torchrun ranks."""
    from fmoe.train.outdir import OutLock

    world = launcher_world()
    if world is not None:                              # torchrun: its ranks, rank 0 holds the lock
        import datetime

        import torch.distributed as dist

        from fmoe.checkpoint import training as ckpt

        owned = world > 1 and not dist.is_initialized()
        if owned:
            backend = "nccl" if options.resolve_device(args.device, int(os.environ.get("LOCAL_RANK", 0))).type == "cuda" \
                else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
        rank = int(os.environ["RANK"])
        lock = OutLock(args.out)
        try:
            ckpt.on_rank0(lambda: (lock.acquire(), _prepare_out(args)), f"locking --out {args.out}")
            last = run(rank, world, args)
            if owned:
                from fmoe.collectives import barrier

                barrier()                              # every rank is done with every collective
        finally:
            lock.release()                             # (a no-op where it was not taken)
            if owned:
                _destroy_group()
        return last if rank == 0 else None
    with OutLock(args.out):
        _prepare_out(args)
        if args.nproc == 1:
            return run(0, 1, args)
        from fmoe import launch

        previous = os.environ.get("FMOE_SPAWNED")
        os.environ["FMOE_SPAWNED"] = "1"      # read by the ranks; not left behind in this process,
        try:                                   # whose later torchrun children must not inherit it
            return launch.run(_spawned, args.nproc, args, timeout=args.timeout * max(1, args.steps),
                              collective_timeout=args.timeout, threads=threads_of(args))[0]
        finally:
            if previous is None:
                os.environ.pop("FMOE_SPAWNED", None)
            else:
                os.environ["FMOE_SPAWNED"] = previous


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m fmoe.train``; returns the exit code (see the module docstring)."""
    args = parse_args(argv)                            # usage errors exit 2 here
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        last = _train(args)
    except Interrupted as e:
        from fmoe.checkpoint import training as ckpt

        good = ckpt.latest(args.out) if os.path.isdir(args.out) else None
        print(f"fmoe.train: error: stopped by {e}; every rank stopped (last complete checkpoint: "
              f"{good or 'none'}; a save cut short is never used)", file=sys.stderr)
        return 128 + e.signum
    except BaseException as e:  # every failure is one line (CheckpointException too)
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        if args.debug:
            traceback.print_exc()
        print(f"fmoe.train: error: {_describe(e)}", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if last is not None:
        print('{"final": ' + log_row(last) + "}")
    return 0
