"""What the parallelism flags need of each other and of the model, checked before any rank
starts (called by :func:`fmoe.training.resolve.resolve`; ``error`` raises its
:class:`~fmoe.training.job.JobConfigError`): ``--sp`` needs ``--tp > 1`` dividing ``--seq``;
``--microbatches`` needs ``--pp > 1`` and divides ``--batch``; ``--pp`` divides the model's
decoder layers, never with ``--grad-accum`` (its micro-batches are the accumulation),
``--dp-batches``, tied embeddings or ``--optim-in-backward``; the in-backward update's own rules
(:func:`fmoe.training.optim_backward.check`), and without a clip no ``--skip-nonfinite`` (it
could skip a step only in part).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from ..models import get
from .job import check_value

__all__ = ["check_options", "check_stages", "stage_sizes"]


def stage_sizes(text: Optional[str]) -> Optional[list[int]]:
    """``--pp-layers 3,2`` as layer counts (None: equal stages); their sum and count are checked
    against the model by :func:`check_stages` (and the memory plan).

    Example:
        >>> stage_sizes("3,2")
        [3, 2]
    """
    if text is None:
        return None
    return [int(n) for n in check_value("pp_layers", text).split(",")]    # ASCII digits, each >= 1


def check_options(job: Any, error: Callable[[str], Any]) -> None:
    """``--sp``, ``--pp``, ``--microbatches``, ``--pp-schedule`` and ``--optim-in-backward`` against
    the other flags (the layer count is :func:`check_stages`'). A resume has already made a
    pipeline's ``--batch B --microbatches M`` and ``--batch B/M --grad-accum M`` one batch shape
    (:func:`fmoe.training.resume.batch_shape`)."""
    if job.optim_in_backward and not job.clip and job.skip_nonfinite:
        error(f"--optim-in-backward --clip 0 with --skip-nonfinite {job.skip_nonfinite}: without the clip's first "
              "pass a layer is updated before a later layer's gradient is known to be finite, so a bad step would be "
              "skipped only in part; give --clip X (the norm is known before any update) or --skip-nonfinite 0")
    if job.optim_in_backward:
        from .optim_backward import check

        try:
            check(job.grad_accum * job.dp_batches, job.clip or None, job.compile, job.pp)
        except ValueError as e:
            error(str(e))
    if job.sp and (job.tp == 1 or job.seq % job.tp):
        error("--sp (sequence parallelism) splits the sequence over the tensor-parallel ranks; it needs --tp > 1, "
               f"got --tp {job.tp}" + (f" (it must also divide --seq {job.seq})" if job.tp > 1 else ""))
    if job.cp > 1:
        from ..nn.context_parallel import check_sequence

        try:
            check_sequence(job.seq, job.cp, "--seq")
        except ValueError as e:
            error(f"--cp {job.cp}: {e}")
        if job.sp and (job.seq // job.cp) % job.tp:
            error(f"--cp {job.cp} --sp: each cp rank's --seq {job.seq} / {job.cp} tokens must split over --tp {job.tp}")
    if job.pp == 1:
        if job.pp_layers is not None:
            error(f"--pp-layers {job.pp_layers} sizes the stages of a pipeline; it needs --pp > 1")
        if job.microbatches is not None:
            error(f"--microbatches {job.microbatches} splits the batch of a pipeline; it needs --pp > 1 (without a "
                   "pipeline, --grad-accum N runs micro-batches; --microbatches default undoes a job file's value)")
        return
    given = job.microbatches is not None
    job.microbatches = job.microbatches if given else job.pp
    if job.grad_accum > 1:
        error(f"--grad-accum {job.grad_accum} with --pp {job.pp}: the pipeline's micro-batches are the "
               f"accumulation; give --microbatches M (each --batch split into M) instead")
    if job.dp_batches > 1:
        error("--dp-batches runs one process; it cannot be combined with --pp")
    if job.record_routing:
        error(f"--record-routing with --pp {job.pp}: each stage would record only its own layers' calls, which a "
              f"replay pairs with the wrong layers; record the same update with --grad-accum {job.microbatches} "
              "and no --pp")
    if job.batch % job.microbatches:
        error(f"--microbatches {job.microbatches}{'' if given else ' (the default: --pp)'} must divide --batch "
               f"{job.batch} (each micro-batch is "
               f"--batch / M rows); valid: {', '.join(str(d) for d in range(1, job.batch + 1) if job.batch % d == 0)}")


def check_stages(job: Any, error: Callable[[str], Any], found: Optional[tuple], model_cfg: Any = None) -> None:
    """``--pp`` divides the model's decoder layers into stages of equal depth (after the balancing
    methods are resolved: ``global_aux`` needs the whole step's routing before its forward); the
    model config is ``model_cfg``, else the checkpoint's, ``--init-hf``'s or the preset's."""
    if job.pp == 1:
        return
    from ..checkpoint.config_check import config_from_dict, read_config
    from .balancing import parse_methods

    if "global_aux" in parse_methods(job.balance or "none") and job.aux_weight:
        error(f"--balance {job.balance} with --pp {job.pp}: global_aux counts the whole step's routing in a forward "
              "before the step's own, which a pipeline's stages cannot run; use aux or seq_aux")

    model = get(job.model)
    try:
        if model_cfg is not None:
            cfg = model_cfg
        elif found is not None:
            cfg = config_from_dict(model, found[1].get("hf_config"), "meta.json", fits=True)
        elif job.init_hf:
            cfg = read_config(model, os.path.join(job.init_hf, "config.json"), fits=True)
        else:
            cfg = model.preset(job.preset, job.tp)
    except ValueError as e:
        error(str(e))
    layers = cfg.num_hidden_layers
    if job.pp_layers is not None:
        sizes = stage_sizes(job.pp_layers)
        if len(sizes) != job.pp or sum(sizes) != layers:
            error(f"--pp-layers {job.pp_layers!r} must be {job.pp} comma-separated layer counts >= 1 (one per --pp "
                  f"stage) summing to model {job.model}'s {layers} decoder layers")
    elif layers % job.pp:
        error(f"--pp {job.pp} must divide model {job.model}'s {layers} decoder layers (stages of equal depth), or "
              f"give --pp-layers; valid --pp: {', '.join(str(d) for d in range(1, layers + 1) if layers % d == 0)}")
    if cfg.tie_word_embeddings:
        error(f"--pp {job.pp}: model {job.model}'s config ties the output head to the embedding "
               "(tie_word_embeddings), which would live on the first and the last stage; pipeline parallelism "
               "needs untied embeddings")
