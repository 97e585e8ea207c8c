"""What the job's data, precision, device, memory and routing settings build on each rank.

:func:`fmoe.training.resolve.check_options` checks these settings before anything starts; here
they become objects: the device (:func:`resolve_device`), the tokenizer
(:func:`resolve_tokenizer`), the token streams (:func:`open_streams`), the step's options
(:func:`step_options`, with the router of :func:`fmoe.routing.from_spec`), ``meta.json``'s
record (:func:`run_meta`) and the memory plan printed at start (:func:`print_memory_plan`).

``--router NAME[:k=v,...]`` names a built-in :mod:`fmoe.routing` scheme with keyword arguments
(values read as Python literals: ``sigmoid_topk:k=2,scale=2.5``), or ``module:function`` — your
own router ``function(logits) -> Routing`` in an importable module, or a factory returning one,
called with the ``:k=v,...`` that follow (:mod:`fmoe.routing.spec`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

__all__ = ["resolve_device", "open_streams", "check_data_length", "resolve_tokenizer", "shard_tokenizer", "fit_vocab", "run_meta",
           "step_options", "should_eval", "print_memory_plan"]


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


def open_streams(job: Any, tokenizer: Any):
    """``(train, held_out)`` token streams of ``--data`` (held-out: the last ``--eval-fraction``)."""
    from ..data import open_data

    return open_data(job.data, tokenizer).split(job.eval_fraction)


TEXT_BYTES_PER_TOKEN = 64     # text with fewer bytes than this many per token needed is tokenized to check it


def check_data_length(job: Any, error: Callable[[str], Any]) -> None:
    """``--data`` has a sequence for every data-parallel batch in its training split, and in its
    held-out split when the job evaluates (the stream's own rule,
    :meth:`fmoe.data.TokenStream.check_rows`), before any rank starts. A shard directory's header
    gives its length; text is tokenized here when it is small enough to be in doubt (fewer than
    ``TEXT_BYTES_PER_TOKEN`` bytes per token the split needs; tokenizing it costs little), else
    left to the ranks. ``job.world`` is known (the mesh checked); ``error`` raises."""
    from ..data import is_shard_dir, list_files
    from ..mesh import RankLayout

    if job.data is None:
        return
    layout = RankLayout(job.world, 0, tp=job.tp, ep=job.ep, dp_replicate=job.dp_replicate, pp=job.pp, cp=job.cp)
    batches = job.dp_batches if job.dp_batches > 1 else layout.num_sequences
    need = (job.seq + 2) * batches / (1.0 - job.eval_fraction)
    try:                                               # what cannot be read here, the ranks report
        if is_shard_dir(job.data):
            tokenizer = None                           # (the ranks check the shards' tokenizer)
        elif (job.init_hf and job.tokenizer is None or            # (its tokenizer: the model's vocabulary)
              sum(map(os.path.getsize, list_files(job.data))) >= TEXT_BYTES_PER_TOKEN * need):
            return
        else:
            tokenizer = resolve_tokenizer(job)
        train, held_out = open_streams(job, tokenizer)
    except (OSError, ValueError):
        return
    for stream, rows, what in ((train, batches, "training split"), (held_out, None, "held-out split")):
        try:
            if stream is train or job.eval_every:
                stream.check_rows(job.seq, rows)
        except ValueError as e:
            error(f"--data {job.data!r} is too short for --seq {job.seq}: its {what} ({e})")


def resolve_tokenizer(job: Any, vocab_size: Optional[int] = None):
    """The tokenizer of the job: ``--tokenizer``, else the one a shard ``--data`` directory
    records, else the one in ``--init-hf DIR``, else bytes.

    A Hugging Face checkpoint without a tokenizer trains on byte ids only with an explicit
    ``--tokenizer bytes`` (or when its vocabulary is exactly the 256 bytes): a real vocabulary
    fed byte ids would train silently on nonsense.

    Raises:
        ValueError: no usable tokenizer, or its ids do not fit ``vocab_size``.
    """
    from ..data import find_tokenizer_file, load_tokenizer

    if job.tokenizer is not None:
        tok = load_tokenizer(job.tokenizer)
    elif job.data is not None and shard_tokenizer(job.data) is not None:
        tok = shard_tokenizer(job.data)
    elif job.init_hf and find_tokenizer_file(job.init_hf):
        tok = load_tokenizer(job.init_hf)
    elif job.init_hf and vocab_size not in (None, 256):
        raise ValueError(f"--init-hf {job.init_hf!r} has no tokenizer.json and a vocabulary of {vocab_size} "
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


def run_meta(job: Any, tokenizer: Any, device: torch.device) -> dict:
    """What ``meta.json`` records about these flags for its readers (``fmoe generate``: the router
    spec as given, the tokenizer the run found and its digest); the settings themselves are in
    ``settings`` (:func:`fmoe.training.settings.record`)."""
    return {"router": job.router, "dtype": job.dtype, "master_dtype": job.master_dtype,
            "optim_dtype": job.optim_dtype, "remat": job.remat, "tokenizer": tokenizer.name,
            "tokenizer_digest": tokenizer.digest, "device": device.type}


def step_options(job: Any) -> dict:
    """Keyword arguments of :class:`fmoe.training.step.StepConfig` these flags set."""
    from ..routing.spec import from_spec

    return {"router": from_spec(job.router, "--router") if job.router else None, "dtype": job.dtype,
            "remat": job.remat, "pp_schedule": job.pp_schedule,     # --pp: the micro-batches are the accumulation
            "grad_accum": (job.microbatches if job.pp > 1 else job.grad_accum) * job.dp_batches,   # --dp-batches
            "round_seed": job.seed if job.master_dtype == "bf16" else None, "donate": True,
            "loss_chunks": job.loss_chunks, "compile": job.compile, "optim_in_backward": job.optim_in_backward}


def should_eval(job: Any, step: int) -> bool:
    """Evaluate after this step? (every ``--eval-every`` steps and after the last one)."""
    return bool(job.eval_every) and (step % job.eval_every == 0 or step == job.steps)


def print_memory_plan(job: Any, model: Any, cfg: Any, model_plan: Any, world: int) -> None:
    """Rank 0 prints the job's memory plan (:mod:`fmoe.memory.plan`) to stderr at start; with
    ``--quiet`` only its warning (a plan over ``--memory-gb``), which ``--quiet`` never hides."""
    import sys

    from ..memory.plan import format_plan, memory_plan
    from .parallel import stage_sizes

    if job.quiet and job.memory_gb is None:
        return
    plan = memory_plan(model, cfg, nproc=world, tp=job.tp, ep=job.ep, dp_replicate=job.dp_replicate,
                       batch=job.batch, seq=job.seq, dtype=job.dtype, remat=job.remat,
                       grad_accum=job.grad_accum, model_plan=model_plan, master_dtype=job.master_dtype,
                       optim_dtype=job.optim_dtype, loss_chunks=job.loss_chunks,
                       optim_in_backward=job.optim_in_backward, clip=job.clip, sp=job.sp, pp=job.pp,
                       microbatches=job.microbatches, pp_schedule=job.pp_schedule,
                       pp_layers=stage_sizes(job.pp_layers))
    text = format_plan(plan, job.memory_gb)
    if job.quiet:
        text = "\n".join(line for line in text.splitlines() if line.startswith("WARNING"))
    if text:
        print(text, file=sys.stderr)
