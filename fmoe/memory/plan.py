"""How much memory and traffic each rank of a training job needs, before running it.

:func:`memory_plan` lays the model out exactly as ``fmoe train`` would (the model's
plan plus the data-parallel splits of :func:`fmoe.fsdp.data_parallel_plan`, on a virtual
mesh: no process group, no tensor allocated — parameters are built on the ``meta`` device) and
counts, per rank:

- ``params_bytes``: the local slices of the weights in ``master_dtype`` (exact);
- ``grads_bytes``: the reduced gradients (same dtype), placed like the parameters, of every
  leaf that requires grad (exact);
- ``optimizer_bytes``: AdamW's two moments (``optim_dtype``) of every leaf plus the int64 step (exact);
- ``activations_bytes``: tensors kept for backward at the end of forward (an estimate, below);
- ``collective_bytes``: bytes this rank sends per step (an estimate, below);
- ``total_bytes``: params + grads + optimizer + activations;
- ``peak``: the step's predicted peak and its bytes by category then
  (:mod:`fmoe.memory.peak`), what ``fmoe memory --dry-run`` measures.

Activations are the tensors autograd saves for backward, which peak at the end of forward. For a
decoder with T = batch * seq tokens per rank and micro-batch, per layer (fp32; q, kv the rank's
query / KV widths after tp; R = T * K / tp expert rows per rank on average)::

    24 T D + 16 T (q + kv) + 6 T (H + G) / tp + 20 T            attention, norms, residuals
    4 T E + 40 T K + R (8 D + 8 I)                               router, routing, expert rows
    12 T I' / tp                                                 a dense MLP layer instead

plus ``12 T D + 4 T V`` for the embedding, final norm and logits. The coefficients were counted
on Qwen3-MoE (saved tensors of one forward, several shapes) and are checked against measured
saved bytes on several meshes by ``tests/distributed/test_memory_plan.py`` (within 25%; routing imbalance
moves R). ``remat="layer"`` keeps one ``[T, D]`` input per layer plus one layer recomputed in
backward; ``remat="moe"`` drops the expert rows of all but one layer. With ``dtype="bf16"``
autocast halves the matmul-side activations, keeps the fp32 logits copy for the loss, and saves
a bf16 copy of every weight a matmul uses (2 bytes per gathered parameter).

Collectives (sent bytes, ring algorithms): FSDP all-gather forward + re-gather backward +
reduce-scatter of gradients, ``3 (n - 1) / n`` of the gathered bytes, in the compute dtype (bf16
weights are cast on the shard before the gather: half the bytes); the dispatch and combine
exchanges of each MoE layer, forward and backward, ``4 R (ep - tp) / ep`` rows of D values
(rows for the rank's own experts stay local); TP all-reduces of ``[T, D]`` twice per layer and
direction; HSDP all-reduce of the gradients over ``dp_replicate``.

Example:
    >>> from fmoe.models import qwen3_moe
    >>> p = memory_plan(qwen3_moe, qwen3_moe.Config.tiny(), nproc=4, ep=4, batch=2, seq=16)
    >>> len(p["ranks"]), sorted(p["ranks"][0])[:3]
    (4, ['activations_bytes', 'collective_bytes', 'grads_bytes'])
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .. import tree as _tree
from ..mesh import RankLayout
from ..model import Widths, model_of
from ..sharding import local_shape
from ..precision import Precision
from . import fake_splits, peak as memory_peak

__all__ = ["memory_plan", "format_plan", "VirtualMesh", "activation_estimate"]

_F32, _STEP = 4, 8          # fp32 masters / moments; AdamW's int64 step counter


class VirtualMesh(RankLayout):
    """The sizes and coordinates :class:`fmoe.Mesh` gives ``rank`` of ``world``, without processes
    (a :class:`fmoe.mesh.RankLayout` whose errors name the memory plan's flags).

    Example:
        >>> m = VirtualMesh(8, rank=3, tp=2, ep=4)
        >>> m.fsdp, m.efsdp, m.rank_in("tp"), m.rank_in("ep"), m.batch_index
        (4, 2, 1, 3, 1)
    """

    def __init__(self, world: int, rank: int = 0, tp: int = 1, ep: Optional[int] = None, dp_replicate: int = 1):
        try:
            super().__init__(world, rank, tp=tp, ep=ep, dp_replicate=dp_replicate, names={"world": "nproc"})
        except (TypeError, ValueError) as e:
            raise ValueError(f"memory plan: {e}") from None


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def activation_estimate(w: Widths, *, tokens: int, tp: int, moe_layers: int, dense_layers: int,
                        dtype: str = "fp32", remat: str = "none", weight_bytes: int = 0) -> int:
    """Bytes saved for backward on one rank (see the module docstring for the formula).

    Args:
        w: the model's layer widths (:meth:`fmoe.model.Model.widths` of its config).
        tokens: T, tokens per rank and micro-batch (``batch * seq``).
        tp: tensor-parallel size.
        moe_layers, dense_layers: layer counts by feed-forward kind.
        dtype: ``"fp32"`` or ``"bf16"``.
        remat: ``"none"``, ``"layer"`` or ``"moe"``.
        weight_bytes: fp32 bytes of the dense (non-expert) weights one rank's matmuls use in a
            forward, after FSDP gathering (autocast saves a bf16 copy of each for backward).
    """
    T = tokens
    q, kv = w.H * w.hd / tp, w.G * w.hd / tp
    attn = 24 * T * w.D + 16 * T * (q + kv) + 6 * T * (w.H + w.G) / tp + 20 * T
    R = T * w.K / tp
    experts = R * (8 * w.D + 8 * w.I)
    moe = 4 * T * w.E + 40 * T * w.K + experts
    dense = 12 * T * w.Id / tp
    glob = 12 * T * w.D + 4 * T * w.V
    layer_in = 4 * T * w.D
    if remat == "layer":
        per_layer = moe_layers * layer_in + dense_layers * layer_in
        per_layer += max(attn + moe if moe_layers else 0, attn + dense if dense_layers else 0)
    elif remat == "moe":
        per_layer = moe_layers * (attn + moe - experts) + dense_layers * (attn + dense) + (experts if moe_layers else 0)
    else:
        per_layer = moe_layers * (attn + moe) + dense_layers * (attn + dense)
    if dtype == "bf16":                 # bf16 copies of dense matmul inputs / weights; q, k, v in bf16
        layers = moe_layers + dense_layers
        per_layer += layers * (8 * T * w.D - 8 * T * (q + kv))
        glob += weight_bytes // 2
    return int(per_layer + glob)


def memory_plan(model: Any, cfg: Any, *, nproc: int, tp: int = 1, ep: Optional[int] = None, dp_replicate: int = 1,
                batch: int = 4, seq: int = 64, dtype: str = "fp32", remat: str = "none", grad_accum: int = 1,
                model_plan: Any = None, master_dtype: str = "fp32", optim_dtype: str = "fp32",
                loss_chunks: int = 1) -> dict:
    """Per-rank memory and traffic of training ``model`` on ``nproc`` ranks (no process needed).

    Args:
        model: a model of :mod:`fmoe.models` (its declared ``Model`` or its module); cfg: its Config.
        nproc, tp, ep, dp_replicate: the mesh (``fsdp = nproc / (tp * dp_replicate)``).
        batch, seq: sequences per data-parallel micro-batch and tokens per sequence.
        dtype: ``"fp32"`` or ``"bf16"`` compute.
        master_dtype, optim_dtype: the precision policy (:mod:`fmoe.precision`): weights and
            gradients, AdamW's moments.
        loss_chunks: the loss computed by this many chunks of tokens (:mod:`fmoe.nn.chunked_loss`).
        remat: ``"none"``, ``"layer"`` or ``"moe"``.
        grad_accum: micro-batches per step (activations are those of one micro-batch).
        model_plan: the model's TP/EP plan (default: the model's own).
    Returns:
        ``{"model", "mesh", "batch", "seq", "dtype", "master_dtype", "optim_dtype", "remat",
        "ranks": [{rank, params_bytes, grads_bytes, optimizer_bytes, activations_bytes,
        collective_bytes, total_bytes, peak}], "max_total_bytes"}``; ``total_bytes`` sums the
        four categories (everything at once), ``peak`` is the step's predicted peak by phase
        (:mod:`fmoe.memory.peak`: ``total_bytes`` and the bytes of each category then, the
        numbers ``--dry-run`` measures).
    """
    from ..fsdp import data_parallel_plan

    if remat not in ("none", "layer", "moe"):
        raise ValueError(f"memory plan: remat must be 'none', 'layer' or 'moe', got {remat!r}")
    try:
        pol = Precision(dtype, master_dtype, optim_dtype)
    except ValueError as e:
        raise ValueError(f"memory plan: {e}") from None
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 1:
        raise ValueError(f"memory plan: loss_chunks must be an int >= 1, got {loss_chunks!r}")
    mb, ob = pol.master_dtype.itemsize, pol.optim_dtype.itemsize
    m0 = VirtualMesh(nproc, 0, tp, ep, dp_replicate)          # mesh errors first, before any model work
    declared = model_of(model)
    with torch.device("meta"):
        full = declared.init(cfg)
    flat = _tree.flatten(full)
    mp = model_plan if model_plan is not None else declared.build_plan(cfg, tp=tp)
    w = declared.widths(cfg)
    moe_layers = sum(1 for p in flat if p.endswith("moe.router"))
    ranks = []
    act_bytes = 2 if dtype == "bf16" else 4      # bf16: weights cast on the shard, before the gather
    for r in range(nproc):
        mesh = VirtualMesh(nproc, r, tp, ep, dp_replicate)
        placed = _tree.flatten(data_parallel_plan(mp, full, mesh).resolve(full, mesh))
        params = grads = optimizer = largest = 0
        dense_mm = collective = 0.0
        gathered: dict[str, int] = {}                 # layer -> bytes its weights take gathered
        layer_grads: dict[str, int] = {}              # layer -> bytes of its gradients
        for path, t in flat.items():
            p = placed[path]
            n = _numel(local_shape(tuple(t.shape), p, mesh))
            params += n * mb
            optimizer += 2 * n * ob
            if not path.endswith("expert_bias"):
                grads += n * mb
                largest = max(largest, n)
            data = [a for a in p.mesh_axes() if a in ("fsdp", "efsdp")]
            k = math.prod(mesh.size(a) for a in data) if data else 1
            layer = ".".join(path.split(".")[:2]) if path.startswith("layers.") else path
            if layer != path and k > 1:
                gathered[layer] = gathered.get(layer, 0) + n * k * mb
            if not path.endswith("expert_bias"):
                layer_grads[layer] = layer_grads.get(layer, 0) + n * mb
            if "ep" not in p.mesh_axes() and len(t.shape) >= 2 and path != "embed":
                dense_mm += n * k * _F32                             # gathered for a matmul
            collective += 3 * (k - 1) * n * min(act_bytes, mb) * grad_accum   # gather, re-gather, reduce-scatter: compute dtype
            if mesh.dp_replicate > 1:
                collective += 2 * (mesh.dp_replicate - 1) / mesh.dp_replicate * n * mb
        T = batch * seq
        R = T * w.K / tp if moe_layers else 0
        collective += grad_accum * moe_layers * 4 * R * (mesh.ep - tp) / mesh.ep * w.D * act_bytes
        collective += grad_accum * w.L * 4 * 2 * (tp - 1) / tp * T * w.D * act_bytes
        acts = activation_estimate(w, tokens=T, tp=tp, moe_layers=moe_layers,
                                   dense_layers=w.L - moe_layers, dtype=dtype, remat=remat,
                                   weight_bytes=int(dense_mm))
        optimizer += _STEP
        peak = _peak(w._asdict(), mesh, T, moe_layers, pol, remat, loss_chunks, params, grads, optimizer, largest,
                     int(dense_mm) if pol.master == "fp32" and pol.compute == "bf16" else 0,
                     max(gathered.values(), default=0),
                     grads - layer_grads.get("layers.0", 0) - layer_grads.get("embed", 0))
        ranks.append({"rank": r, "params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optimizer,
                      "activations_bytes": acts, "collective_bytes": int(collective),
                      "total_bytes": params + grads + optimizer + acts, "peak": peak})
    return {"model": declared.name,
            "mesh": {"nproc": nproc, "tp": tp, "ep": m0.ep, "fsdp": m0.fsdp, "efsdp": m0.efsdp,
                     "dp_replicate": dp_replicate},
            "batch": batch, "seq": seq, "dtype": dtype, "master_dtype": master_dtype, "optim_dtype": optim_dtype,
            "loss_chunks": loss_chunks, "remat": remat, "grad_accum": grad_accum,
            "ranks": ranks, "max_total_bytes": max(r["total_bytes"] for r in ranks)}


def _peak(w: dict, mesh: VirtualMesh, T: int, moe_layers: int, pol: Precision, remat: str, loss_chunks: int,
          params: int, grads: int, optimizer: int, largest: int, autocast_copies: int, gathered: int,
          last_grads: int) -> dict:
    """The step's predicted peak on this rank (:mod:`fmoe.memory.peak`); the routing slots
    follow :mod:`fmoe.memory.fake_splits`, the rule the dry run uses."""
    from ..ep.token_dispatch import tp_slice_bounds

    b = 2 if "bf16" in (pol.compute, pol.master) else 4
    if moe_layers and mesh.ep > 1:
        slices = [(lambda ab: ab[1] - ab[0])(tp_slice_bounds(T, mesh.tp, j % mesh.tp)) for j in range(mesh.ep)]
        slots = fake_splits.received(slices, k=w["K"], me=mesh.rank_in("ep"))[1]
    else:
        slots = T * w["K"]
    dense_layers = w["L"] - moe_layers
    moe_l = memory_peak.layer_activations(w, tokens=T, slots=slots, tp=mesh.tp, b=b, moe=True) if moe_layers else 0
    dense_l = memory_peak.layer_activations(w, tokens=T, slots=0, tp=mesh.tp, b=b, moe=False) if dense_layers else 0
    if remat == "layer":
        layers = (moe_layers + dense_layers) * b * T * w["D"] + max(moe_l, dense_l)
    elif remat == "moe" and moe_layers:
        expert = b * slots * (4 * w["D"] + 3 * w["I"])
        layers = moe_layers * (moe_l - expert) + expert + dense_layers * dense_l
    else:
        layers = moe_layers * moe_l + dense_layers * dense_l
    acts = layers + memory_peak.global_activations(w, tokens=T, b=b, loss_chunks=loss_chunks) + autocast_copies // 2
    expert = b * slots * (4 * w["D"] + 3 * w["I"]) if moe_layers else 0
    last = max(moe_l, dense_l) if remat == "none" else b * T * w["D"]          # what the first layer's backward frees
    loss_side = 4 * T * w["V"] if loss_chunks == 1 else 0       # the log-softmax is gone by then (the logits stay)
    return memory_peak.step_peak(params=params, grads=grads, optimizer=optimizer, activations=int(acts),
                                 loss_temps=memory_peak.loss_temporaries(w, tokens=T, b=b, loss_chunks=loss_chunks),
                                 norm_temps=memory_peak.norm_temporaries(largest, pol.master_dtype.itemsize),
                                 layer_acts=int(last + loss_side),
                                 layer_temps=memory_peak.layer_temporaries(gathered=gathered, expert_acts=int(expert)),
                                 last_acts=b * T * w["V"], last_grads=last_grads)


def _fmt(n: float, unit: float) -> str:
    return f"{n / unit:.3f}" if unit == 1e9 else f"{n / unit:.2f}"


def format_plan(plan: dict, memory_gb: Optional[float] = None) -> str:
    """A readable table of :func:`memory_plan`'s result (GB = 1e9 bytes), with a warning line
    when a rank's total exceeds ``memory_gb``."""
    m = plan["mesh"]
    head = (f"memory plan: {plan['model']} on {m['nproc']} ranks (tp={m['tp']} ep={m['ep']} fsdp={m['fsdp']} "
            f"efsdp={m['efsdp']} dp_replicate={m['dp_replicate']}), batch {plan['batch']} x seq {plan['seq']}, "
            f"{plan['dtype']}, remat {plan['remat']}, grad_accum {plan['grad_accum']}")
    cols = ("params", "grads", "optimizer", "activations", "total", "sent/step")
    unit, name = (1e9, "GB") if plan["max_total_bytes"] >= 1e9 else (1e6, "MB")
    lines = [head, f"{'rank':>4} " + " ".join(f"{c + ' ' + name:>15}" for c in cols)]
    rows, last = [], None
    for r in plan["ranks"]:
        vals = tuple(r[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                                    "total_bytes", "collective_bytes"))
        if vals == last and r is not plan["ranks"][-1]:
            continue
        rows.append(f"{r['rank']:>4} " + " ".join(f"{_fmt(v, unit):>15}" for v in vals))
        last = vals
    lines += rows
    if len(rows) < len(plan["ranks"]):
        lines.append("(ranks not shown equal the rank above them)")
    if memory_gb is not None and plan["max_total_bytes"] > memory_gb * 1e9:
        lines.append(f"WARNING: {plan['max_total_bytes'] / 1e9:.3g} GB per rank exceeds --memory-gb {memory_gb}")
    return "\n".join(lines)

