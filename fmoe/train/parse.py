"""Reading the command line: every usage error (exit code 2) before anything starts.

:func:`parse_args` parses the flags (:func:`fmoe.train.flags.build_parser`), then checks what
one flag cannot: the mesh (by :func:`fmoe.mesh.check_layout`, the rules :class:`fmoe.Mesh`
enforces, with the fields named as flags), values across flags, the ``--resume`` checkpoint
(:mod:`fmoe.train.resume` says what it may change) and ``--out`` (a run directory holds one
run; :mod:`fmoe.train.outdir`). A problem is one ``ap.error`` line: ``fmoe.train: error: ...``,
exit 2, before any rank is spawned.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional, Sequence

from ..mesh import check_layout
from ..models import NAMES, get
from . import options
from ..training import balancing
from .flags import build_parser

FLAG_NAMES = {"tp": "--tp", "ep": "--ep", "dp_replicate": "--dp-replicate"}   # mesh fields as flags

__all__ = ["parse_args", "launcher_world", "inside"]


def _explicit(argv: Optional[Sequence[str]]) -> set:
    """The dests given on the command line (a parse with every default suppressed)."""
    ap = build_parser()
    for a in ap._actions:
        a.default = argparse.SUPPRESS
    ns, _ = ap.parse_known_args(argv)
    return set(vars(ns))


def launcher_world() -> Optional[int]:
    """The launcher's world size under torchrun (``RANK`` and ``WORLD_SIZE`` set, not by our own
    spawn); None when the job spawns its ranks itself."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "FMOE_SPAWNED" not in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate flags, OUT and a resume; a problem exits with a usage error (code 2)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.explicit = _explicit(argv)
    args.world = launcher_world() or args.nproc
    ep = args.tp if args.ep is None else args.ep
    try:                                               # Mesh's own rules, before any rank starts
        check_layout(args.world, tp=args.tp, ep=ep, dp_replicate=args.dp_replicate,
                     names={**FLAG_NAMES, "world": "WORLD_SIZE" if launcher_world() else "--nproc"})
    except ValueError as e:
        ap.error(str(e))
    if args.init_hf and not os.path.isdir(args.init_hf):
        ap.error(f"--init-hf {args.init_hf!r} is not a directory")
    _check_numbers(args, ap.error)
    if args.impl != "auto":
        import fmoe.ep
        if args.impl not in fmoe.ep.registered():
            ap.error(f"--impl {args.impl!r} is not a registered MoE implementation; choose from "
                     f"{['auto'] + fmoe.ep.registered()}")
    if args.resume and args.init_hf:
        ap.error("--resume and --init-hf are exclusive")
    options.check(args, ap)
    args.ep = ep
    args.schedule_total = args.steps
    args.resume_path = None
    if args.resume:
        _check_resume(ap, args)
    else:
        _check_sizes(args, 256, ap.error)
    balancing.resolve(args, ap.error, {n: get(n) for n in NAMES})   # after a resume filled in the kept settings
    _check_upcycle(ap, args)
    _check_out(ap, args)
    return args


def _check_numbers(args: argparse.Namespace, error) -> None:
    """The float flags argparse cannot range-check (also re-run on the values a resume keeps)."""
    for name in ("aux_weight", "weight_decay"):
        v = getattr(args, name)
        if v is None and name == "aux_weight":      # no loss applies (fmoe.training.balancing resolves it)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v!r}")


def _check_sizes(args: argparse.Namespace, vocab: int, error) -> None:
    """The step's logits (``--batch * --seq`` rows of ``vocab`` fp32, with their gradient) fit
    in this machine's memory: checked by arithmetic, before anything is allocated."""
    from fmoe.checkpoint.config_check import memory_bytes

    need = 2 * 4 * args.batch * args.seq * vocab
    if need > memory_bytes():
        error(f"--batch {args.batch} x --seq {args.seq} x vocabulary {vocab}: one step's logits and their gradient "
              f"need {need / 1e9:.3g} GB, more than this machine's {memory_bytes() / 1e9:.3g} GB; lower --batch "
              "or --seq (or use --grad-accum)")


