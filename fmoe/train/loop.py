"""Training on one rank: the model, its plan and shards, the steps, the log and the checkpoints.

:func:`run` is what every rank executes (spawned locally or under torchrun; the process group
is already initialised): build or load the model (a ``--preset``, ``--init-hf`` or the config a
``--resume`` checkpoint recorded), compose its plan with the data-parallel splits, shard it,
then for each step: the step's batch for this rank's data-parallel index, one
:func:`fmoe.training.step.train_step`, an optional evaluation, one JSON line in ``OUT/log.jsonl``
(rank 0) and the progress bar; checkpoints every ``--save-every`` steps and at the end. A
non-finite loss or gradient norm raises :class:`NonFiniteStep` (``--skip-nonfinite N`` skips up
to N such steps first).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, is_dataclass

from ..precision import dtype_of
from . import options
from ..training import balancing
from .threads import threads_of

__all__ = ["run", "log_row", "NonFiniteStep"]


def _config_dict(cfg) -> dict:
    return asdict(cfg) if is_dataclass(cfg) else dict(vars(cfg))


class _Progress:
    """The steps' progress on rank 0: a ``tqdm`` bar (rate, ETA; on a terminal one line redrawn, in
    a log file or notebook a line about every ~5% of the steps) with the loss, tokens/s and
    gradient norm of the last step."""

    def __init__(self, total: int, start: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=start, unit="step", disable=not enabled, dynamic_ncols=True,
                        file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 0.0,
                        miniters=1 if sys.stderr.isatty() else max(1, total // 20))

    def update(self, step: int, m: dict) -> None:
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}",
                             grad_norm=f"{m['grad_norm']:.3f}", refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


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
    from fmoe.models import get
    from fmoe.checkpoint import training as ckpt
    from fmoe.training.evaluate import evaluate
    from fmoe.optim import AdamWConfig, lr_at
    from fmoe.optim.adamw import init as adamw_init
    from fmoe.train.outdir import append_row, check_room
    from fmoe.training.step import StepConfig, train_step

    torch.set_num_threads(threads_of(args))           # --threads (fmoe.train.threads)
    model = get(args.model)                            # the declared Model, from the registry
    mesh = fmoe.Mesh(tp=args.tp, ep=args.ep, dp_replicate=args.dp_replicate)
    device = options.resolve_device(args.device, int(os.environ.get("LOCAL_RANK", rank)))
    if args.init_hf and vars(args).get("upcycle"):    # a dense llama checkpoint, MLPs copied into experts
        from fmoe.training.upcycle import parse_upcycle, upcycle
        dense, dense_cfg = get("llama").load_hf(args.init_hf, dtype=torch.float32)
        full, cfg = upcycle(dense, dense_cfg, model.Config, *parse_upcycle(args.upcycle), seed=args.seed)
        tokenizer = options.resolve_tokenizer(args, cfg.vocab_size)
    elif args.init_hf:                                 # fp32 master weights whatever the file holds
        full, cfg = model.load_hf(args.init_hf, dtype=torch.float32)
        tokenizer = options.resolve_tokenizer(args, cfg.vocab_size)
    elif args.resume_path:                             # the config the checkpoint was trained with
        cfg = model.Config.from_hf(args.resume_meta["hf_config"])
        tokenizer = options.resolve_tokenizer(args, cfg.vocab_size)
        full = model.init(cfg, seed=args.seed)
    else:
        tokenizer = options.resolve_tokenizer(args)
        cfg = options.fit_vocab(model.preset(args.preset, args.tp), tokenizer, args.tp)
        full = model.init(cfg, seed=args.seed)
    train_data, held_out = options.open_streams(args, tokenizer)
    if cfg.vocab_size < max(256, train_data.vocab_size or 0):
        raise ValueError(f"model vocab_size {cfg.vocab_size} cannot hold the data's token ids "
                         f"(vocabulary {train_data.vocab_size} of {train_data.name})")
    full = fmoe.tree.map_with_path(lambda _, t: t.to(device, dtype_of(args.master_dtype)), full)  # trained dtype
    # the trainer's router carries the balance losses (fmoe.training.balancing); the exported config
    # records the Switch loss weight as transformers reads it
    hf_cfg = model.with_aux_loss(cfg, args.aux_weight if args.balance == "aux" else 0.0)
    cfg = model.with_aux_loss(cfg, 0.0)                # declared switch, no probing
    full = balancing.with_expert_bias(full, args)      # --balance bias on any MoE model
    model_plan = model.build_plan(cfg, mesh=mesh)      # default plan, model checks
    plan = model.build_plan(cfg, model_plan, mesh, full, data_parallel=True)
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
    step_cfg = vars(args).get("step_config") or StepConfig(   # fmoe.train.run(step_config=...) replaces it
        opt=AdamWConfig(weight_decay=args.weight_decay, max_grad_norm=args.clip),
        impl=args.impl, **balancing.step_options(args, cfg, options.step_options(args), model))
    step_cfg, write_record = balancing.with_recording(args, step_cfg, rank)     # --record-routing
    rank0 = rank == 0
    if rank0:                                          # --quiet keeps only its warning
        options.print_memory_plan(args, model, cfg, model_plan, world)
    meta = {**_job_meta(args, model, hf_cfg, mesh), **options.run_meta(args, tokenizer, device),
            **balancing.record(args), "upcycle": vars(args).get("upcycle"), "threads": torch.get_num_threads()}
    bar = _Progress(args.steps, start, rank0 and not args.quiet)
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
                              seq=args.seq, seed=vars(args).get("eval_seed", 0), impl=args.impl, router=step_cfg.router,
                              dtype=args.dtype, device=device))
        last = {"step": step, **m}
        if rank0:
            append_row(os.path.join(args.out, "log.jsonl"), log_row(last))   # one write, no link followed
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
    bar.close()
    if write_record is not None:
        write_record()
    if args.export_hf:                                 # the weights, the router and the tokenizer
        from fmoe.train.export import export_hf

        export_hf(model, params, hf_cfg, args.export_hf, model_name=args.model, router=args.router,
                  tokenizer=tokenizer, step=max(start, last.get("step", start)), overwrite=args.overwrite)
    return last
