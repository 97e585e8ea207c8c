"""The main job's flags: ``python -m fmoe.train``'s parser, its help and its exit-code epilog.

:func:`build_parser` groups the flags (model, mesh, data, optimization, checkpoints and output,
runtime; :func:`fmoe.train.options.add_arguments` adds data / precision / device / memory /
routing). Each flag has a help text, and ``--help`` shows every default. Flag values that a
type can check (an integer >= 1, a finite number > 0) are checked here, by argparse; checks
across flags, OUT and a resume are :mod:`fmoe.train.parse`'s.

Adding a flag: put it in the right group of :func:`build_parser` (``groups["data"]`` ...) with a
help text; if a resumed run must keep it, add it to :data:`fmoe.train.resume.KEPT`.
"""

from __future__ import annotations

import argparse
import math
from typing import Optional

from ..model import PRESETS
from ..models import NAMES
from . import options, threads
from ..training import balancing

DEFAULT_OUT = "runs/fmoe"

__all__ = ["DEFAULT_OUT", "EPILOG", "build_parser"]


def _int_at_least(name: str, low: int, high: Optional[int] = None):
    valid = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {valid}, got {s!r}")
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"{name} must be {valid}, got {v}")
        return v
    return conv


SEED_MAX = 2**63 - 1   # torch.Generator.manual_seed takes 64-bit seeds; derived seeds wrap to 64 bits


def _positive(name: str):
    return _int_at_least(name, 1)


def _nonneg(name: str):
    return _int_at_least(name, 0)


def _positive_float(name: str):
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number > 0, got {s!r}")
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{name} must be a number > 0, got {v}")
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number, got {v}")
        return v
    return conv


