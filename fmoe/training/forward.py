"""The forward half of a training step: the weights a step computes with, the model's forward
with its aux, the loss, and the mean of a value over the ranks.

:func:`compute_params` casts the fp32 master weights to the compute dtype once per step (bf16:
every floating leaf but router state, on its local shard, before any gather);
:func:`forward_with_aux` calls a model through its declared interface (logits and
``{"moe": [per-layer aux]}``); :func:`forward_loss` adds the mean next-token cross-entropy
(the part of a step ``StepConfig(compile=True)`` compiles whole on one process). On a pipeline
stage (:mod:`fmoe.training.pipeline`) both take the previous stage's output as ``hidden``, and
a stage before the last returns its output instead of a loss. :func:`world_mean` averages a
metric over the ranks that hold it (one stage's ranks with ``pp > 1``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..collectives import sum_over_world
from ..fsdp import cast_shards
from ..mesh import RankLayout
from ..model import model_of
from ..nn import ContextParallel, cross_entropy
from ..nn.chunked_loss import chunked_cross_entropy
from ..precision import DTYPES, dtype_of, upcast
from ..routing.state import is_state
from .. import tree as _tree

__all__ = ["autocast", "compute_params", "forward_with_aux", "forward_loss", "world_mean"]

def autocast(dtype: str, device: torch.device):
    """``torch.autocast`` to ``dtype`` on ``device``'s type, or a no-op for fp32 (evaluation on
    fp32 weights; the train step casts its weights once instead, :func:`compute_params`)."""
    if dtype_of(dtype) == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[dtype])


def compute_params(params: Any, dtype: str) -> Any:
    """The weights a step computes with: ``params`` itself for fp32, else every floating leaf
    cast to ``dtype`` on its local shard (:func:`fmoe.fsdp.cast_shards`; differentiable, gradients
    arrive in fp32) but router state (:func:`fmoe.routing.state.is_state`: ``expert_bias``,
    ReMoE's ``l1_coef``, ...), which the router reads in its master dtype."""
    target = dtype_of(dtype)
    if target == torch.float32:
        return params
    return cast_shards(params, target, skip=[p for p in _tree.paths(params) if is_state(p)])


def forward_with_aux(model: Any, params: Any, tokens: torch.Tensor, cfg: Any, mesh: Optional[RankLayout],
                     impl: str = "auto", router: Optional[Any] = None,
                     hidden: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """Logits (a pipeline stage before the last: its output) and the model's aux
    (``{"moe": [per-layer dicts]}``; empty for dense models). ``hidden``: a pipeline stage's
    input (the model's ``forward(..., hidden=)``)."""
    declared = model_of(model)          # a routed model's forward takes impl, router, return_aux
    stage = {} if hidden is None else {"hidden": hidden}
    if not declared.routed:
        if router is not None:
            raise ValueError(f"StepConfig.router: model {declared.name} has no router to replace")
        return declared.forward(params, tokens, cfg, mesh, **stage), {}
    kwargs = {} if router is None else {"router": router}
    return declared.forward(params, tokens, cfg, mesh, impl=impl, return_aux=True, **kwargs, **stage)


def forward_loss(model: Any, params: Any, tokens: torch.Tensor, targets: Optional[torch.Tensor], cfg: Any,
                 mesh: Optional[RankLayout], step_cfg: Any,
                 hidden: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """The mean next-token cross-entropy of ``tokens`` against ``targets`` and the model's aux
    (``step_cfg``: a :class:`fmoe.training.step.StepConfig`); ``targets=None`` (a pipeline stage
    before the last): the stage's output instead of the loss."""
    out, aux = forward_with_aux(model, params, tokens, cfg, mesh, step_cfg.impl, step_cfg.router, hidden)
    if targets is None:
        return out, aux
    if mesh is not None and mesh.cp > 1:            # the logits are this rank's chunks (fmoe.nn.context_parallel)
        targets = ContextParallel(None, mesh.cp, mesh.rank_in("cp")).shard(targets, dim=1)
    loss = (cross_entropy(upcast(out), targets) if step_cfg.loss_chunks == 1      # see fmoe.nn.chunked_loss
            else chunked_cross_entropy(out, targets, step_cfg.loss_chunks))
    return loss, aux


def world_mean(x: torch.Tensor, mesh: Optional[RankLayout] = None) -> torch.Tensor:
    """``x`` (detached, at least fp32) averaged over the ranks of one pipeline stage: over every
    rank without pipeline parallelism; with ``mesh.pp > 1`` the ranks of the stage that holds the
    value give it and every other rank gives zeros. Collective over the default group; the
    result is equal on every rank.

    Example:
        >>> world_mean(torch.tensor(2.0))
        tensor(2.)
    """
    x = upcast(x.detach().clone())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = sum_over_world(x) / (dist.get_world_size() if mesh is None else mesh.stage_world)
    return x
