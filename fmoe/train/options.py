"""The main job's flags for data, precision, devices, memory and routing, in one place.

``python -m fmoe.train`` adds them with :func:`add_arguments`, checks them with :func:`check`
(usage errors before any process starts) and builds what they name with
:func:`fmoe.routing.from_spec` (``--router``), :func:`resolve_device` and :func:`open_streams`.

``--router NAME[:k=v,...]`` names a built-in :mod:`fmoe.routing` scheme with keyword arguments
(values read as Python literals: ``sigmoid_topk:k=2,scale=2.5``), or ``module:function`` — your
own router ``function(logits) -> Routing`` in an importable module, or a factory returning one,
called with the ``:k=v,...`` that follow (:mod:`fmoe.routing.spec`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional

import torch

__all__ = ["add_arguments", "check", "resolve_device", "open_streams"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Add the data / eval / precision / device / memory / routing flags to ``ap``."""
    g = ap.add_argument_group("data, evaluation, precision, devices, memory, routing")
    g.add_argument("--data", default=None, help="a .txt/.jsonl file, a directory of them, or a shard directory "
                   "from `python -m fmoe.data prepare` (default: the Python standard library's source, byte tokens)")
    g.add_argument("--tokenizer", default=None, help="'bytes' or a Hugging Face tokenizer.json (file or "
                   "directory) (default: bytes, or the tokenizer.json in --init-hf DIR)")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate on the held-out split every N steps (0: never)")
    g.add_argument("--eval-batches", type=int, default=4, help="held-out batches per data-parallel rank")
    g.add_argument("--eval-fraction", type=float, default=0.05, help="tail of the data held out for evaluation")
    g.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out batches, apart from --seed so "
                   "runs of different seeds evaluate on the same tokens (default: 0)")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="compute dtype (autocast); the weights and moments keep --master-dtype / --optim-dtype")
    g.add_argument("--master-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the weights the optimizer updates (and their gradients and checkpoints); "
                   "bf16 updates with stochastic rounding (fmoe.precision)")
    g.add_argument("--optim-dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of AdamW's two moments")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: one GPU per local rank over NCCL; auto: cuda when available")
    g.add_argument("--remat", choices=("none", "layer", "moe"), default="none",
                   help="recompute each layer / MoE block in backward instead of keeping activations")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (each --batch rows)")
    g.add_argument("--loss-chunks", type=int, default=1, help="compute the loss by N chunks of tokens, each "
                   "recomputed in backward (no whole fp32 [tokens, vocab] log-softmax; fmoe.nn.chunked_loss)")
    g.add_argument("--router", default=None, help="NAME[:k=v,...] of fmoe.routing, or module:function[:k=v,...] "
                   "(default: the model's own router)")
    g.add_argument("--memory-gb", type=float, default=None, help="warn when the memory plan exceeds this per rank (default: no limit)")


