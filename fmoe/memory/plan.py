"""How much memory and traffic each rank of a training job needs, before running it.

:func:`memory_plan` lays the model out exactly as ``fmoe train`` would (the model's plan plus the data-parallel
splits of :func:`fmoe.fsdp.data_parallel_plan`, on a virtual mesh: no process group, no tensor allocated —
parameters are built on the ``meta`` device) and counts, per rank:

- ``params_bytes``: the local slices of the weights in ``master_dtype`` (exact);
- ``grads_bytes``: the reduced gradients (same dtype), placed like the parameters, of every leaf that requires grad (exact);
- ``optimizer_bytes``: AdamW's two moments (``optim_dtype``) of every leaf plus the int64 step (exact);
- ``activations_bytes``: tensors kept for backward at the end of forward (an estimate, below);
- ``collective_bytes``: bytes this rank sends per step (an estimate, below);
- ``total_bytes``: params + grads + optimizer + activations;
- ``peak``: the step's predicted peak and its bytes by category then (:mod:`fmoe.memory.peak`), as ``--dry-run`` measures.

Activations are the tensors autograd saves for backward, which peak at the end of forward. For a decoder with
T = batch * seq tokens per rank and micro-batch, per layer (fp32; q, kv the rank's query / KV widths after tp;
R = T * K / tp expert rows per rank on average)::

    24 T D + 16 T (q + kv) + 6 T (H + G) / tp + 20 T            attention, norms, residuals
    4 T E + 40 T K + R (8 D + 8 I)                               router, routing, expert rows
    12 T I' / tp                                                 a dense MLP layer instead

plus ``12 T D + 4 T V`` for the embedding, final norm and logits. The coefficients were counted on Qwen3-MoE (saved
tensors of one forward, several shapes) and are checked against measured saved bytes on several meshes by
``tests/distributed/test_memory_plan.py`` (within 25%; routing imbalance moves R). ``remat="layer"`` keeps one
``[T, D]`` input per layer plus one layer recomputed in backward; ``remat="moe"`` drops the expert rows of all but one
layer. With ``dtype="bf16"`` autocast halves the matmul-side activations, keeps the fp32 logits copy for the loss,
and saves a bf16 copy of every weight a matmul uses (2 bytes per gathered parameter).

Collectives (sent bytes, ring algorithms): FSDP all-gather forward + re-gather backward + reduce-scatter of
gradients, ``3 (n - 1) / n`` of the gathered bytes, in the compute dtype (bf16 weights are cast on the shard
before the gather: half the bytes); the dispatch and combine exchanges of each MoE layer, forward and backward,
``4 R (ep - tp) / ep`` rows of D values (rows for the rank's own experts stay local); TP all-reduces of
``[T, D]`` twice per layer and direction; HSDP all-reduce of the gradients over ``dp_replicate``; with
``cp`` the K/V all-gather (and its reduce-scatter) of every layer, ``(cp - 1) T`` rows of K and V.

Example:
    >>> from fmoe.models import qwen3_moe
    >>> p = memory_plan(qwen3_moe, qwen3_moe.Config.tiny(), nproc=4, ep=4, batch=2, seq=16)
    >>> len(p["ranks"]), sorted(p["ranks"][0])[:3]
    (4, ['activations_bytes', 'collective_bytes', 'grads_bytes'])
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from .. import tree as _tree
from ..mesh import RankLayout, stage_layers
from ..model import Widths, model_of
from ..sharding import local_shape
from ..precision import Precision
from ..routing.state import is_state
from . import peak as memory_peak

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

    def __init__(self, world: int, rank: int = 0, tp: int = 1, ep: Optional[int] = None, dp_replicate: int = 1,
                 pp: int = 1, sp: bool = False, cp: int = 1):
        try:
            super().__init__(world, rank, tp, ep, None, dp_replicate, {"world": "nproc"}, pp, sp, cp)
        except (TypeError, ValueError) as e:
            raise ValueError(f"memory plan: {e}") from None


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def activation_estimate(w: Widths, *, tokens: int, tp: int, moe_layers: int, dense_layers: int,
                        dtype: str = "fp32", remat: str = "none", weight_bytes: int = 0, cp: int = 1) -> int:
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
        cp: context-parallel size: attention saves the K/V gathered from the other ``cp - 1`` ranks.
    """
    T = tokens
    q, kv = w.H * w.hd / tp, w.G * w.hd / tp
    attn = 24 * T * w.D + 16 * T * (q + kv) + 6 * T * (w.H + w.G) / tp + 20 * T
    attn += (2 if dtype == "bf16" else 4) * 2 * (cp - 1) * T * kv          # cp: the gathered K and V
    R = T * w.K / tp
    experts = R * (8 * w.D + 8 * w.I)
    moe = 4 * T * w.E + 40 * T * w.K + experts + 12 * T * w.Is / tp          # + the shared experts' MLP
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
                loss_chunks: int = 1, optim_in_backward: bool = False, clip: Optional[float] = 1.0, sp: bool = False,
                pp: int = 1, microbatches: Optional[int] = None, pp_schedule: str = "1f1b",
                pp_layers: Optional[Sequence[int]] = None, cp: int = 1) -> dict:
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
        optim_in_backward: each layer updated inside backward (:mod:`fmoe.training.optim_backward`):
            one layer's gradients alive at a time; with ``clip`` (not None / 0) the first of its two
            backward passes keeps every activation.
        sp: sequence parallelism over tp (the residual stream and norms on ``seq / tp`` tokens).
        pp, microbatches, pp_schedule: pipeline stages (each rank counts its stage's leaves),
            ``batch`` split into ``microbatches`` (default ``pp``), ``"1f1b"`` (stage ``s`` holds
            ``min(M, pp - s)`` micro-batches' activations) or ``"gpipe"`` (all ``M``).
        pp_layers: decoder layers per stage (``--pp-layers``; default equal blocks).
        cp: context parallelism (``--cp``): ``seq / cp`` tokens per rank; each layer all-gathers K/V
            over the cp group (kept for backward; again when recomputed), their gradients reduce-scattered.
    Returns:
        ``{"model", "mesh", "batch", "seq", "dtype", "master_dtype", "optim_dtype", "remat",
        "ranks": [{rank, params_bytes, grads_bytes, optimizer_bytes, activations_bytes,
        collective_bytes, total_bytes, peak}], "max_total_bytes"}``; ``total_bytes`` sums the
        four categories (everything at once), ``peak`` is the step's predicted peak by phase
        (:mod:`fmoe.memory.peak`: ``total_bytes`` and the bytes of each category then, the
        numbers ``--dry-run`` measures).
    """
    from ..fsdp import data_parallel_plan

    if pp_schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"memory plan: pp_schedule must be '1f1b' or 'gpipe', got {pp_schedule!r}")
    M = (microbatches or pp) if pp > 1 else 1
    if batch % M:
        raise ValueError(f"memory plan: microbatches={M} must divide batch={batch}")
    if remat not in ("none", "layer", "moe"):
        raise ValueError(f"memory plan: remat must be 'none', 'layer' or 'moe', got {remat!r}")
    try:
        pol = Precision(dtype, master_dtype, optim_dtype)
    except ValueError as e:
        raise ValueError(f"memory plan: {e}") from None
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 1:
        raise ValueError(f"memory plan: loss_chunks must be an int >= 1, got {loss_chunks!r}")
    mb, ob = pol.master_dtype.itemsize, pol.optim_dtype.itemsize
    m0 = VirtualMesh(nproc, 0, tp, ep, dp_replicate, pp, sp, cp)  # mesh errors first, before any model work
    declared = model_of(model)
    with torch.device("meta"):
        full = declared.init(cfg)
    flat = _tree.flatten(full)
    mp = model_plan if model_plan is not None else declared.build_plan(cfg, tp=tp)
    w = declared.widths(cfg)
    try:
        stages = stage_layers(w.L, pp, pp_layers)
    except ValueError as e:
        raise ValueError(f"memory plan: {e}") from None
    ranks = []
    act_bytes = 2 if dtype == "bf16" else 4      # bf16: weights cast on the shard, before the gather
    for r in range(nproc):
        mesh = VirtualMesh(nproc, r, tp, ep, dp_replicate, pp, sp, cp)
        placed = _tree.flatten(data_parallel_plan(mp, full, mesh).resolve(full, mesh))
        own = {p: t for p, t in flat.items() if _stage_of(p, stages) == mesh.stage}    # this stage's leaves
        moe_layers = sum(1 for p in own if p.endswith("moe.router"))
        layers = len(stages[mesh.stage])
        first, last = mesh.stage == 0, mesh.stage == pp - 1
        inflight = 1 if pp == 1 else M if pp_schedule == "gpipe" else min(M, pp - mesh.stage)
        params = grads = optimizer = largest = 0
        dense_mm = collective = 0.0
        gathered: dict[str, int] = {}                 # layer -> bytes its weights take gathered
        layer_grads: dict[str, int] = {}              # layer -> bytes of its gradients
        unsplit: dict[str, int] = {}                  # layer -> its gradients made whole on this rank
        for path, t in own.items():
            p = placed[path]
            n = _numel(local_shape(tuple(t.shape), p, mesh))
            params += n * mb
            optimizer += 2 * n * ob
            if not is_state(path):            # router state: no gradient
                grads, largest = grads + n * mb, max(largest, n)
            data = [a for a in p.mesh_axes() if a in ("fsdp", "efsdp")]
            k = math.prod(mesh.size(a) for a in data) if data else 1
            layer = ".".join(path.split(".")[:2]) if path.startswith("layers.") else path
            if layer != path and k > 1:
                gathered[layer] = gathered.get(layer, 0) + n * k * mb
            if not is_state(path):
                layer_grads[layer] = layer_grads.get(layer, 0) + n * mb
                if layer != path and k == 1 and "ep" in p.mesh_axes():     # its experts' gradients
                    unsplit[layer] = unsplit.get(layer, 0) + n * mb
            if "ep" not in p.mesh_axes() and len(t.shape) >= 2 and path != "embed":
                dense_mm += n * k * _F32                             # gathered for a matmul
            collective += 3 * (k - 1) * n * min(act_bytes, mb) * grad_accum * M   # gather, re-gather, reduce-scatter
            if mesh.dp_replicate > 1:
                collective += 2 * (mesh.dp_replicate - 1) / mesh.dp_replicate * n * mb
        T = batch // M * seq // cp                 # tokens of one micro-batch (this rank's chunks with cp)
        R = T * w.K / tp if moe_layers else 0
        passes = grad_accum * M * (2 if optim_in_backward and clip else 1)     # backward passes (two with the clip)
        collective += grad_accum * M * moe_layers * 4 * R * (mesh.ep - tp) / mesh.ep * w.D * act_bytes
        collective += grad_accum * M * layers * 4 * 2 * (tp - 1) / tp * T * w.D * act_bytes
        collective += grad_accum * M * layers * (2 + (remat == "layer")) * (cp - 1) * T * 2 * w.G * w.hd / tp * act_bytes
        if pp > 1:                                 # the residual stream to the next stage, its gradient back
            collective += M * T * w.D * act_bytes * (int(not last) + int(not first)) / tp
        if passes > grad_accum * M:                # the norm pass repeats the backward's exchanges (~ half)
            collective *= 1.5
        acts = inflight * activation_estimate(w, tokens=T, tp=tp, moe_layers=moe_layers,
                                              dense_layers=layers - moe_layers, dtype=dtype, remat=remat,
                                              weight_bytes=int(dense_mm), cp=cp)
        optimizer += _STEP
        first_grads = layer_grads.get(f"layers.{mesh.stage * layers}", 0) + layer_grads.get("embed", 0)
        shape = memory_peak.Stage(inflight, first, last, max(layer_grads.values(), default=0) if optim_in_backward else None,
                       bool(optim_in_backward and clip), grad_accum * M)
        peak = memory_peak.rank_peak(w._asdict(), mesh, T, moe_layers, layers, pol, remat, loss_chunks, params, grads, optimizer,
                     largest, int(dense_mm) if pol.master == "fp32" and pol.compute == "bf16" else 0,
                     max(gathered.values(), default=0), max(unsplit.values(), default=0), grads - first_grads,
                     shape)
        if optim_in_backward:                      # one layer's gradients alive at a time
            grads = shape.group_grads
        ranks.append({"rank": r, "params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optimizer,
                      "activations_bytes": acts, "collective_bytes": int(collective),
                      "total_bytes": params + grads + optimizer + acts, "peak": peak})
    return {"model": declared.name,
            "mesh": {"nproc": nproc, "tp": tp, "ep": m0.ep, "fsdp": m0.fsdp, "efsdp": m0.efsdp,
                     "dp_replicate": dp_replicate, "pp": pp, "sp": sp, "cp": cp},
            "batch": batch, "seq": seq, "dtype": dtype, "master_dtype": master_dtype, "optim_dtype": optim_dtype,
            "loss_chunks": loss_chunks, "remat": remat, "grad_accum": grad_accum, "microbatches": M,
            "pp_schedule": pp_schedule, "pp_layers": None if pp_layers is None else list(pp_layers),
            "optim_in_backward": optim_in_backward, "clip": clip,
            "ranks": ranks, "max_total_bytes": max(r["total_bytes"] for r in ranks)}


def _stage_of(path: str, stages: list) -> int:
    """The pipeline stage holding ``path`` (``stages``: :func:`fmoe.mesh.stage_layers`; the
    embedding on the first stage, the rest on the last)."""
    parts = path.split(".")
    if parts[0] == "layers":
        return next(s for s, block in enumerate(stages) if int(parts[1]) in block)
    return 0 if parts[0] == "embed" else len(stages) - 1


def _fmt(n: float, unit: float) -> str:
    return f"{n / unit:.3f}" if unit == 1e9 else f"{n / unit:.2f}"


def format_plan(plan: dict, memory_gb: Optional[float] = None) -> str:
    """A readable table of :func:`memory_plan`'s result (GB = 1e9 bytes), with a warning line
    when a rank's total exceeds ``memory_gb``."""
    m = plan["mesh"]
    head = (f"memory plan: {plan['model']} on {m['nproc']} ranks (tp={m['tp']} ep={m['ep']} fsdp={m['fsdp']} "
            f"efsdp={m['efsdp']} dp_replicate={m['dp_replicate']}), batch {plan['batch']} x seq {plan['seq']}, "
            f"{plan['dtype']}, remat {plan['remat']}, grad_accum {plan['grad_accum']}"
            + (f", pp {m['pp']} ({plan['pp_schedule']}, {plan['microbatches']} micro-batches)" if m["pp"] > 1 else "")
            + (", sp" if m["sp"] else "") + (", optimizer in backward" if plan["optim_in_backward"] else ""))
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

