"""Training on one rank: the model, its plan and shards, the steps, the log and the checkpoints.

:func:`run` is what every rank executes (spawned locally or under torchrun; the process group
is already initialised): build or load the model (a ``--preset``, ``--init-hf`` or the config a
``--resume`` checkpoint recorded), compose its plan with the data-parallel splits, shard it,
then for each step: the step's batch for this rank's data-parallel index, one
:func:`fmoe.train.step.train_step`, an optional evaluation, one JSON line in ``OUT/log.jsonl``
(rank 0) and the progress bar; checkpoints every ``--save-every`` steps and at the end. A
non-finite loss or gradient norm raises :class:`NonFiniteStep` (``--skip-nonfinite N`` skips up
to N such steps first).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
from dataclasses import asdict, is_dataclass

from ..precision import dtype_of
from . import options

__all__ = ["run", "log_row", "NonFiniteStep"]


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
            "clip": args.clip, "aux_weight": args.aux_weight, "param_dtype": str(dtype_of(args.master_dtype))[6:],
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
    full = fmoe.tree.map_with_path(lambda _, t: t.to(device, dtype_of(args.master_dtype)), full)  # trained dtype
    cfg = model_of(model).with_aux_loss(cfg, args.aux_weight)      # declared switch, no probing
    model_plan = model_of(model).build_plan(cfg, mesh=mesh)      # default plan, model checks
    plan = model_of(model).build_plan(cfg, model_plan, mesh, full, data_parallel=True)
    packed = ckpt.packed_layout(plan, full)
    need = 3 * sum(t.numel() * t.element_size() for t in fmoe.tree.leaves(full))   # params + 2 moments
    ckpt.on_rank0(lambda: check_room(args.out, need), f"checking --out {args.out}")
    params = fmoe.shard(fmoe.tree.map_with_path(
        lambda p, t: t.detach().requires_grad_(not p.endswith("expert_bias")), full), plan, mesh)
    del full
    opt_state = adamw_init(params, dtype=dtype_of(args.optim_dtype))
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
