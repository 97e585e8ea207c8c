"""Pipeline parallelism: the decoder layers split into stages, micro-batches run through them.

A mesh with ``pp > 1`` (:class:`fmoe.Mesh`, the outermost axis) gives each rank a stage. Stage
``s`` of ``pp`` holds the contiguous layers :func:`fmoe.mesh.stage_layers` gives it (equal blocks
or ``--pp-layers``), the
first stage also the embedding, the last the final norm and the output head: its parameter tree
is the model's with every other leaf left out (:func:`stage_tree`; the other layers are None),
so the model's own ``forward`` runs a stage: ``forward(stage_params, tokens, cfg, mesh,
hidden=x)`` starts from the previous stage's output instead of the embedding and, before the
last stage, returns the residual stream instead of logits (:mod:`fmoe.model.decoder`). Every
other axis (tp, fsdp, ep, dp_replicate) lives inside a stage, unchanged.

A step splits each rank's batch into ``M`` micro-batches (``--microbatches``) and runs their
forwards and backwards in the order of a schedule (:func:`schedule`):

- ``"gpipe"``: every forward, then every backward (``M`` micro-batches' activations in flight);
- ``"1f1b"``: ``pp - s - 1`` warm-up forwards, then one forward and one backward in turn, then
  the remaining backwards: at most ``pp - s`` micro-batches in flight on stage ``s``.

Backwards run in micro-batch order on every stage, so the gradients are summed in the same
order as ``--grad-accum M`` sums them on one process: the same update. The stages exchange the
residual stream with the differentiable pair of :mod:`fmoe.collectives.p2p` (sends never block;
each micro-batch's backward receives its output's gradient first and sends its input's
gradient last). Each stage's objective for a micro-batch is its MoE layers' aux losses (and on
the last stage the language-model loss) divided by ``M``, plus the zero token of its send: one
``torch.autograd.grad`` per micro-batch runs the stage's backward.

Example:
    >>> schedule("1f1b", stage=0, pp=2, microbatches=3)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .. import tree as _tree
from ..mesh import stage_layers
from ..collectives import Pipe, all_gather_objects, recv_forward, send_forward
from ..precision import dtype_of
from ..routing.metrics import load_metrics
from ..routing.state import is_state
from ..sharding import Plan
from .grads import accumulate

__all__ = ["SCHEDULES", "stage_tree", "stage_plan", "schedule", "StageOut", "Timeline", "run_schedule",
           "run_stage", "forward_stage", "stage_leads", "gather_layers", "join_stages", "sum_stages"]

SCHEDULES = ("1f1b", "gpipe")


def stage_tree(tree: dict, stage: int, pp: int, sizes: Optional[Sequence[int]] = None) -> dict:
    """Stage ``stage``'s part of a model tree (parameters, gradients, optimizer moments): its
    layers (:func:`stage_layers`; the others None), ``embed`` on the first stage, everything else
    outside ``layers`` (the final norm, the head) on the last. ``pp == 1``: ``tree`` itself.

    Example:
        >>> t = {"embed": 1, "layers": [2, 3], "norm": 4, "lm_head": 5}
        >>> stage_tree(t, 0, 2), stage_tree(t, 1, 2)
        ({'embed': 1, 'layers': [2, None]}, {'layers': [None, 3], 'norm': 4, 'lm_head': 5})
    """
    if pp == 1:
        return tree
    own = stage_layers(len(tree["layers"]), pp, sizes)[stage]
    out: dict = {}
    for key, value in tree.items():
        if key == "layers":
            out[key] = [layer if i in own else None for i, layer in enumerate(value)]
        elif (key == "embed" and stage == 0) or (key != "embed" and stage == pp - 1):
            out[key] = value
    return out


def stage_plan(plan: Plan, tree: dict, stage: int, pp: int, sizes: Optional[Sequence[int]] = None) -> Plan:
    """A plan of the whole model ``tree`` (e.g. :func:`fmoe.fsdp.data_parallel_plan`, resolved
    there, so its rules are checked against every leaf) restricted to stage ``stage``'s leaves:
    one exact rule per leaf of :func:`stage_tree`. ``pp == 1``: ``plan`` itself."""
    if pp == 1:
        return plan
    own = _tree.flatten(stage_tree(tree, stage, pp, sizes))
    return Plan([(path, p) for path, p in _tree.flatten(plan.resolve(tree)).items() if path in own])


def schedule(name: str, stage: int, pp: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of stage ``stage``'s forwards ``("F", m)`` and backwards ``("B", m)``.

    Example:
        >>> schedule("gpipe", 1, 2, 2)
        [('F', 0), ('F', 1), ('B', 0), ('B', 1)]
        >>> schedule("1f1b", 1, 2, 3)
        [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2)]
    """
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {name!r}")
    M = microbatches
    if name == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    warm = min(pp - stage - 1, M)
    order = [("F", m) for m in range(warm)]
    for m in range(warm, M):
        order += [("F", m), ("B", m - warm)]
    return order + [("B", m) for m in range(M - warm, M)]