def check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Usage errors (``ap.error``, exit code 2) for bad values of these flags."""
    for name in ("eval_every", "eval_seed"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("eval_batches", "grad_accum", "loss_chunks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.eval_fraction < 1.0:
        ap.error(f"--eval-fraction must be in (0, 1), got {args.eval_fraction}")
    if args.memory_gb is not None and not args.memory_gb > 0:
        ap.error(f"--memory-gb must be > 0, got {args.memory_gb}")
    if args.data is not None and not os.path.exists(args.data):
        ap.error(f"--data {args.data!r} does not exist")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if args.device == "cuda" and args.nproc > 1 and "RANK" not in os.environ:
        ap.error(f"--device cuda --nproc {args.nproc}: launch several GPUs with torchrun --nproc-per-node "
                 f"{args.nproc} (one GPU per rank over NCCL); --nproc spawns local gloo ranks")
    if args.tokenizer not in (None, "bytes"):
        from ..data import find_tokenizer_file
        if find_tokenizer_file(args.tokenizer) is None:
            ap.error(f"--tokenizer {args.tokenizer!r}: not 'bytes', a tokenizer.json, or a directory holding one")
    from ..models import get

    blocks = ("none",) + get(args.model).remat_blocks      # declared on the model's Model
    if args.remat not in blocks:
        ap.error(f"--remat {args.remat}: model {args.model} has no such block to recompute; it supports "
                 f"--remat {' / '.join(blocks)}")
    if args.router is not None:
        from ..routing.spec import from_spec

        try:
            from_spec(args.router, "--router")
        except (ValueError, TypeError) as e:
            ap.error(str(e))


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``cpu``, or this local rank's GPU for ``cuda`` (``auto``: cuda when available, except in
    ranks the job spawned itself, which talk gloo: use ``torchrun`` for several GPUs)."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    spawned = "FMOE_SPAWNED" in os.environ
    if name == "cpu" or (name == "auto" and (spawned or not torch.cuda.is_available())):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device cuda: no CUDA device is available")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def open_streams(args: argparse.Namespace, tokenizer: Any):
    """``(train, held_out)`` token streams of ``--data`` (held-out: the last ``--eval-fraction``)."""
    from ..data import open_data

    return open_data(args.data, tokenizer).split(args.eval_fraction)


def resolve_tokenizer(args: argparse.Namespace, vocab_size: Optional[int] = None):
    """The tokenizer of the job: ``--tokenizer``, else the one a shard ``--data`` directory
    records, else the one in ``--init-hf DIR``, else bytes.

    A Hugging Face checkpoint without a tokenizer trains on byte ids only with an explicit
    ``--tokenizer bytes`` (or when its vocabulary is exactly the 256 bytes): a real vocabulary
    fed byte ids would train silently on nonsense.

    Raises:
        ValueError: no usable tokenizer, or its ids do not fit ``vocab_size``.
    """
    from ..data import find_tokenizer_file, load_tokenizer

    if args.tokenizer is not None:
        tok = load_tokenizer(args.tokenizer)
    elif args.data is not None and shard_tokenizer(args.data) is not None:
        tok = shard_tokenizer(args.data)
    elif getattr(args, "init_hf", None) and find_tokenizer_file(args.init_hf):
        tok = load_tokenizer(args.init_hf)
    elif getattr(args, "init_hf", None) and vocab_size not in (None, 256):
        raise ValueError(f"--init-hf {args.init_hf!r} has no tokenizer.json and a vocabulary of {vocab_size} "
                         "tokens; pass --tokenizer T (its tokenizer.json), or --tokenizer bytes to train it on "
                         "byte ids anyway")
    else:
        tok = load_tokenizer("bytes")
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"--tokenizer {tok.name!r} has {tok.vocab_size} ids but the model's vocab_size is {vocab_size}")
    return tok


def shard_tokenizer(data: str) -> Any:
    """The tokenizer a shard directory's header records (None for other ``--data``).

    Raises:
        ValueError: the recorded tokenizer file is gone or is not the one that made the shards.
    """
    from ..data import is_shard_dir, load_tokenizer, read_header

    if not os.path.isdir(data) or not is_shard_dir(data):
        return None
    header = read_header(data)
    name = header.get("tokenizer") or "bytes"
    if name != "bytes" and not os.path.isfile(name):
        raise ValueError(f"data {data!r}: the shards were tokenized with {name!r}, which is not there any more; "
                         "pass --tokenizer T (that tokenizer.json)")
    tok = load_tokenizer(name)
    digest = header.get("tokenizer_digest")
    if digest is not None and tok.digest != digest:
        raise ValueError(f"data {data!r}: {name!r} changed since it tokenized the shards ({tok.digest}, "
                         f"header says {digest}); pass --tokenizer T (the tokenizer that made them)")
    return tok


def fit_vocab(cfg: Any, tokenizer: Any, tp: int) -> Any:
    """A preset config whose vocabulary holds the tokenizer's ids, rounded up to a multiple of
    ``lcm(64, tp)`` (vocab-parallel embedding); unchanged for byte tokens."""
    import dataclasses
    import math

    if tokenizer.vocab_size <= 256:
        return cfg
    step = math.lcm(64, tp)
    return dataclasses.replace(cfg, vocab_size=-(-tokenizer.vocab_size // step) * step)


def run_meta(args: argparse.Namespace, tokenizer: Any, device: torch.device) -> dict:
    """What ``meta.json`` records about these flags (the router spec as given)."""
    return {"router": args.router, "dtype": args.dtype, "master_dtype": args.master_dtype,
            "optim_dtype": args.optim_dtype, "remat": args.remat, "grad_accum": args.grad_accum,
            "data": args.data, "tokenizer_flag": args.tokenizer, "tokenizer": tokenizer.name,
            "tokenizer_digest": tokenizer.digest,
            "device": device.type, "eval_fraction": args.eval_fraction, "eval_seed": vars(args).get("eval_seed", 0)}


def step_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of :class:`fmoe.training.step.StepConfig` these flags set."""
    from ..routing.spec import from_spec

    return {"router": from_spec(args.router, "--router") if args.router else None, "dtype": args.dtype,
            "remat": args.remat, "grad_accum": args.grad_accum,
            "round_seed": args.seed if args.master_dtype == "bf16" else None, "donate": True,
            "loss_chunks": args.loss_chunks}


def should_eval(args: argparse.Namespace, step: int) -> bool:
    """Evaluate after this step? (every ``--eval-every`` steps and after the last one)."""
    return bool(args.eval_every) and (step % args.eval_every == 0 or step == args.steps)


def print_memory_plan(args: argparse.Namespace, model: Any, cfg: Any, model_plan: Any, world: int) -> None:
    """Rank 0 prints the job's memory plan (:mod:`fmoe.memory.plan`) to stderr at start; with
    ``--quiet`` only its warning (a plan over ``--memory-gb``), which ``--quiet`` never hides."""
    import sys

    from ..memory.plan import format_plan, memory_plan

    if args.quiet and args.memory_gb is None:
        return
    plan = memory_plan(model, cfg, nproc=world, tp=args.tp, ep=args.ep, dp_replicate=args.dp_replicate,
                       batch=args.batch, seq=args.seq, dtype=args.dtype, remat=args.remat,
                       grad_accum=args.grad_accum, model_plan=model_plan, master_dtype=args.master_dtype,
                       optim_dtype=args.optim_dtype, loss_chunks=args.loss_chunks)
    text = format_plan(plan, args.memory_gb)
    if args.quiet:
        text = "\n".join(line for line in text.splitlines() if line.startswith("WARNING"))
    if text:
        print(text, file=sys.stderr)