class _Help(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to every flag whose default is a value (not None / a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" not in text and action.option_strings and not (
                default is None or default is False or default is argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


EPILOG = f"""\
exit codes:
  0  the run finished (a {{"final": ...}} line on stdout)
  1  runtime error while running (one 'fmoe.train: error: ...' line; --debug adds the traceback)
  2  usage error: a bad flag value or combination, --out holding another run, or a --resume
     that does not match its checkpoint (checked before anything starts)
  130 / 143  stopped by SIGINT / SIGTERM (every rank stopped; complete checkpoints are kept)

resume: --resume keeps the run's model, preset, seed, batch, seq, lr schedule, optimizer
  settings and aux weight (flags left out take the checkpoint's values; a different value is
  an error); the mesh may change if the number of data-parallel batches (world / tp) stays.
  Schedule rule: warmup + cosine over the --steps of the run that was started; extending a run
  with a larger --steps trains the extra steps at the final lr (0.1 * --lr).

OUT (default {DEFAULT_OUT}): holds log.jsonl and step-N/ checkpoints of one run, locked by
  OUT/.lock while a job runs. A new run refuses an OUT holding another run unless it resumes
  that run (--resume of a checkpoint in OUT) or --overwrite (which removes only that run's
  log.jsonl and step-N/) is given; resuming an older checkpoint of OUT with newer ones there
  needs --overwrite too (it removes the newer checkpoints and their log rows).
"""


def build_parser() -> argparse.ArgumentParser:
    """The flag parser; flags are grouped (model, mesh, data, optimization, checkpoints, runtime)."""
    ap = argparse.ArgumentParser(prog="python -m fmoe.train", formatter_class=_Help, epilog=EPILOG,
                                 description="Train an fmoe mixture-of-experts model on local gloo ranks "
                                             "(or under torchrun).")
    g = {name: ap.add_argument_group(name) for name in
         ("model", "mesh", "data", "optimization", "checkpoints and output", "runtime")}
    m = g["model"]
    m.add_argument("--model", choices=NAMES, default="qwen3_moe", help="model family (fmoe.models)")
    m.add_argument("--preset", choices=PRESETS, default="tiny", help="model size preset")
    m.add_argument("--init-hf", default=None, metavar="DIR",
                   help="start from this Hugging Face checkpoint (config and weights; weights cast to "
                        "fp32 master weights) instead of a random --preset model (default: none)")
    m.add_argument("--aux-weight", metavar="X", type=float, default=0.01,
                   help="coefficient of the per-layer load-balance loss of MoE models (--balance aux / seq_aux "
                        "/ global_aux; 0: off)")
    balancing.add_arguments(m)
    m.add_argument("--upcycle", metavar="E,K", default=None,
                   help="with --model mixtral --init-hf LLAMA_DIR: start from the dense model, each MLP copied into E "
                        "experts, top-K routing (fmoe.training.upcycle) (default: none)")
    m.add_argument("--impl", metavar="NAME", default="auto", help="MoE dispatch implementation (a name registered in fmoe.ep)")
    h = g["mesh"]
    h.add_argument("--nproc", metavar="N", type=_positive("--nproc"), default=1,
                   help="local ranks to spawn (ignored under torchrun)")
    h.add_argument("--tp", metavar="N", type=_positive("--tp"), default=1, help="tensor-parallel size")
    h.add_argument("--ep", metavar="N", type=_positive("--ep"), default=None,
                   help="expert-parallel size (default: same as --tp)")
    h.add_argument("--dp-replicate", metavar="N", type=_positive("--dp-replicate"), default=1,
                   help="data-parallel replicas (HSDP); fsdp = nproc / (tp * dp_replicate)")
    d = g["data"]
    d.add_argument("--batch", metavar="N", type=_positive("--batch"), default=4, help="sequences per data-parallel batch")
    d.add_argument("--seq", metavar="N", type=_positive("--seq"), default=64, help="tokens per sequence")
    d.add_argument("--seed", metavar="N", type=_int_at_least("--seed", 0, SEED_MAX), default=0, help="seed of the initial weights and of the batches")
    o = g["optimization"]
    o.add_argument("--steps", metavar="N", type=_positive("--steps"), default=20,
                   help="train until this step (with --resume: the step to reach, beyond the saved one)")
    o.add_argument("--lr", metavar="X", type=_positive_float("--lr"), default=3e-3,
                   help="peak learning rate (linear warmup, then cosine to 0.1 * lr at --steps)")
    o.add_argument("--warmup", metavar="N", type=_nonneg("--warmup"), default=5, help="warmup steps")
    o.add_argument("--weight-decay", metavar="X", type=float, default=0.1, help="AdamW decoupled weight decay")
    o.add_argument("--clip", metavar="X", type=_positive_float("--clip"), default=1.0, help="global gradient-norm clip")
    o.add_argument("--skip-nonfinite", metavar="N", type=_nonneg("--skip-nonfinite"), default=0,
                   help="skip up to N steps whose loss or gradient norm is NaN/Inf (no update); one more "
                        "stops the job. 0: the first one stops the job")
    c = g["checkpoints and output"]
    c.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help="run directory: log.jsonl, step-N/ checkpoints, .lock")
    c.add_argument("--save-every", metavar="N", type=_nonneg("--save-every"), default=0,
                   help="checkpoint every N steps (0: only at the end)")
    c.add_argument("--resume", default=None, metavar="PATH",
                   help="continue from a step-N checkpoint, or from the latest one in a run directory "
                        "(default: start a new run)")
    c.add_argument("--export-hf", default=None, metavar="DIR",
                   help="write a Hugging Face checkpoint here at the end (default: none)")
    c.add_argument("--overwrite", action="store_true",
                   help="replace the previous run in --out (its log.jsonl and step-N/ only; resuming an "
                        "older checkpoint of --out: its newer checkpoints and log rows) and let --export-hf "
                        "replace checkpoint files in a directory holding other files (default: refuse)")
    r = g["runtime"]
    r.add_argument("--timeout", metavar="X", type=_positive_float("--timeout"), default=1800.0,
                   help="collective timeout, seconds")
    threads.add_argument(r, _positive("--threads"))
    r.add_argument("--quiet", action="store_true", help="no progress bar (default: a progress bar on rank 0)")
    r.add_argument("--debug", action="store_true",
                   help="print the full traceback of an error (default: one line)")
    options.add_arguments(ap)
    ap.groups = g  # type: ignore[attr-defined]
    return ap
