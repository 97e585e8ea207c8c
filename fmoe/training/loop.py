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

import json
import math
import os
import sys
from dataclasses import asdict, is_dataclass
from typing import Any

from .. import model as kit
from ..precision import dtype_of
from ..routing.state import is_state
from . import balancing, options, router_state
from . import observe, settings
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


def _job_meta(job: Any, model, cfg, mesh) -> dict:
    """What ``meta.json`` records about the model, its mesh and schedule (a resume continues the
    job its ``settings`` record: :mod:`fmoe.training.settings`, :mod:`fmoe.training.resume`)."""
    from . import resume

    return {"model": job.model, "preset": None if job.init_hf else job.preset, "init_hf": job.init_hf,
            "config": _config_dict(cfg), "hf_config": cfg.to_hf(), "aux_weight": job.aux_weight,
            "param_dtype": str(dtype_of(job.master_dtype))[6:],
            "schedule": resume.schedule_record(job),
            "mesh": {"tp": mesh.tp, "ep": mesh.ep, "fsdp": mesh.fsdp, "dp_replicate": mesh.dp_replicate,
                     "world": mesh.world, "num_batches": mesh.num_batches, "pp": mesh.pp, "cp": mesh.cp,
                     "num_sequences": mesh.num_sequences}}


def run(rank: int, world: int, job: Any) -> dict:
    """Train on this rank (process group already initialised when ``world > 1``)."""
    import threading

    import torch
    from tqdm import tqdm

    # tqdm's default lock holds a multiprocessing semaphore: a rank killed while stopping a job
    # would leave it for the resource tracker to report as leaked. One thread lock per rank.
    tqdm.set_lock(threading.RLock())

    import fmoe
    from fmoe.models import get
    from fmoe.checkpoint import training as ckpt
    from fmoe.checkpoint.retention import prune
    from fmoe.training.evaluate import evaluate
    from fmoe.optim import AdamWConfig, lr_at
    from fmoe.optim.adamw import init as adamw_init
    from .outdir import append_row, check_room
    from fmoe.training.step import StepConfig, train_step
    from fmoe.training.parallel import stage_sizes
    from fmoe.training.pipeline import stage_plan, stage_tree

    torch.set_num_threads(threads_of(job))            # --threads (fmoe.training.threads)
    model = job.declared                              # the declared Model, resolved before the ranks started
    mesh = fmoe.Mesh(tp=job.tp, ep=job.ep, dp_replicate=job.dp_replicate, pp=job.pp, sp=job.sp, cp=job.cp)
    device = options.resolve_device(job.device, int(os.environ.get("LOCAL_RANK", rank)))
    if job.resume_path:                               # the config the checkpoint was trained with (its
        cfg = model.Config.from_hf(job.resume_meta["hf_config"])     # --init-hf run's too: the weights are its)
        tokenizer = options.resolve_tokenizer(job, cfg.vocab_size)
        full = model.init(cfg, seed=job.seed)
    elif job.init_hf and job.upcycle:    # a dense llama checkpoint, MLPs copied into experts
        from fmoe.training.upcycle import parse_upcycle, upcycle
        dense, dense_cfg = get("llama").load_hf(job.init_hf, dtype=torch.float32)
        full, cfg = upcycle(dense, dense_cfg, model.Config, *parse_upcycle(job.upcycle), seed=job.seed)
        tokenizer = options.resolve_tokenizer(job, cfg.vocab_size)
    elif job.init_hf:                                 # fp32 master weights whatever the file holds
        full, cfg = model.load_hf(job.init_hf, dtype=torch.float32)
        tokenizer = options.resolve_tokenizer(job, cfg.vocab_size)
    else:
        tokenizer = options.resolve_tokenizer(job)
        cfg = options.fit_vocab(model.preset(job.preset, job.tp), tokenizer, job.tp)
        full = model.init(cfg, seed=job.seed)
    train_data, held_out = options.open_streams(job, tokenizer)
    if cfg.vocab_size < max(256, train_data.vocab_size or 0):
        raise ValueError(f"model vocab_size {cfg.vocab_size} cannot hold the data's token ids "
                         f"(vocabulary {train_data.vocab_size} of {train_data.name})")
    full = fmoe.tree.map_with_path(lambda _, t: t.to(device, dtype_of(job.master_dtype)), full)  # trained dtype
    # the trainer's router carries the balance losses (fmoe.training.balancing); the exported config
    # records the Switch loss weight as transformers reads it
    hf_cfg = model.with_aux_loss(cfg, job.aux_weight if job.balance == "aux" else 0.0)
    cfg = model.with_aux_loss(cfg, 0.0)                # declared switch, no probing
    full = balancing.with_expert_bias(full, job)      # --balance bias on any MoE model
    full = router_state.with_states(full, balancing.run_router(job))   # a stateful router's entries (ReMoE)
    model_plan = model.build_plan(cfg, mesh=mesh)      # default plan, model checks
    plan = model.build_plan(cfg, model_plan, mesh, full, data_parallel=True)
    stages = (mesh.stage, mesh.pp, stage_sizes(job.pp_layers))   # --pp
    plan, full = stage_plan(plan, full, *stages), stage_tree(full, *stages)
    packed = ckpt.packed_layout(plan, full)
    need = 3 * sum(t.numel() * t.element_size() for t in fmoe.tree.leaves(full))   # params + 2 moments
    if mesh.pp > 1:                                    # this stage's share: the checkpoint holds every stage's
        from ..collectives import all_gather_objects

        need = sum(all_gather_objects(need)) * mesh.pp // world
    ckpt.on_rank0(lambda: check_room(job.out, need), f"checking --out {job.out}")
    params = fmoe.shard(fmoe.tree.map_with_path(
        lambda p, t: t.detach().requires_grad_(not is_state(p)), full), plan, mesh)     # router state: no gradient
    del full
    opt_state = adamw_init(params, dtype=dtype_of(job.optim_dtype))
    start = 0
    if job.resume_path:                               # a new router's state the checkpoint lacks: its init
        fresh, notes = router_state.on_resume(job.resume_path, job.resume_meta["settings"].get("router"), job.router,
                                              ckpt.saved_paths(job.resume_path), fmoe.tree.paths(params))
        for note in notes if rank == 0 else ():
            print(f"fmoe train: note: {note}", file=sys.stderr)
        start = ckpt.load(job.resume_path, params, opt_state, packed, progress=rank == 0 and not job.quiet,
                          fresh=fresh)["step"]
    step_cfg = job.step_config or StepConfig(   # fmoe.training.run(cfg, step_config=...) replaces it
        opt=AdamWConfig(weight_decay=job.weight_decay, max_grad_norm=job.clip or None),
        impl=job.impl, **balancing.step_options(job, cfg, options.step_options(job), model))
    step_cfg, write_record = balancing.with_recording(job, step_cfg, rank)     # --record-routing
    rank0 = rank == 0
    if rank0:                                          # --quiet keeps only its warning
        options.print_memory_plan(job, model, cfg, model_plan, world)
        long = kit.positions_warning(cfg, job.seq, f"--seq {job.seq}")       # not hidden by --quiet either
        if long:
            print(f"fmoe train: warning: {long}", file=sys.stderr)
    meta = {**_job_meta(job, model, hf_cfg, mesh), **options.run_meta(job, tokenizer, device),
            **balancing.record(job), "upcycle": job.upcycle, **settings.record(job)}
    bar = _Progress(job.steps, start, rank0 and not job.quiet)
    watch = observe.Observer(job.out, rank, job.profile_steps, job.tensorboard, device, start)   # per-rank time, bytes
    last: dict = {}
    skipped = 0
    for step in range(start + 1, job.steps + 1):
        batch = (train_data.union(step, job.batch * job.grad_accum, job.seq, job.seed, job.dp_batches)
                 if job.dp_batches > 1 else         # one process, the batches of N ranks
                 train_data.batch(step, mesh.sequence_index, job.batch * job.grad_accum, job.seq, job.seed,
                                  num_batches=mesh.num_sequences))
        lr = lr_at(step, job.lr, job.warmup, job.schedule_total)
        with watch.step(step):
            params, opt_state, m = train_step(model, cfg, params, opt_state, tuple(t.to(device) for t in batch),
                                              mesh=mesh, step_cfg=step_cfg, lr=lr)
        if options.should_eval(job, step):
            rows = job.batch // (job.microbatches if job.pp > 1 else 1)     # --pp: as its --grad-accum twin
            m.update(evaluate(model, cfg, params, held_out, mesh=mesh, batches=job.eval_batches, batch=rows,
                              seq=job.seq, seed=job.eval_seed, impl=job.impl, router=step_cfg.router,
                              dtype=job.dtype, device=device, dp_batches=job.dp_batches))
        last = {"step": step, **m, **watch.rank_lists()}
        if rank0:
            append_row(os.path.join(job.out, "log.jsonl"), log_row(last))   # one write, no link followed
            watch.write(last)
        if m.get("skipped"):
            skipped += 1
            if skipped > job.skip_nonfinite:
                good = ckpt.latest(job.out)
                what = "loss" if not math.isfinite(m["loss"]) else "gradient norm"
                raise NonFiniteStep(
                    f"step {step}: non-finite {what} (loss {m['loss']}, gradient norm {m['grad_norm']}); the "
                    f"update was not applied and nothing was saved (last good checkpoint: {good or 'none'}). "
                    f"Try a lower --lr, or --skip-nonfinite N to skip up to N such steps")
        else:
            bar.update(step, m)
        if (job.save_every and step % job.save_every == 0) or step == job.steps:
            ckpt.save(job.out, step, params, opt_state, meta, packed, progress=rank0 and not job.quiet)
            if job.keep_last:                          # --keep-last N (fmoe.checkpoint.retention)
                ckpt.on_rank0(lambda: prune(job.out, job.keep_last, keep=[job.resume_path] if job.resume_path else []),
                              f"removing old checkpoints of --out {job.out}")
    bar.close()
    watch.close()
    if write_record is not None:
        write_record()
    if job.export_hf:                                 # the weights, the router and the tokenizer
        from .export import export_hf

        export_hf(model, params, hf_cfg, job.export_hf, model_name=job.model, router=job.router,
                  tokenizer=tokenizer, step=max(start, last.get("step", start)), overwrite=job.overwrite,
                  progress=rank0 and not job.quiet, mesh=mesh)
    return last
