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

Adding a flag: put it in the right group of :func:`build_parser` (``groups["data"]`` ...) with a
help text; if a resumed run must keep it, add it to :data:`fmoe.train.resume.KEPT`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import signal
import sys
import traceback
import warnings
from dataclasses import asdict, is_dataclass
from typing import Optional, Sequence

from ..mesh import check_layout
from . import options

MODELS = ("qwen3_moe", "mixtral", "gpt_oss", "llama", "deepseek_v3")
DEFAULT_OUT = "runs/fmoe"
FLAG_NAMES = {"tp": "--tp", "ep": "--ep", "dp_replicate": "--dp-replicate"}   # mesh fields as flags

__all__ = ["build_parser", "parse_args", "main", "run", "DEFAULT_OUT"]


def _int_at_least(name: str, low: int):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {low}, got {s!r}")
        if v < low:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {low}, got {v}")
        return v
    return conv


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
    m.add_argument("--model", choices=MODELS, default="qwen3_moe", help="model family")
    m.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="model size preset")
    m.add_argument("--init-hf", default=None, metavar="DIR",
                   help="start from this Hugging Face checkpoint (config and weights; weights cast to "
                        "fp32 master weights) instead of a random --preset model (default: none)")
    m.add_argument("--aux-weight", metavar="X", type=float, default=0.01,
                   help="coefficient of the per-layer load-balance loss of MoE models (0: off)")
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
    d.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the initial weights and of the batches")
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
    r.add_argument("--quiet", action="store_true", help="no progress bar (default: a progress bar on rank 0)")
    r.add_argument("--debug", action="store_true",
                   help="print the full traceback of an error (default: one line)")
    options.add_arguments(ap)
    ap.groups = g  # type: ignore[attr-defined]
    return ap


def _explicit(argv: Optional[Sequence[str]]) -> set:
    """The dests given on the command line (a parse with every default suppressed)."""
    ap = build_parser()
    for a in ap._actions:
        a.default = argparse.SUPPRESS
    ns, _ = ap.parse_known_args(argv)
    return set(vars(ns))


