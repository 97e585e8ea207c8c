"""The main job's flags for data, precision, devices, memory and routing, in one place.

``python -m fmoe.train`` adds them with :func:`add_arguments`, checks them with :func:`check`
(usage errors before any process starts) and builds what they name with :func:`router_from_spec`,
:func:`resolve_device` and :func:`open_streams`.

``--router NAME[:k=v,...]`` names a built-in :mod:`fmoe.routing` scheme with keyword arguments
(values read as Python literals: ``sigmoid_topk:k=2,scale=2.5``), or ``module:function`` — your
own router ``function(logits) -> Routing`` in an importable module — optionally followed by
``:k=v,...`` to call ``function`` as a factory first.

Example:
    >>> r = router_from_spec("topk:k=2,normalize=False")
    >>> r(torch.tensor([[0.0, 1.0, 3.0]])).expert_ids.tolist()
    [[2, 1]]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
from typing import Any, Callable, Optional

import torch

__all__ = ["add_arguments", "check", "parse_router", "router_from_spec", "resolve_device", "open_streams"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Add the data / eval / precision / device / memory / routing flags to ``ap``."""
    g = ap.add_argument_group("data, evaluation, precision, devices, memory, routing")
    g.add_argument("--data", default=None, help="a .txt/.jsonl file, a directory of them, or a shard directory "
                   "from `python -m fmoe.data prepare` (default: the Python standard library, byte tokens)")
    g.add_argument("--tokenizer", default=None, help="'bytes' or a Hugging Face tokenizer.json (file or "
                   "directory); default: bytes, or the tokenizer of --init-hf DIR")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate on the held-out split every N steps (0: never)")
    g.add_argument("--eval-batches", type=int, default=4, help="held-out batches per data-parallel rank")
    g.add_argument("--eval-fraction", type=float, default=0.05, help="tail of the data held out for evaluation")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="compute dtype; bf16 keeps fp32 master weights, optimizer state and gradient reduction")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: one GPU per local rank over NCCL; auto: cuda when available")
    g.add_argument("--remat", choices=("none", "layer", "moe"), default="none",
                   help="recompute each layer / MoE block in backward instead of keeping activations")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (each --batch rows)")
    g.add_argument("--router", default=None, help="NAME[:k=v,...] of fmoe.routing, or module:function[:k=v,...]")
    g.add_argument("--memory-gb", type=float, default=None, help="warn when the memory plan exceeds this per rank")


def check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Usage errors (``ap.error``, exit code 2) for bad values of these flags."""
    for name in ("eval_every",):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("eval_batches", "grad_accum"):
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
    if args.tokenizer not in (None, "bytes"):
        from ..data import find_tokenizer_file
        if find_tokenizer_file(args.tokenizer) is None:
            ap.error(f"--tokenizer {args.tokenizer!r}: not 'bytes', a tokenizer.json, or a directory holding one")
    if args.router is not None:
        try:
            router_from_spec(args.router)
        except (ValueError, TypeError) as e:
            ap.error(str(e))


def parse_router(spec: str) -> tuple[str, Optional[str], dict]:
    """``(module or "fmoe.routing", function, kwargs)`` of a ``--router`` value.

    Example:
        >>> parse_router("sigmoid_topk:k=2")
        ('fmoe.routing', 'sigmoid_topk', {'k': 2})
        >>> parse_router("my.routers:noisy")
        ('my.routers', 'noisy', {})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--router: expected NAME[:k=v,...] or module:function, got {spec!r}")
    parts = spec.split(":")
    if len(parts) >= 2 and "=" not in parts[1] and parts[1]:
        module, name, rest = parts[0], parts[1], ":".join(parts[2:])
    else:
        module, name, rest = "fmoe.routing", parts[0], ":".join(parts[1:])
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"--router {spec!r}: {item!r} is not key=value")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value                      # a bare word: a string
    return module, name, kwargs


def router_from_spec(spec: str) -> Callable:
    """The router a ``--router`` value names (see the module docstring).

    Raises:
        ValueError: unknown scheme or module, or arguments the scheme does not take.
    """
    import fmoe.routing as routing

    module, name, kwargs = parse_router(spec)
    if module == "fmoe.routing":
        builtin = [n for n in routing.__all__ if n not in ("Routing", "Router", "validate", "call", "with_losses",
                                                           "update_bias", "group_mask", "token_hash", "capacity")]
        if name not in builtin:
            raise ValueError(f"--router {spec!r}: {name!r} is not a built-in scheme; choose from {builtin} "
                             "or give module:function")
        factory = getattr(routing, name)
    else:
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--router {spec!r}: cannot import {name!r} from {module!r} ({e})") from None
        if not callable(factory):
            raise ValueError(f"--router {spec!r}: {module}.{name} is not callable")
        if not kwargs:
            return factory                           # the user's router itself
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ValueError(f"--router {spec!r}: {e}") from None


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``cpu``, or this local rank's GPU for ``cuda`` (``auto``: cuda when available)."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
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