@dataclass
class StageOut:
    """One micro-batch's forward on a stage: ``out`` the residual stream for the next stage (None
    on the last), ``objective`` the scalar whose gradient this stage runs (None: no loss term
    here), and whatever the caller records (``record``: the loss, aux entries...)."""

    out: Optional[torch.Tensor]
    objective: Optional[torch.Tensor]
    record: Any = None


@dataclass
class Timeline:
    """Wall time of one stage's step, in seconds: ``total`` (the schedule from its first forward
    to its last send), ``wait`` (of it, blocked on a peer: receives and the sends' completion);
    ``idle`` is their ratio, the bubble this stage saw."""

    total: float = 0.0
    wait: float = 0.0

    @property
    def idle(self) -> float:
        """Fraction of the schedule's time this stage waited for a peer."""
        return self.wait / self.total if self.total > 0 else 0.0


def run_schedule(forward: Callable[[int, Optional[torch.Tensor]], StageOut], leaves: Sequence[torch.Tensor],
                 microbatches: int, mesh: Any, name: str, input_shape: tuple, dtype: torch.dtype,
                 device: Optional[torch.device] = None) -> tuple[Optional[list], list, Timeline]:
    """Run one step's micro-batches through this rank's stage.

    Args:
        forward: ``forward(m, hidden)`` runs micro-batch ``m`` on this stage (``hidden`` the
            previous stage's output, None on the first stage).
        leaves: the trainable leaves of this stage, whose gradients are summed.
        microbatches: ``M``.
        mesh: the :class:`fmoe.Mesh` (``pp``, ``stage``, ``stage_world``, ``rank``).
        name: the schedule (:data:`SCHEDULES`).
        input_shape, dtype: of the residual stream a stage receives for one micro-batch.
        device: where it lives (default CPU).
    Returns:
        ``(grads, records, timeline)``: the summed gradients (in ``leaves``' order; None without
        leaves), each micro-batch's ``StageOut.record`` in micro-batch order, and the stage's
        :class:`Timeline`.
    """
    stage, pp = mesh.stage, mesh.pp
    prev, nxt = mesh.rank - mesh.stage_world, mesh.rank + mesh.stage_world
    pipe, live, records = Pipe(device), {}, [None] * microbatches
    acc: Optional[list] = None
    t0 = time.perf_counter()
    for kind, m in schedule(name, stage, pp, microbatches):
        if kind == "F":
            hidden = recv_forward(input_shape, dtype, prev, m, pipe) if stage > 0 else None
            res = forward(m, hidden)
            objective = res.objective
            if stage < pp - 1:
                token = send_forward(res.out, nxt, m, pipe)
                objective = token if objective is None else objective + token
            live[m], records[m] = objective, res.record
        else:
            inputs = list(leaves) + ([pipe.anchor()] if stage > 0 else [])
            grads = torch.autograd.grad(live.pop(m), inputs) if inputs else ()
            acc = accumulate(acc, grads[:len(leaves)])
            del grads                                    # not held through the next micro-batch's backward
    pipe.wait()
    return acc, records, Timeline(time.perf_counter() - t0, pipe.waited)


