"""``fmoe train``: the main job's command line, parsed into a :class:`fmoe.training.JobConfig` and
run by :func:`fmoe.training.run`.

The flags are the config's fields (:data:`fmoe.training.job.FIELDS`: ``bias_rate`` is
``--bias-rate``; each field's group, help text, metavar and choices make its flag), so adding a
setting is adding a field. argparse only turns words into numbers; every check is the
library's: a value its field refuses, and what :func:`fmoe.training.resolve.resolve` finds
before anything starts (the mesh, ``--resume``, ``OUT``), are usage errors.

Failure policy: a usage error is one ``fmoe train: error: ...`` line, exit 2, before anything
starts; any failure while running prints one ``fmoe train: error: ...`` line (the traceback with
``--debug``) and exits 1; SIGINT / SIGTERM stop every rank and exit 130 / 143. On success rank 0
prints its last log row as ``{"final": {...}}``.

Example:
    >>> parse_args(["--model", "qwen3_moe", "--nproc", "4", "--ep", "4"]).ep
    4
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from typing import Optional, Sequence

from ..training import JobConfig, JobConfigError, run
from ..training.job import DEFAULT_OUT, DEFAULTS, FIELDS, flag
from ..training.jobfile import read_job_file
from ..training.failure import NodeStopped, one_line, printing_rank, prints
from ..training.loop import NonFiniteStep, log_row

__all__ = ["build_parser", "parse_args", "main", "EPILOG"]

GROUPS = ("model", "mesh", "data", "optimization", "precision", "checkpoints and output", "runtime")

EPILOG = f"""\
exit codes:
  0  the run finished (a {{"final": ...}} line on stdout)
  1  runtime error while running (one 'fmoe train: error: ...' line; --debug adds the traceback)
  2  usage error: a bad flag value or combination, --out holding another run, or a --resume
     that does not match its checkpoint (checked before anything starts)
  130 / 143  stopped by SIGINT / SIGTERM (every rank stopped; complete checkpoints are kept)

resume: --resume continues the job meta.json records: every flag left out takes the
  checkpoint's value. What a step computes is kept (model, preset, seed, batch and its
  micro-batches, seq, data and tokenizer by content, held-out cut, lr schedule, optimizer,
  router, balancing, precision: a different value is an error); --steps, saving, logging,
  evaluation cadence, --impl --compile --remat --loss-chunks --optim-in-backward --device
  --timeout may change; the mesh (--nproc --tp --ep --dp-replicate --pp) may change if the
  data-parallel batches per step stay (docs/operating-runs.md).
  Schedule rule: warmup + cosine over the --steps of the run that was started; extending a run
  with a larger --steps trains the extra steps at the final lr (0.1 * --lr).

job file (--config FILE): a flag overrides the file's value; --no-X undoes its switch X and
  --X default its number X (--microbatches default): the setting is then not given.

OUT (default {DEFAULT_OUT}): holds log.jsonl and step-N/ checkpoints of one run, locked by
  OUT/.lock while a job runs. A new run refuses an OUT holding another run unless it resumes
  that run (--resume of a checkpoint in OUT) or --overwrite (which removes only that run's
  log.jsonl and step-N/) is given; resuming an older checkpoint of OUT with newer ones there
  needs --overwrite too (it removes the newer checkpoints and their log rows).

The same job from Python: fmoe.training.run(fmoe.training.JobConfig(model=..., nproc=..., ...)).
"""


class _Help(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to a flag whose help does not say its default (the value the job
    uses when the flag is not given: :data:`fmoe.training.job.DEFAULTS`)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.dest != "help" and "(default: " not in text:
            value = DEFAULTS.get(action.dest)
            text += f" (default: {'none' if value is None else value})"
        return text


#: the word that undoes a job file's number on the command line (``--microbatches default``): the
#: field is then not given, so it takes its default (or, on ``--resume``, the checkpoint's value).
UNSET = "default"


def _number(kind: str):
    """A word as an int / float; :data:`UNSET` as not given (None); any other word is passed on,
    for the field to refuse by name."""
    def conv(s: str):
        if s == UNSET:
            return None
        try:
            return int(s) if kind == "int" else float(s)
        except ValueError:
            return s
    return conv


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``fmoe train``: one per :class:`JobConfig` field, in the field's group."""
    ap = argparse.ArgumentParser(prog="fmoe train", formatter_class=_Help, epilog=EPILOG,
                                 description="Train an fmoe mixture-of-experts model on local gloo ranks "
                                             "(or under torchrun -m fmoe train).")
    ap.add_argument("--config", metavar="FILE", help="a job file (TOML) whose keys are the settings' names "
                    "(--bias-rate is bias_rate); flags given here override it (fmoe.training.jobfile)")
    groups = {name: ap.add_argument_group(name) for name in GROUPS}
    for name, f in FIELDS.items():
        meta = f.metadata
        kind, *arg = meta["check"]
        g = groups[meta["group"]]
        if kind == "bool":                             # --sp / --no-sp: a job file's switch can be undone
            g.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=None, help=meta["help"])
        elif kind in ("int", "float", "fraction"):     # --microbatches default: a job file's number undone
            g.add_argument(flag(name), metavar=meta["metavar"], default=None, help=meta["help"],
                           type=_number("int" if kind == "int" else "float"))
        elif kind == "choice":
            g.add_argument(flag(name), choices=arg[0], default=None, help=meta["help"])
        else:
            g.add_argument(flag(name), metavar=meta["metavar"], default=None, help=meta["help"])
    return ap


def parse_args(argv: Optional[Sequence[str]] = None, ap: Optional[argparse.ArgumentParser] = None) -> JobConfig:
    """The :class:`JobConfig` of a command line; a value its field refuses is a usage error (exit 2)."""
    ap = ap or build_parser()
    known, _ = ap.parse_known_args(argv)
    if known.config:                                   # the job file's values are the defaults
        try:
            ap.set_defaults(**read_job_file(known.config))
        except ValueError as e:
            ap.error(str(e))
    ns = vars(ap.parse_args(argv))
    ns.pop("config")
    try:
        return JobConfig(**ns)
    except ValueError as e:
        ap.error(str(e))


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
        return one_line(e, e.strerror + (f": {e.filename}" if e.filename else ""))
    if isinstance(e, (NonFiniteStep, NodeStopped)):
        return one_line(e, str(e))
    return one_line(e)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``fmoe train``; returns the exit code (see the module docstring)."""
    ap = build_parser()
    cfg = parse_args(argv, ap)                         # usage errors exit 2 here
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        last = run(cfg)
    except JobConfigError as e:                        # found before anything started
        ap.error(str(e))
    except Interrupted as e:
        from ..checkpoint import training as ckpt

        out = cfg.out or cfg.resume or DEFAULT_OUT        # (a resumed run writes into its own directory)
        good = ckpt.latest(out) if os.path.isdir(out) else None
        if printing_rank():                               # under torchrun every rank gets it: one line a node
            print(f"fmoe train: error: stopped by {e}; every rank stopped (last complete checkpoint: "
                  f"{good or 'none'}; a save cut short is never used)", file=sys.stderr)
        return 128 + e.signum
    except BaseException as e:  # every failure is one line (CheckpointException too)
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        if cfg.debug:
            traceback.print_exc()
        if prints(e):                                     # once a node, not where the first failure prints
            print(f"fmoe train: error: {_describe(e)}", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if last is not None:
        print('{"final": ' + log_row(last) + "}")
    return 0
