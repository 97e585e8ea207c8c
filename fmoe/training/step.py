"""One training step as a pure function: ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

Per rank: forward on this rank's batch (TP ranks share one), mean cross-entropy over its tokens
plus the router aux losses, gradients by autograd, data-parallel reduction to the per-batch mean
(:mod:`fmoe.training.grads`), AdamW with global-norm clipping (:mod:`fmoe.optim.adamw`), then the
router-state update (:mod:`fmoe.training.router_state`: the ``expert_bias`` leaves moved against
the global load, a stateful router's own entries). The result
equals one process training on the union of all batches.

Aux losses (every :class:`fmoe.routing.Loss` entry of a MoE layer's aux, already weighted and
computed on global statistics by ``fmoe.moe``; :mod:`fmoe.training.router_aux`, which also logs
every statistic entry) enter as ``mesh.num_batches * total``: the gradient reduction divides
by the number of batches, which is right for the per-batch-mean LM loss but would shrink the
global aux loss (see :mod:`fmoe.routing.aux_losses`). Leaves that do not require grad (router state,
:func:`fmoe.routing.state.is_state`) get no gradient and no optimizer update.

Token accounting counts each batch once, whatever ``tp`` is: a step processes
``batch * seq * dp_replicate * fsdp`` tokens.

Mixed precision (``StepConfig.dtype="bf16"``, FSDP2's ``param_dtype=bf16`` policy): parameters
stay fp32 master weights; once per step (not per call, not per micro-batch) every floating leaf's
local shard is cast to bf16 (:func:`fmoe.fsdp.cast_shards`, before any gather, so FSDP gathers and
reduce-scatters move half the bytes), and the forward and backward run on those copies: every GEMM
(attention projections, router, experts on every path, lm_head) takes bf16 operands and
accumulates in fp32 inside the kernel (oneDNN/AMX on CPU, cuBLAS on CUDA), activations travel in
bf16, while norms, softmax and router scores, the loss and statistics compute in fp32 (the "at
least fp32" rule of :mod:`fmoe.nn` and :mod:`fmoe.routing`; router state is not cast). The
cast's backward returns fp32 gradients, so micro-batch accumulation, the data-parallel gradient
reduction, clipping and the AdamW moments are fp32. Checkpoints therefore hold fp32.

Memory (``StepConfig.remat``, ``StepConfig.grad_accum``): ``remat="layer"`` / ``"moe"``
recomputes each decoder layer / MoE block in backward instead of keeping its activations
(:mod:`fmoe.nn.remat`); ``grad_accum=N`` splits the batch into N micro-batches whose gradients are
summed before one reduction and one optimizer step: the same update as the whole batch (exactly
so for the LM loss; batch-level aux losses and load statistics are computed per micro-batch).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .. import tree as _tree
from . import global_balance as _global_balance
from . import router_aux as _router_aux
from . import router_state as _router_state
from ..mesh import Mesh
from ..nn import remat as _remat
from ..fsdp import regather_in_backward
from .forward import compute_params, forward_loss, forward_with_aux, world_mean
from . import pipeline as _pipeline
from .grads import accumulate, reduce_flat
from .optim_backward import InBackward
from ..optim import AdamWConfig, adamw
from ..precision import dtype_of, round_generator

__all__ = ["StepConfig", "train_step"]


@dataclass(frozen=True)
class StepConfig:
    """What a step needs besides the trees.

    Attributes:
        opt: AdamW hyper-parameters.
        impl: MoE dispatch implementation passed to the model.
        bias_rate: step of the aux-loss-free ``expert_bias`` update after each step (0: off).
        bias_update: its rule, ``"sign"`` or ``"proportional"`` (:func:`fmoe.routing.update_bias`).
        global_balance: weight of the global-batch balance loss (0: off; frequencies over the
            batches and the micro-batches, :mod:`fmoe.training.global_balance`).
        router: replaces the model's router in every MoE layer (None: the model's own).
        dtype: compute dtype, ``"fp32"`` or ``"bf16"`` (bf16 copies of the fp32 master weights, once per step).
        remat: ``"none"``, ``"layer"`` or ``"moe"``: what to recompute in backward.
        grad_accum: micro-batches per step (the batch's rows are split into this many).
        round_seed: seed of the stochastic rounding of bf16 weights after each update
            (:mod:`fmoe.precision`; None: round to nearest).
        donate: the optimizer writes into the given params and state (the trainer's loop gives
            them up), so the update holds no second copy of them.
        loss_chunks: > 1 computes the loss by that many chunks of tokens, each recomputed in
            backward (:mod:`fmoe.nn.chunked_loss`): no whole fp32 ``[T, V]`` log-softmax.
        optim_in_backward: update each layer in backward once reduced (:mod:`fmoe.training.optim_backward`).
        pp_schedule: with ``mesh.pp > 1``, the order of the ``grad_accum`` micro-batches' forwards
            and backwards on each stage, ``"1f1b"`` or ``"gpipe"`` (:mod:`fmoe.training.pipeline`).
        compile: ``torch.compile`` the step's forward and backward (True: Inductor; or a backend
            name such as ``"aot_eager"``). On one process forward + loss compile as one graph
            (backward by AOTAutograd); on a multi-rank mesh each decoder layer is compiled once
            and reused by every layer, its MoE block and expert-parallel exchange inside the
            layer's graph (:func:`fmoe.nn.remat.compiled`; ``docs/transforms.md``). Same numbers as eager.
    """

    opt: AdamWConfig = AdamWConfig()
    impl: str = "auto"
    bias_rate: float = 1e-3
    bias_update: str = "sign"
    global_balance: float = 0.0
    router: Optional[Any] = None
    dtype: str = "fp32"
    remat: str = "none"
    grad_accum: int = 1
    round_seed: Optional[int] = None
    donate: bool = False
    loss_chunks: int = 1
    compile: Union[bool, str] = False
    optim_in_backward: bool = False
    pp_schedule: str = "1f1b"

    def __post_init__(self):
        dtype_of(self.dtype, "StepConfig.dtype")                # the compute dtype's name (fmoe.precision)
        if self.remat not in _remat.POLICIES:
            raise ValueError(f"StepConfig.remat must be one of {_remat.POLICIES}, got {self.remat!r}")
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"StepConfig.grad_accum must be an int >= 1, got {self.grad_accum!r}")
        if self.pp_schedule not in _pipeline.SCHEDULES:
            raise ValueError(f"StepConfig.pp_schedule must be one of {_pipeline.SCHEDULES}, got {self.pp_schedule!r}")
        if self.bias_update not in ("sign", "proportional"):
            raise ValueError(f"StepConfig.bias_update must be 'sign' or 'proportional', got {self.bias_update!r}")
        for name in ("bias_rate", "global_balance"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"StepConfig.{name} must be a finite number >= 0, got {v!r}")
        if isinstance(self.loss_chunks, bool) or not isinstance(self.loss_chunks, int) or self.loss_chunks < 1:
            raise ValueError(f"StepConfig.loss_chunks must be an int >= 1, got {self.loss_chunks!r}")
        if not isinstance(self.compile, (bool, str)) or (
                isinstance(self.compile, str) and self.compile not in torch._dynamo.list_backends(exclude_tags=())):
            raise ValueError(f"StepConfig.compile must be a bool or a torch.compile backend name "
                             f"({torch._dynamo.list_backends(exclude_tags=())}), got {self.compile!r}")


def _compiled(step_cfg: StepConfig, mesh: Mesh) -> tuple[Any, Any]:
    """``(forward_loss, region)``: with ``step_cfg.compile``, on one process the compiled
    :func:`forward_loss` and no region; on a multi-rank mesh eager :func:`forward_loss` inside
    :func:`fmoe.nn.remat.compiled` (each decoder layer one graph, its MoE block and all-to-all
    exchange included, compiled once and reused by every layer; the region is a reusable context:
    the step enters it once per micro-batch)."""
    if not step_cfg.compile:
        return forward_loss, contextlib.nullcontext()
    backend = "inductor" if step_cfg.compile is True else step_cfg.compile
    if mesh.world == 1:
        return torch.compile(forward_loss, backend=backend), contextlib.nullcontext()
    return forward_loss, _remat.compiled("layer", backend=backend)


def _micro(model: Any, weights: Any, mt: torch.Tensor, my: torch.Tensor, cfg: Any, mesh: Mesh, step_cfg: StepConfig,
           fwd_loss: Any, counts: Any, hidden: Optional[torch.Tensor] = None,
           last: bool = True) -> _pipeline.StageOut:
    """One micro-batch's forward: its objective (LM loss on the last stage + ``num_batches`` x aux
    losses, / ``grad_accum``), its output before the last stage, and its detached record
    ``(loss, aux losses, per-layer loads, router statistics, aux)``."""
    n = step_cfg.grad_accum
    out, aux = fwd_loss(model, weights, mt, my if last else None, cfg, mesh, step_cfg, hidden)
    aux_total, aux_named = _router_aux.losses(aux)      # the routers' Loss entries
    total = out if last else None
    if aux_total is not None:
        total = mesh.num_batches * aux_total if total is None else total + mesh.num_batches * aux_total
    total = total / n if n > 1 and total is not None else total
    if step_cfg.global_balance:                     # this micro-batch's share of the step's loss
        share = _global_balance.share_of(aux, *counts, step_cfg.global_balance)
        aux_named["global_balance_loss"] = share * n      # averaged over micro-batches by the caller
        total = total + mesh.num_batches * share
    layers = [{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in layer.items()}
              for layer in aux.get("moe", [])]
    record = (out.detach() if last else None, {k: v.detach() for k, v in aux_named.items()},
              [layer["load"] for layer in layers if "load" in layer], _router_aux.stats(aux), {"moe": layers})
    return _pipeline.StageOut(None if last else out, total, record)


def _unflatten_new(new: dict, old: dict, tree: Any) -> Any:
    """``tree`` itself when the optimizer left every leaf of its flat form ``old`` in place (a
    donated step), else the new leaves in ``tree``'s structure."""
    return tree if all(new[k] is old[k] for k in old) else _tree.unflatten(new, like=tree)