def run_stage(micro: Callable[[int, Optional[torch.Tensor], bool], StageOut], leaves: Sequence[torch.Tensor],
              tokens: torch.Tensor, mesh: Any, step_cfg: Any, hidden_size: int, flat: dict) -> tuple:
    """This rank's stage of one training step: :func:`run_schedule` of ``step_cfg.grad_accum``
    micro-batches of ``tokens [B, S]`` in ``step_cfg.pp_schedule`` order, the residual stream
    ``[B / M, S (/ tp with sp), hidden_size]`` in the compute dtype (``step_cfg.dtype``, else the
    weights' own: the first floating leaf of ``flat`` but expert biases).

    Args:
        micro: ``micro(m, hidden, last)`` runs micro-batch ``m`` (the step's forward).
        leaves: the stage's trainable leaves.
        tokens: this rank's batch.
        mesh, step_cfg: the step's :class:`fmoe.Mesh` and :class:`fmoe.training.StepConfig`.
        hidden_size: ``D``.
        flat: the stage's flat parameters.
    Returns:
        :func:`run_schedule`'s ``(grads, records, timeline)``.
    """
    if step_cfg.global_balance or step_cfg.optim_in_backward:
        raise ValueError("train_step: pipeline parallelism (mesh.pp > 1) runs without StepConfig.global_balance "
                         "and optim_in_backward")
    n = step_cfg.grad_accum
    seq = tokens.shape[1] // mesh.cp                                          # cp: this rank's two chunks
    seq = seq // mesh.tp if mesh.sp else seq                                  # sp: the stream's sequence shard
    dtype = (dtype_of(step_cfg.dtype) if dtype_of(step_cfg.dtype) != torch.float32 else
             next(t.dtype for p, t in flat.items() if t.is_floating_point() and not is_state(p)))
    last = mesh.stage == mesh.pp - 1
    return run_schedule(lambda m, hidden: micro(m, hidden, last), leaves, n, mesh, step_cfg.pp_schedule,
                        (tokens.shape[0] // n, seq, hidden_size), dtype, tokens.device)


def forward_stage(forward: Callable[[Optional[torch.Tensor]], tuple], mesh: Any, device: torch.device,
                  tag: int) -> tuple[Optional[torch.Tensor], dict]:
    """One batch through this rank's stage without gradients (evaluation): ``forward(hidden)``
    on the previous stage's output (None on the first stage), whose output goes to the next
    stage. Returns ``(logits or None before the last stage, aux)``."""
    stage, pipe = mesh.stage, Pipe(device)
    hidden = pipe.recv_tensor(device, mesh.rank - mesh.stage_world, tag) if stage > 0 else None
    out, aux = forward(hidden)
    if stage < mesh.pp - 1:
        pipe.send_tensor(out, mesh.rank + mesh.stage_world, tag)
        out = None
    pipe.wait()
    return out, aux


def stage_leads(obj: Any, mesh: Any) -> list:
    """Each stage's first rank's ``obj`` (picklable), in stage order, on every rank (every rank
    gives its own: under the dry run's fake group each rank reads back its own). Collective over
    every rank."""
    every = all_gather_objects(obj)
    return [every[s * mesh.stage_world] for s in range(mesh.pp)]


def gather_layers(values: list, mesh: Any) -> list:
    """Every stage's per-layer list (e.g. the held-out loads), joined in stage order on every
    rank; ``pp == 1``: ``values``. Collective over every rank."""
    if mesh.pp == 1:
        return values
    return [v for part in stage_leads(values, mesh) for v in part]


def join_stages(metrics: dict, mesh: Any, prefix: str = "") -> dict:
    """One step's log entries of the whole model from each stage's own (each computed over its
    stage's ranks): per-layer lists joined in stage order, and the load metrics over all layers
    (:func:`fmoe.routing.metrics.load_metrics`) computed again from the joined loads. Collective
    over every rank; ``pp == 1``: ``metrics`` itself.

    Args:
        metrics: this rank's entries (lists are per MoE layer of its stage).
        mesh: the :class:`fmoe.Mesh`.
        prefix: of every key (``"eval_"``).
    Returns:
        the entries of the whole model, equal on every rank.
    """
    if mesh.pp == 1:
        return metrics
    leads = stage_leads(metrics, mesh)
    out: dict = {}
    for key in dict.fromkeys(k for d in leads for k in d):
        parts = [d[key] for d in leads if key in d]
        out[key] = [x for p in parts for x in p] if all(isinstance(p, list) for p in parts) else parts[-1]
    for loads, suffix in (("expert_load", ""), ("load_routed", "_routed")):
        if out.get(prefix + loads) and all(v is not None for v in out[prefix + loads]):
            out.update(load_metrics([torch.tensor(v, dtype=torch.float64) for v in out[prefix + loads]], prefix, suffix))
    return out


def sum_stages(values: dict, mesh: Any) -> dict:
    """``{name: float}``: each value summed over the stages that hold it and averaged over the
    ranks of a stage (a step's aux losses: every stage adds its layers'). Collective over
    every rank."""
    totals: dict = {}
    for d in all_gather_objects({k: float(v) for k, v in values.items()}):
        for k, v in d.items():
            totals[k] = totals.get(k, 0.0) + v
    return {k: v / mesh.stage_world for k, v in totals.items()}
