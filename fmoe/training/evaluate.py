"""Held-out evaluation: mean next-token loss and perplexity over fixed batches.

Every evaluation reads the same ``batches`` batches of the held-out stream (batch ``i`` is
``stream.batch(step=i + 1, ..., seed=eval_seed)``), so ``eval_loss`` is comparable across steps
and runs. The held-out batches have their own seed (``--eval-seed``, default
:data:`EVAL_SEED`), not the training seed: runs of different ``--seed`` evaluate on the same
tokens. Nor do they depend on the mesh: evaluation batch ``i`` is one draw of
``batch * num_batches`` rows (the global batch), of which each data-parallel batch takes its
``tensor_split`` share, so one process with ``--batch 4`` and two ranks with ``--batch 2``
evaluate the same tokens. The result is the mean over all of them, equal on every rank, and
equal to one process evaluating the union of the batches.

For MoE models the routed load per expert is summed over every held-out batch (and, by
``fmoe.moe``, over the data-parallel batches): ``eval_maxvio`` (per layer, the *global* MaxVio of
the held-out set), its percentiles across layers, ``eval_dead_experts`` and, under capacity
routers, ``eval_drop_rate`` (mean over the batches, all of one size) (:mod:`fmoe.routing.metrics`).
Every statistic a router reports is logged the same way with the ``eval_`` prefix
(:mod:`fmoe.training.router_aux`): ``eval_drop_rate``, and for capacity routers the pre-drop
``eval_load_routed`` and ``eval_maxvio_routed``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..mesh import Mesh
from ..nn import ContextParallel, cross_entropy
from ..routing.metrics import load_metrics
from . import router_aux
from .forward import autocast, forward_with_aux, world_mean
from .pipeline import forward_stage, gather_layers, join_stages

__all__ = ["evaluate", "held_out_batch", "EVAL_SEED"]

#: the held-out batches' seed unless ``--eval-seed`` says otherwise (any constant: not ``--seed``).
EVAL_SEED = 0


def held_out_batch(stream: Any, i: int, batch: int, seq: int, seed: int, batch_index: int = 0,
                   num_batches: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel batch's rows of evaluation batch ``i``: its ``tensor_split`` share of
    one draw of ``batch * num_batches`` rows (the same tokens on any mesh of that global batch).

    Args:
        stream: the held-out :class:`fmoe.data.TokenStream`.
        i: evaluation batch index (from 0).
        batch, seq: rows per data-parallel batch, tokens per row.
        seed: the held-out seed (``--eval-seed``; never the training seed).
        batch_index, num_batches: this rank's data-parallel batch and their number.
    Returns:
        ``(tokens, targets)`` ``[batch, seq]``.

    Example:
        >>> import numpy as np
        >>> from fmoe.data import TokenStream
        >>> s = TokenStream(np.arange(500, dtype=np.uint16))
        >>> halves = [held_out_batch(s, 0, 2, 8, 0, b, 2)[0] for b in range(2)]
        >>> torch.equal(torch.cat(halves), held_out_batch(s, 0, 4, 8, 0)[0])
        True
    """
    rows = stream.batch(i + 1, 0, batch * num_batches, seq, seed)                  # the global batch
    x, y = (t.tensor_split(num_batches)[batch_index] for t in rows)                 # this rank's rows
    return x, y


def evaluate(model: Any, cfg: Any, params: Any, stream: Any, *, mesh: Mesh, batches: int, batch: int, seq: int,
             seed: int = EVAL_SEED, impl: str = "auto", router: Optional[Any] = None, dtype: str = "fp32",
             device: Optional[torch.device] = None, dp_batches: int = 1) -> dict:
    """``{"eval_loss": mean cross-entropy, "eval_ppl": exp(eval_loss)}`` on the held-out stream,
    plus the held-out load statistics of MoE models (``eval_maxvio`` ...: module docstring).

    Args:
        model, cfg, params: as for :func:`fmoe.training.step.train_step`.
        stream: the held-out :class:`fmoe.data.TokenStream`.
        mesh: the training mesh (``mesh.batch_index`` picks this rank's slice).
        batches: evaluation batches per data-parallel rank.
        batch, seq: rows per batch and tokens per row.
        seed: the held-out batches' seed (``--eval-seed``; independent of the training seed).
        impl, router, dtype: as in training.
        device: where the tokens go (default CPU).
        dp_batches: this process stands for that many data-parallel batches (``--dp-batches``):
            each evaluation batch is run as their separate pieces, as those ranks would.
    Returns:
        floats, equal on every rank.

    Example:
        >>> import numpy as np, fmoe
        >>> from fmoe.data import TokenStream
        >>> from fmoe.models import qwen3_moe
        >>> cfg = qwen3_moe.Config.tiny()
        >>> held_out = TokenStream(np.arange(2000, dtype=np.uint16) % cfg.vocab_size)
        >>> m = evaluate(qwen3_moe, cfg, qwen3_moe.init(cfg), held_out, mesh=fmoe.Mesh(), batches=2, batch=2, seq=8)
        >>> m["eval_ppl"] > 1.0, "eval_maxvio" in m
        (True, True)
    """
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"evaluate: batches must be an int >= 1, got {batches!r}")
    if isinstance(dp_batches, bool) or not isinstance(dp_batches, int) or dp_batches < 1:
        raise ValueError(f"evaluate: dp_batches must be an int >= 1, got {dp_batches!r}")
    total = torch.zeros((), dtype=torch.float64)
    loads, stats = None, []
    with torch.no_grad():
        pieces = [(i, b) for i in range(batches) for b in range(dp_batches)]      # (batch, rank it stands for)
        for i, b in pieces:
            n = mesh.num_sequences * dp_batches               # cp ranks read one sequence batch
            x, y = held_out_batch(stream, i, batch, seq, seed, mesh.sequence_index * dp_batches + b, n)
            if device is not None:
                x, y = x.to(device), y.to(device)
            with autocast(dtype, x.device):             # pp: this rank's stage (fmoe.training.pipeline)
                logits, aux = (forward_with_aux(model, params, x, cfg, mesh, impl, router) if mesh.pp == 1 else
                               forward_stage(lambda h: forward_with_aux(model, params, x, cfg, mesh, impl, router, h),
                                             mesh, x.device, len(stats)))
            if logits is not None:                      # (the last stage's, with pp)
                if mesh.cp > 1:                         # the logits are this rank's chunks
                    y = ContextParallel(None, mesh.cp, mesh.rank_in("cp")).shard(y, dim=1)
                total += cross_entropy(logits.float(), y).double().cpu()
            layers = aux.get("moe", [])
            if layers and all("load" in layer for layer in layers):      # global over the batches
                now = [layer["load"].cpu() for layer in layers]
                loads = now if loads is None else [a + b for a, b in zip(loads, now)]
            stats.append(router_aux.stats(aux))                       # drop_rate, load_routed, ...
    loss = float(world_mean(total / len(pieces), mesh))
    out = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)),
           **load_metrics(gather_layers(loads or [], mesh), "eval_")}
    return {**out, **join_stages(router_aux.stat_metrics(stats, "eval_", group=mesh.stage_group), mesh, "eval_")}