class _Prefixed:
    """An ``error`` that names the checkpoint a kept value came from."""

    def __init__(self, ap: argparse.ArgumentParser, where: str):
        self.ap, self.where = ap, where

    def error(self, message: str) -> None:
        self.ap.error(f"--resume {self.where}: meta.json holds a value its flag refuses: {message}")


def _check_resume(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from fmoe.checkpoint import training as ckpt
    from fmoe.checkpoint.config_check import config_from_dict
    from fmoe.train import resume

    if not os.path.exists(args.resume):
        ap.error(f"--resume {args.resume!r} does not exist")
    path = ckpt.latest(args.resume)
    if path is None:
        ap.error(f"--resume {args.resume!r}: no complete step-N checkpoint there")
    try:
        meta = ckpt.read_meta(path)
    except ValueError as e:
        ap.error(f"--resume: {e}")
    file = os.path.join(path, "meta.json")
    if meta.get("model") not in NAMES:
        ap.error(f"--resume: {file}: 'model' is {meta.get('model')!r}, not one of {list(NAMES)}")
    resume.apply(args, meta, path, ap.error)
    shim = _Prefixed(ap, path)
    _check_numbers(args, shim.error)                   # kept values, checked like their flags
    options.check(args, shim)
    model = get(args.model)
    try:                                               # the kept model config, before any allocation
        cfg = config_from_dict(model, meta.get("hf_config"), f"{file} 'hf_config'", fits=True)
    except ValueError as e:
        ap.error(f"--resume: {e}")
    _check_sizes(args, cfg.vocab_size, ap.error)
    if "out" not in args.explicit:                     # continue in the run's own directory
        args.out = os.path.dirname(os.path.abspath(path))
    args.resume_path, args.resume_meta = path, meta


def _check_upcycle(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.upcycle is None:
        return
    from fmoe.training.upcycle import parse_upcycle

    if args.model != "mixtral" or not args.init_hf:
        ap.error(f"--upcycle {args.upcycle}: upcycles a dense llama checkpoint into mixtral; give --model mixtral "
                 f"--init-hf LLAMA_DIR (this run: --model {args.model}, --init-hf {args.init_hf})")
    try:
        parse_upcycle(args.upcycle)
    except ValueError as e:
        ap.error(str(e))


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies under it (links resolved)."""
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def _check_out(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from fmoe.checkpoint.atomic import check_target
    from fmoe.train.outdir import holds_run, newer_steps

    from fmoe.train.outdir import links

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} exists and is not a directory")
    linked = links(args.out)
    if linked:
        name = linked[0]
        ap.error(f"--out {args.out!r}: {name} is a symbolic link (to {os.readlink(os.path.join(args.out, name))!r}); "
                 "fmoe.train never writes, removes or resumes through a link in OUT: remove it "
                 f"({len(linked)} link(s): {', '.join(linked[:6])})")
    previous = holds_run(args.out)
    own = bool(args.resume_path) and inside(args.resume_path, args.out)    # continues OUT's run
    if previous and not own and not args.overwrite:
        what = f"not the run --resume {args.resume_path} continues" if args.resume_path else "another run"
        ap.error(f"--out {args.out!r} holds {what} ({', '.join(previous[:6])}); pass --resume "
                 f"{args.out} to continue it, --overwrite to replace it, or choose another --out")
    newer = newer_steps(args.out, args.resume_meta["step"]) if own else []
    if newer and not args.overwrite:
        ap.error(f"--out {args.out!r} holds newer checkpoints ({', '.join(newer[:6])}) than the one --resume "
                 f"continues ({args.resume_path}); they would mix with this run. Resume from the latest, "
                 "pass --overwrite to remove them (and their log.jsonl rows), or choose another --out")
    if args.export_hf:
        if os.path.realpath(args.export_hf) == os.path.realpath(args.out) and not args.overwrite:
            ap.error(f"--export-hf {args.export_hf!r} is the run directory --out; the export would sit "
                     "among the run's files. Choose another directory, or pass --overwrite to write "
                     "config.json and the safetensors files beside them")
        try:
            check_target(args.export_hf, overwrite=args.overwrite, what="--export-hf")
        except ValueError as e:
            ap.error(str(e))