def _launcher_world() -> Optional[int]:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "FMOE_SPAWNED" not in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate flags, OUT and a resume; a problem exits with a usage error (code 2)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    args.explicit = _explicit(argv)
    args.world = _launcher_world() or args.nproc
    ep = args.tp if args.ep is None else args.ep
    try:                                               # Mesh's own rules, before any rank starts
        check_layout(args.world, tp=args.tp, ep=ep, dp_replicate=args.dp_replicate,
                     names={**FLAG_NAMES, "world": "WORLD_SIZE" if _launcher_world() else "--nproc"})
    except ValueError as e:
        ap.error(str(e))
    if args.init_hf and not os.path.isdir(args.init_hf):
        ap.error(f"--init-hf {args.init_hf!r} is not a directory")
    if not math.isfinite(args.aux_weight) or args.aux_weight < 0:
        ap.error(f"--aux-weight must be a finite number >= 0, got {args.aux_weight}")
    if not math.isfinite(args.weight_decay) or args.weight_decay < 0:
        ap.error(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
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
    _check_out(ap, args)
    return args


def _check_resume(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from fmoe.train import ckpt, resume

    if not os.path.exists(args.resume):
        ap.error(f"--resume {args.resume!r} does not exist")
    path = ckpt.latest(args.resume)
    if path is None:
        ap.error(f"--resume {args.resume!r}: no complete step-N checkpoint there")
    try:
        meta = ckpt.read_meta(path)
    except ValueError as e:
        ap.error(f"--resume: {e}")
    if meta.get("model") not in MODELS:
        ap.error(f"--resume {path}: meta.json names model {meta.get('model')!r}, not one of {MODELS}")
    resume.apply(args, meta, path, ap.error)
    args.resume_path, args.resume_meta = path, meta


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def _check_out(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from fmoe.checkpoint.atomic import check_target
    from fmoe.train.outdir import holds_run, newer_steps

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} exists and is not a directory")
    previous = holds_run(args.out)
    own = bool(args.resume_path) and _inside(args.resume_path, args.out)    # continues OUT's run
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


def _config_dict(cfg) -> dict:
    return asdict(cfg) if is_dataclass(cfg) else dict(vars(cfg))


class _Progress:
    """A one-line progress bar on a terminal; every ~5% of the steps a plain line otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.tty = total, enabled, sys.stderr.isatty()

    def update(self, step: int, m: dict) -> None:
        if not self.enabled:
            return
        n = 30 * step // self.total
        text = (f"[{'#' * n}{'.' * (30 - n)}] {step}/{self.total} loss {m['loss']:.4f} "
                f"{m['tokens_per_s']:.0f} tok/s grad_norm {m['grad_norm']:.3f}")
        if self.tty:
            sys.stderr.write("\r" + text + ("\n" if step == self.total else ""))
        elif step == self.total or step % max(1, self.total // 20) == 0:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _preset(model, name: str, tp: int):
    """The model's preset config, widened where a toy preset cannot serve this job: at least
    256 vocabulary entries (byte tokens) and, when ``tp`` does not divide the KV heads but
    divides the query heads, as many KV heads as ``tp`` (so every mesh in the README runs)."""
    cfg = getattr(model.Config, name)()
    changes = {}
    if cfg.vocab_size < 256:
        changes["vocab_size"] = 256
    kv, heads = getattr(cfg, "num_key_value_heads", None), getattr(cfg, "num_attention_heads", None)
    if kv is not None and kv % tp and heads % tp == 0:
        changes["num_key_value_heads"] = tp
    return dataclasses.replace(cfg, **changes) if changes else cfg


def log_row(row: dict) -> str:
    """One valid JSON line: non-finite floats become ``null`` and are named under ``"nonfinite"``.

    Example:
        >>> log_row({"step": 3, "loss": float("nan")})
        '{"step": 3, "loss": null, "nonfinite": ["loss"]}'
    """
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    clean = {k: (None if k in bad else v) for k, v in row.items()}
    if bad:
        clean["nonfinite"] = bad
    return json.dumps(clean, allow_nan=False)


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm was NaN/Inf (the update was not applied)."""


def _append_log(path: str, line: str) -> None:
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror or e} writing {path}") from e


def _job_meta(args: argparse.Namespace, model, cfg, mesh) -> dict:
    """What ``meta.json`` records about the job (read back by :mod:`fmoe.train.resume`)."""
    from fmoe.train import resume

    return {"model": args.model, "preset": None if args.init_hf else args.preset, "init_hf": args.init_hf,
            "config": _config_dict(cfg), "hf_config": cfg.to_hf(), "seed": args.seed, "batch": args.batch,
            "seq": args.seq, "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
            "clip": args.clip, "aux_weight": args.aux_weight, "param_dtype": "float32",
            "schedule": resume.schedule_record(args),
            "mesh": {"tp": mesh.tp, "ep": mesh.ep, "fsdp": mesh.fsdp, "dp_replicate": mesh.dp_replicate,
                     "world": mesh.world, "num_batches": mesh.num_batches}}


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Train on this rank (process group already initialised when ``world > 1``)."""

    import torch

    import fmoe
    from fmoe.model import model_of
    from fmoe.train import ckpt
    from fmoe.train.evaluate import evaluate
    from fmoe.train.optim import AdamWConfig, adamw_init, lr_at
    from fmoe.train.outdir import check_room
    from fmoe.train.step import StepConfig, train_step

    warnings.filterwarnings("ignore", category=FutureWarning,        # the job's output stays clean;
                            message=r".*reduce_scatter_tensor. is deprecated")  # library: see notes
    model = importlib.import_module(f"fmoe.models.{args.model}")
    mesh = fmoe.Mesh(tp=args.tp, ep=args.ep, dp_replicate=args.dp_replicate)
    device = options.resolve_device(args.device, int(os.environ.get("LOCAL_RANK", rank)))
    if args.init_hf:                                   # fp32 master weights whatever the file holds
        full, cfg = model.load_hf(args.init_hf, dtype=torch.float32)
        tokenizer = options.resolve_tokenizer(args, cfg.vocab_size)
    elif args.resume_path:                             # the config the checkpoint was trained with
        cfg = model.Config.from_hf(args.resume_meta["hf_config"])
        tokenizer = options.resolve_tokenizer(args, cfg.vocab_size)
        full = model.init(cfg, seed=args.seed)
    else:
        tokenizer = options.resolve_tokenizer(args)
        cfg = options.fit_vocab(_preset(model, args.preset, args.tp), tokenizer, args.tp)
        full = model.init(cfg, seed=args.seed)
    train_data, held_out = options.open_streams(args, tokenizer)
    if cfg.vocab_size < max(256, train_data.vocab_size or 0):
        raise ValueError(f"model vocab_size {cfg.vocab_size} cannot hold the data's token ids "
                         f"(vocabulary {train_data.vocab_size} of {train_data.name})")
    full = fmoe.tree.map_with_path(lambda _, t: t.to(device), full)
    if hasattr(cfg, "output_router_logits"):
        cfg = dataclasses.replace(cfg, output_router_logits=args.aux_weight > 0,
                                  router_aux_loss_coef=args.aux_weight)
    model_plan = model_of(model).build_plan(cfg, mesh=mesh)      # default plan, model checks
    plan = model_of(model).build_plan(cfg, model_plan, mesh, full, data_parallel=True)
    packed = ckpt.packed_layout(plan, full)
    need = 3 * sum(t.numel() * t.element_size() for t in fmoe.tree.leaves(full))   # params + 2 moments
    ckpt.on_rank0(lambda: check_room(args.out, need), f"checking --out {args.out}")
    params = fmoe.shard(fmoe.tree.map_with_path(
        lambda p, t: t.detach().requires_grad_(not p.endswith("expert_bias")), full), plan, mesh)
    del full
    opt_state = adamw_init(params)
    start = 0
    if args.resume_path:
        start = ckpt.load(args.resume_path, params, opt_state, packed)["step"]
    step_cfg = StepConfig(opt=AdamWConfig(weight_decay=args.weight_decay, max_grad_norm=args.clip),
                          impl=args.impl, **options.step_options(args))
    rank0 = rank == 0
    if rank0 and not args.quiet:
        options.print_memory_plan(args, model, cfg, model_plan, world)
    meta = {**_job_meta(args, model, cfg, mesh), **options.run_meta(args, tokenizer, device)}
    bar = _Progress(args.steps, rank0 and not args.quiet)
    last: dict = {}
    skipped = 0
    for step in range(start + 1, args.steps + 1):
        batch = train_data.batch(step, mesh.batch_index, args.batch * args.grad_accum, args.seq, args.seed,
                                 num_batches=mesh.num_batches)
        lr = lr_at(step, args.lr, args.warmup, args.schedule_total)
        params, opt_state, m = train_step(model, cfg, params, opt_state, tuple(t.to(device) for t in batch),
                                          mesh=mesh, step_cfg=step_cfg, lr=lr)
        if options.should_eval(args, step):
            m.update(evaluate(model, cfg, params, held_out, mesh=mesh, batches=args.eval_batches, batch=args.batch,
                              seq=args.seq, seed=args.seed, impl=args.impl, router=step_cfg.router,
                              dtype=args.dtype, device=device))
        last = {"step": step, **m}
        if rank0:
            _append_log(os.path.join(args.out, "log.jsonl"), log_row(last))
        if m.get("skipped"):
            skipped += 1
            if skipped > args.skip_nonfinite:
                good = ckpt.latest(args.out)
                what = "loss" if not math.isfinite(m["loss"]) else "gradient norm"
                raise NonFiniteStep(
                    f"step {step}: non-finite {what} (loss {m['loss']}, gradient norm {m['grad_norm']}); the "
                    f"update was not applied and nothing was saved (last good checkpoint: {good or 'none'}). "
                    f"Try a lower --lr, or --skip-nonfinite N to skip up to N such steps")
        else:
            bar.update(step, m)
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            ckpt.save(args.out, step, params, opt_state, meta, packed)
    if args.export_hf:
        model.save_hf(params, cfg, args.export_hf, overwrite=args.overwrite)
        if rank0:
            options.export_tokenizer(tokenizer, args.export_hf)
    return last


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
    from fmoe.train.outdir import clear_run, drop_after

    if not args.overwrite:
        return
    if args.resume_path and _inside(args.resume_path, args.out):
        drop_after(args.out, args.resume_meta["step"])     # the run continues from there
    else:
        clear_run(args.out)


def _train(args: argparse.Namespace) -> Optional[dict]:
    """Run the job (launcher side); returns rank 0's last metrics, None on other torchrun ranks."""
    from fmoe.train.outdir import OutLock

    world = _launcher_world()
    if world is not None:                              # torchrun: its ranks, rank 0 holds the lock
        import datetime

        import torch.distributed as dist

        from fmoe.train import ckpt

        if world > 1 and not dist.is_initialized():
            backend = "nccl" if options.resolve_device(args.device, int(os.environ.get("LOCAL_RANK", 0))).type == "cuda" \
                else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
        rank = int(os.environ["RANK"])
        lock = OutLock(args.out)
        ckpt.on_rank0(lambda: (lock.acquire(), _prepare_out(args)), f"locking --out {args.out}")
        try:
            last = run(rank, world, args)
        finally:
            lock.release()
        return last if rank == 0 else None
    with OutLock(args.out):
        _prepare_out(args)
        if args.nproc == 1:
            return run(0, 1, args)
        from fmoe.testing import spawn

        previous = os.environ.get("FMOE_SPAWNED")
        os.environ["FMOE_SPAWNED"] = "1"      # read by the ranks; not left behind in this process,
        try:                                   # whose later torchrun children must not inherit it
            return spawn(_spawned, args.nproc, args, timeout=args.timeout * max(1, args.steps),
                         collective_timeout=args.timeout)[0]
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
        from fmoe.train import ckpt

        good = ckpt.latest(args.out) if os.path.isdir(args.out) else None
        print(f"fmoe.train: error: stopped by {e}; every rank stopped (last complete checkpoint: "
              f"{good or 'none'}; a save cut short is never used)", file=sys.stderr)
        return 128 + e.signum
    except BaseException as e:  # noqa: BLE001 - every failure is one line (CheckpointException too)
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
