"""The main job: ``python -m fmoe.train --model qwen3_moe --preset tiny --nproc 4 --ep 4``.

Without a launcher it spawns ``--nproc`` local gloo ranks itself; under ``torchrun`` (``RANK``
and ``WORLD_SIZE`` set) it joins the launcher's process group instead. Each step trains on the
built-in corpus (the Python standard library's source, byte tokens), rank 0 shows a progress
bar and appends one JSON line per step to ``OUT/log.jsonl``; checkpoints go to
``OUT/step-N`` every ``--save-every`` steps and at the end. ``--resume`` continues from a
checkpoint (same mesh: bitwise; another mesh: resharded), ``--init-hf`` starts from a Hugging
Face checkpoint, ``--export-hf`` writes one at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from dataclasses import asdict, is_dataclass
from typing import Optional, Sequence

MODELS = ("qwen3_moe", "mixtral", "gpt_oss", "llama")

__all__ = ["parse_args", "main", "run"]


def _positive(name: str):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 1, got {s!r}")
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 1, got {v}")
        return v
    return conv


def _nonneg(name: str):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 0, got {s!r}")
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= 0, got {v}")
        return v
    return conv


def _positive_float(name: str):
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number > 0, got {s!r}")
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{name} must be a number > 0, got {v}")
        return v
    return conv


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fmoe.train", description="Train an fmoe model on local gloo ranks.")
    ap.add_argument("--model", choices=MODELS, default="qwen3_moe")
    ap.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--nproc", type=_positive("--nproc"), default=1, help="local ranks to spawn (ignored under torchrun)")
    ap.add_argument("--tp", type=_positive("--tp"), default=1)
    ap.add_argument("--ep", type=_positive("--ep"), default=None, help="default: tp")
    ap.add_argument("--dp-replicate", type=_positive("--dp-replicate"), default=1)
    ap.add_argument("--steps", type=_positive("--steps"), default=20)
    ap.add_argument("--batch", type=_positive("--batch"), default=4, help="sequences per data-parallel batch")
    ap.add_argument("--seq", type=_positive("--seq"), default=64)
    ap.add_argument("--lr", type=_positive_float("--lr"), default=3e-3)
    ap.add_argument("--warmup", type=_nonneg("--warmup"), default=5)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=_positive_float("--clip"), default=1.0)
    ap.add_argument("--aux-weight", type=float, default=0.01,
                    help="coefficient of the per-layer load-balance loss of MoE models (0: off)")
    ap.add_argument("--impl", default="auto", help="MoE dispatch implementation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/fmoe")
    ap.add_argument("--save-every", type=_nonneg("--save-every"), default=0, help="0: only at the end")
    ap.add_argument("--resume", default=None, help="a step-N checkpoint or an OUT dir (its latest)")
    ap.add_argument("--init-hf", default=None, help="start from a Hugging Face checkpoint dir")
    ap.add_argument("--export-hf", default=None, help="write a Hugging Face checkpoint at the end")
    ap.add_argument("--timeout", type=_positive_float("--timeout"), default=1800.0, help="collective timeout, s")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate flags; a bad value exits with a usage error (exit code 2)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ and "RANK" in os.environ else args.nproc
    ep = args.tp if args.ep is None else args.ep
    dense = world // args.tp if world % args.tp == 0 else None
    if world % (args.tp * args.dp_replicate):
        ap.error(f"--nproc {world} must be divisible by --tp * --dp-replicate = {args.tp * args.dp_replicate}")
    if ep % args.tp:
        ap.error(f"--ep {ep} must be a multiple of --tp {args.tp}")
    if dense is not None and (world // args.dp_replicate) % ep:
        ap.error(f"--ep {ep} must divide fsdp * tp = {world // args.dp_replicate}")
    if args.resume and not os.path.exists(args.resume):
        ap.error(f"--resume {args.resume!r} does not exist")
    if args.init_hf and not os.path.isdir(args.init_hf):
        ap.error(f"--init-hf {args.init_hf!r} is not a directory")
    if args.aux_weight < 0:
        ap.error(f"--aux-weight must be >= 0, got {args.aux_weight}")
    if args.impl != "auto":
        import fmoe.ep
        if args.impl not in fmoe.ep.registered():
            ap.error(f"--impl {args.impl!r} is not a registered MoE implementation; choose from "
                     f"{['auto'] + fmoe.ep.registered()}")
    if args.resume and args.init_hf:
        ap.error("--resume and --init-hf are exclusive")
    args.ep = ep
    return args


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


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    """Train on this rank (process group already initialised when ``world > 1``)."""

    import fmoe
    from fmoe.train import ckpt
    from fmoe.train.data import Corpus
    from fmoe.fsdp import data_parallel_plan
    from fmoe.train.optim import AdamWConfig, adamw_init, lr_at
    from fmoe.train.step import StepConfig, train_step

    model = importlib.import_module(f"fmoe.models.{args.model}")
    mesh = fmoe.Mesh(tp=args.tp, ep=args.ep, dp_replicate=args.dp_replicate)
    if args.init_hf:
        full, cfg = model.load_hf(args.init_hf)
    else:
        cfg = _preset(model, args.preset, args.tp)
        full = model.init(cfg, seed=args.seed)
    if cfg.vocab_size < 256:
        raise ValueError(f"--init-hf {args.init_hf!r}: vocab_size {cfg.vocab_size} < 256; the built-in "
                         "corpus is byte-level and needs token ids 0..255")
    if hasattr(cfg, "output_router_logits"):
        cfg = dataclasses.replace(cfg, output_router_logits=args.aux_weight > 0,
                                  router_aux_loss_coef=args.aux_weight)
    model_plan = model.check_plan(cfg, None, mesh.tp) if hasattr(model, "check_plan") else model.plan(cfg)
    plan = data_parallel_plan(model_plan, full, mesh)
    packed = ckpt.packed_layout(plan, full)
    params = fmoe.shard(fmoe.tree.map_with_path(lambda _, t: t.detach().requires_grad_(True), full), plan, mesh)
    del full
    opt_state = adamw_init(params)
    start = 0
    if args.resume:
        path = ckpt.latest(args.resume)
        if path is None:
            raise ValueError(f"--resume {args.resume!r}: no complete step-N checkpoint there")
        meta = ckpt.load(path, params, opt_state, packed)
        start = meta["step"]
    step_cfg = StepConfig(opt=AdamWConfig(weight_decay=args.weight_decay, max_grad_norm=args.clip),
                          impl=args.impl)
    corpus = Corpus.stdlib()
    rank0 = rank == 0
    if rank0:
        os.makedirs(args.out, exist_ok=True)
    meta = {"model": args.model, "config": _config_dict(cfg), "seed": args.seed, "batch": args.batch,
            "seq": args.seq, "mesh": {"tp": mesh.tp, "ep": mesh.ep, "fsdp": mesh.fsdp,
                                      "dp_replicate": mesh.dp_replicate, "world": mesh.world}}
    bar = _Progress(args.steps, rank0 and not args.quiet)
    last: dict = {}
    for step in range(start + 1, args.steps + 1):
        batch = corpus.batch(step, mesh.batch_index, args.batch, args.seq, args.seed)
        lr = lr_at(step, args.lr, args.warmup, args.steps)
        params, opt_state, m = train_step(model, cfg, params, opt_state, batch, mesh=mesh, step_cfg=step_cfg, lr=lr)
        last = {"step": step, **m}
        if rank0:
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps(last) + "\n")
        bar.update(step, m)
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            ckpt.save(args.out, step, params, opt_state, meta, packed)
    if args.export_hf:
        model.save_hf(params, cfg, args.export_hf)
    return last


def _spawned(rank: int, world: int, args: argparse.Namespace) -> dict:
    return run(rank, world, args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m fmoe.train``; returns the exit code."""
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "FMOE_SPAWNED" not in os.environ:
        import datetime

        import torch.distributed as dist

        world = int(os.environ["WORLD_SIZE"])
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        last = run(int(os.environ["RANK"]), world, args)
        if int(os.environ["RANK"]) != 0:                 # one summary per job
            return 0
    elif args.nproc == 1:
        last = run(0, 1, args)
    else:
        from fmoe.testing import spawn

        os.environ["FMOE_SPAWNED"] = "1"
        try:
            last = spawn(_spawned, args.nproc, args, timeout=args.timeout * max(1, args.steps),
                         collective_timeout=args.timeout)[0]
        except Exception as e:  # noqa: BLE001 - report the failing rank's error, exit non-zero
            print(f"fmoe.train: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print(json.dumps({"final": last}))
    return 0