def train_step(model: Any, cfg: Any, params: Any, opt_state: dict, batch: tuple[torch.Tensor, torch.Tensor],
               *, mesh: Mesh, step_cfg: StepConfig, lr: float) -> tuple[Any, dict, dict]:
    """One optimizer step.

    Args:
        model: a model module (``forward``) from :mod:`fmoe.models`.
        cfg: its Config.
        params: parameter tree (leaves require grad), as placed by ``fmoe.shard``.
        opt_state: from :func:`fmoe.optim.adamw.init`.
        batch: ``(tokens [B, S], targets [B, S])`` of this rank's data-parallel batch.
        mesh: the training mesh.
        step_cfg: :class:`StepConfig`.
        lr: learning rate of this step.
    Returns:
        ``(params, opt_state, metrics)``; metrics are floats/lists equal on every rank:
        ``loss`` (mean over all batches), aux losses, ``grad_norm``, ``lr``, ``tokens``,
        ``skipped`` (True when the loss or the gradient norm was NaN/Inf: then params and
        opt_state are returned unchanged, no update of any kind),
        ``step_time``, ``tokens_per_s``, and per MoE layer ``expert_load`` (routed slots per
        expert over all batches), ``load_imbalance`` (max/mean) and ``drop_rate`` if routed so.

    Example:
        >>> import fmoe
        >>> from fmoe.models import qwen3_moe
        >>> from fmoe.optim import adamw
        >>> cfg = qwen3_moe.Config.tiny()
        >>> from fmoe.routing.state import is_state
        >>> params = fmoe.tree.map_with_path(lambda p, t: t.requires_grad_(not is_state(p)), qwen3_moe.init(cfg))
        >>> tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        >>> params, opt_state, m = train_step(qwen3_moe, cfg, params, adamw.init(params), (tokens, tokens),
        ...                                   mesh=fmoe.Mesh(), step_cfg=StepConfig(), lr=1e-3)
        >>> m["skipped"], m["tokens"], int(opt_state["step"])
        (False, 16, 1)
    """
    t0 = time.perf_counter()
    tokens, targets = batch
    n_micro = step_cfg.grad_accum
    if tokens.shape[0] % n_micro:
        raise ValueError(f"train_step: grad_accum={n_micro} must divide the batch's {tokens.shape[0]} rows")
    flat = _tree.flatten(params)
    train_paths = [p for p, t in flat.items() if t.requires_grad]
    acc, losses, aux_sums, loads, router_stats, counts = None, [], {}, None, [], None
    weights = compute_params(params, step_cfg.dtype)      # once per step, before any gather
    run = lambda mt: forward_with_aux(model, weights, mt, cfg, mesh, step_cfg.impl, step_cfg.router)  # noqa: E731
    fwd_loss, region = _compiled(step_cfg, mesh)
    oib = InBackward(flat, train_paths, opt_state, mesh, step_cfg, lr, world_mean) if step_cfg.optim_in_backward else None
    if step_cfg.global_balance:                     # the step's frequencies first (global_balance)
        with _remat.policy(step_cfg.remat):
            counts = _global_balance.step_counts(run, tokens.chunk(n_micro))
    chunks = list(zip(tokens.chunk(n_micro), targets.chunk(n_micro)))
    micro = lambda m, hidden=None, last=True: _micro(  # noqa: E731
        model, weights, *chunks[m], cfg, mesh, step_cfg, fwd_loss, counts, hidden, last)
    records, leaves = [], [flat[p] for p in train_paths]
    if mesh.pp > 1:                                 # this rank's stage of a pipeline (fmoe.training.pipeline)
        with regather_in_backward(), _remat.policy(step_cfg.remat), region:
            acc, records, timeline = _pipeline.run_stage(micro, leaves, tokens, mesh, step_cfg, cfg.hidden_size, flat)
    for m in range(0 if mesh.pp > 1 else n_micro):
        with regather_in_backward(), _remat.policy(step_cfg.remat), region:
            res = micro(m)
            records.append(res.record)
            losses = [r[0] for r in records]
            grads = oib.backward(res.objective, losses) if oib else torch.autograd.grad(res.objective, leaves)
        acc = accumulate(acc, grads)
        del grads, res
    losses = [r[0] for r in records if r[0] is not None]
    for _, aux_named, layer_loads, stats_m, aux in records:
        for k, v in aux_named.items():
            aux_sums[k] = aux_sums.get(k, 0.0) + v / n_micro
        loads = layer_loads if loads is None else [a + b for a, b in zip(loads, layer_loads)]
        router_stats.append(stats_m)                 # the routers' statistics (drop_rate, ...)
    weights = run = micro = None                   # the compute copies are freed before the update
    loss = torch.stack(losses).mean() if losses else torch.zeros(())    # pp: the last stage's loss

    grads = None if oib else reduce_flat(dict(zip(train_paths, acc)), flat, mesh, inplace=True)
    flat, opt_state, stats, mean_loss = oib.result() if oib else (flat, opt_state, None, world_mean(loss, mesh))
    if stats is None and bool(torch.isfinite(mean_loss)):      # a non-finite loss or grad norm: no update at all
        rounding = None if step_cfg.round_seed is None else round_generator(   # bf16 weights: stochastic
            step_cfg.round_seed, int(opt_state["step"]) + 1, mesh.rank, tokens.device)
        flat_m, flat_v = _tree.flatten(opt_state["m"]), _tree.flatten(opt_state["v"])
        flat, new_m, new_v, count, stats = adamw.step_flat(grads, flat_m, flat_v, flat, opt_state["step"], lr,
                                                           step_cfg.opt, rounding=rounding, donate=step_cfg.donate)
        opt_state = {"step": count, "m": _unflatten_new(new_m, flat_m, opt_state["m"]),
                     "v": _unflatten_new(new_v, flat_v, opt_state["v"])}
    elif stats is None:                            # (with oib: updated inside backward)
        stats = {"grad_norm": adamw.global_norm(grads), "skipped": True}
    moe_paths = [p[: -len(".router")] for p in flat if p.endswith("moe.router")]     # layers.3.moe, in order
    states = _router_state.run_states(step_cfg.router, flat, step_cfg.bias_rate, step_cfg.bias_update)
    if states and not stats.get("skipped"):          # router state: expert bias, ReMoE's L1 coefficient, ...
        _router_state.update(states, flat, moe_paths, loads, router_stats)
    params = _tree.unflatten(flat, like=params)
    dt = time.perf_counter() - t0
    n_tokens = tokens.numel() * mesh.num_sequences          # cp ranks share their sequences
    metrics = {"loss": float(mean_loss), "grad_norm": float(stats["grad_norm"]), "lr": lr,
               "tokens": n_tokens, "step_time": dt, "tokens_per_s": n_tokens / dt,
               "skipped": bool(stats.get("skipped", False))}
    metrics.update(_pipeline.sum_stages(aux_sums, mesh) if mesh.pp > 1 else
                   {k: float(world_mean(v)) for k, v in aux_sums.items()})
    routing = _router_aux.step_metrics(aux, loads, router_stats, n_micro, taken=metrics,   # collective
                                       group=mesh.stage_group)
    if mesh.pp > 1:                                # each stage's share of the schedule spent waiting
        routing["pp_idle"] = [timeline.idle]
    routing.update(_router_state.metrics(states, flat, moe_paths))              # e.g. expert_bias_absmax
    metrics.update(_pipeline.join_stages(routing, mesh))        # pp: every stage's layers, in order
    return params, opt_state, metrics
