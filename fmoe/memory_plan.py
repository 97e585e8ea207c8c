"""How much memory and traffic each rank of a training job needs, before running it.

:func:`memory_plan` lays the model out exactly as ``python -m fmoe.train`` would (the model's
plan plus the data-parallel splits of :func:`fmoe.fsdp.data_parallel_plan`, on a virtual
mesh: no process group, no tensor allocated — parameters are built on the ``meta`` device) and
counts, per rank:

- ``params_bytes``: the local slices of the fp32 master weights (exact);
- ``grads_bytes``: the reduced fp32 gradients, placed like the parameters, of every leaf that
  requires grad (exact);
- ``optimizer_bytes``: AdamW's two fp32 moments of every leaf plus the int64 step (exact);
- ``activations_bytes``: tensors kept for backward at the end of forward (an estimate, below);
- ``collective_bytes``: bytes this rank sends per step (an estimate, below);
- ``total_bytes``: params + grads + optimizer + activations.

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
reduce-scatter of gradients, ``3 (n - 1) / n`` of the gathered bytes; the dispatch and combine
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

from . import tree as _tree
from .mesh import RankLayout
from .plan import local_shape

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


def _layer_widths(cfg: Any) -> dict:
    g = lambda *names, default=0: next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), default)  # noqa: E731
    D = cfg.hidden_size
    H = g("num_attention_heads", default=1)
    hd = g("head_dim", default=D // H)
    return {"D": D, "H": H, "G": g("num_key_value_heads", default=H), "hd": hd, "V": cfg.vocab_size,
            "E": g("num_experts", "num_local_experts", "n_routed_experts"),
            "K": g("num_experts_per_tok", "experts_per_token"),
            "I": g("moe_intermediate_size", "intermediate_size"), "Id": g("intermediate_size"),
            "L": cfg.num_hidden_layers}


def activation_estimate(cfg: Any, *, tokens: int, tp: int, moe_layers: int, dense_layers: int,
                        dtype: str = "fp32", remat: str = "none", weight_bytes: int = 0) -> int:
    """Bytes saved for backward on one rank (see the module docstring for the formula).

    Args:
        cfg: model config (Hugging Face field names).
        tokens: T, tokens per rank and micro-batch (``batch * seq``).
        tp: tensor-parallel size.
        moe_layers, dense_layers: layer counts by feed-forward kind.
        dtype: ``"fp32"`` or ``"bf16"``.
        remat: ``"none"``, ``"layer"`` or ``"moe"``.
        weight_bytes: fp32 bytes of the dense (non-expert) weights one rank's matmuls use in a
            forward, after FSDP gathering (autocast saves a bf16 copy of each for backward).
    """
    w, T = _layer_widths(cfg), tokens
    q, kv = w["H"] * w["hd"] / tp, w["G"] * w["hd"] / tp
    attn = 24 * T * w["D"] + 16 * T * (q + kv) + 6 * T * (w["H"] + w["G"]) / tp + 20 * T
    R = T * w["K"] / tp
    experts = R * (8 * w["D"] + 8 * w["I"])
    moe = 4 * T * w["E"] + 40 * T * w["K"] + experts
    dense = 12 * T * w["Id"] / tp
    glob = 12 * T * w["D"] + 4 * T * w["V"]
    layer_in = 4 * T * w["D"]
    if remat == "layer":
        per_layer = moe_layers * layer_in + dense_layers * layer_in
        per_layer += max(attn + moe if moe_layers else 0, attn + dense if dense_layers else 0)
    elif remat == "moe":
        per_layer = moe_layers * (attn + moe - experts) + dense_layers * (attn + dense) + (experts if moe_layers else 0)
    else:
        per_layer = moe_layers * (attn + moe) + dense_layers * (attn + dense)
    if dtype == "bf16":                 # bf16 copies of dense matmul inputs / weights; q, k, v in bf16
        layers = moe_layers + dense_layers
        per_layer += layers * (8 * T * w["D"] - 8 * T * (q + kv))
        glob += weight_bytes // 2
    return int(per_layer + glob)


def _default_plan(model: Any, cfg: Any, tp: int):
    from .model import model_of

    return model_of(model).build_plan(cfg, tp=tp)


def memory_plan(model: Any, cfg: Any, *, nproc: int, tp: int = 1, ep: Optional[int] = None, dp_replicate: int = 1,
                batch: int = 4, seq: int = 64, dtype: str = "fp32", remat: str = "none", grad_accum: int = 1,
                model_plan: Any = None) -> dict:
    """Per-rank memory and traffic of training ``model`` on ``nproc`` ranks (no process needed).

    Args:
        model: a model module of :mod:`fmoe.models`; cfg: its Config.
        nproc, tp, ep, dp_replicate: the mesh (``fsdp = nproc / (tp * dp_replicate)``).
        batch, seq: sequences per data-parallel micro-batch and tokens per sequence.
        dtype: ``"fp32"`` or ``"bf16"`` compute (masters, grads, moments stay fp32).
        remat: ``"none"``, ``"layer"`` or ``"moe"``.
        grad_accum: micro-batches per step (activations are those of one micro-batch).
        model_plan: the model's TP/EP plan (default: the model's own).
    Returns:
        ``{"model", "mesh", "batch", "seq", "dtype", "remat", "ranks": [{rank, params_bytes,
        grads_bytes, optimizer_bytes, activations_bytes, collective_bytes, total_bytes}],
        "max_total_bytes"}``.
    """
    from .fsdp import data_parallel_plan

    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"memory plan: dtype must be 'fp32' or 'bf16', got {dtype!r}")
    if remat not in ("none", "layer", "moe"):
        raise ValueError(f"memory plan: remat must be 'none', 'layer' or 'moe', got {remat!r}")
    m0 = VirtualMesh(nproc, 0, tp, ep, dp_replicate)          # mesh errors first, before any model work
    with torch.device("meta"):
        full = model.init(cfg)
    flat = _tree.flatten(full)
    mp = model_plan if model_plan is not None else _default_plan(model, cfg, tp)
    w = _layer_widths(cfg)
    moe_layers = sum(1 for p in flat if p.endswith("moe.router"))
    ranks = []
    for r in range(nproc):
        mesh = VirtualMesh(nproc, r, tp, ep, dp_replicate)
        placed = _tree.flatten(data_parallel_plan(mp, full, mesh).resolve(full, mesh))
        params = grads = 0
        dense_mm = collective = 0.0
        for path, t in flat.items():
            p = placed[path]
            n = _numel(local_shape(tuple(t.shape), p, mesh))
            params += n * _F32
            if not path.endswith("expert_bias"):
                grads += n * _F32
            data = [a for a in p.mesh_axes() if a in ("fsdp", "efsdp")]
            k = math.prod(mesh.size(a) for a in data) if data else 1
            if "ep" not in p.mesh_axes() and len(t.shape) >= 2 and path != "embed":
                dense_mm += n * k * _F32                             # gathered for a matmul
            collective += 3 * (k - 1) * n * _F32 * grad_accum        # gather, re-gather, reduce-scatter
            if mesh.dp_replicate > 1:
                collective += 2 * (mesh.dp_replicate - 1) / mesh.dp_replicate * n * _F32
        T = batch * seq
        R = T * w["K"] / tp if moe_layers else 0
        act_bytes = 2 if dtype == "bf16" else 4
        collective += grad_accum * moe_layers * 4 * R * (mesh.ep - tp) / mesh.ep * w["D"] * act_bytes
        collective += grad_accum * w["L"] * 4 * 2 * (tp - 1) / tp * T * w["D"] * act_bytes
        acts = activation_estimate(cfg, tokens=T, tp=tp, moe_layers=moe_layers,
                                   dense_layers=w["L"] - moe_layers, dtype=dtype, remat=remat,
                                   weight_bytes=int(dense_mm))
        optimizer = 2 * params + _STEP
        ranks.append({"rank": r, "params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optimizer,
                      "activations_bytes": acts, "collective_bytes": int(collective),
                      "total_bytes": params + grads + optimizer + acts})
    return {"model": getattr(model, "__name__", str(model)).rsplit(".", 1)[-1],
            "mesh": {"nproc": nproc, "tp": tp, "ep": m0.ep, "fsdp": m0.fsdp, "efsdp": m0.efsdp,
                     "dp_replicate": dp_replicate},
            "batch": batch, "seq": seq, "dtype": dtype, "remat": remat, "grad_accum": grad_accum,
            "ranks": ranks, "max_total_bytes": max(r["total_bytes"] for r in ranks)}


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

