"""The dry run: the real train step of a full-size job, per rank role, on fake tensors.

``fmoe memory --dry-run`` calls :func:`dry_run_report`, which runs :func:`dry_run`. For each
distinct **rank role** of the mesh (ranks whose local parameter shapes and token slices are the
same measure the same, so one of them runs) it:

1. starts torch's ``"fake"`` process group (``FakeStore``: collectives return at once, no peers)
   as that rank of ``nproc`` and builds the job's :class:`fmoe.Mesh` on it;
2. under ``FakeTensorMode`` (tensors with shapes and dtypes, no storage) creates this rank's
   local parameter slices in the master dtype exactly as ``fmoe.shard`` would place them (the
   model's plan plus the data-parallel splits) and AdamW's moments in the optimizer dtype;
3. runs :func:`fmoe.training.step.train_step` — the same function the trainer calls: forward,
   loss, backward, gradient reduction, AdamW with stochastic rounding for bf16 weights,
   the optimizer writing in place as in the trainer — inside a :class:`StepTracker` (memory by
   category at the peak), a :class:`CollectiveBytes` counter and the :class:`HostReads` rule.

Routing cannot depend on data here: split sizes follow :mod:`fmoe.experts.fake_splits` (every token on
``min(K, ep)`` expert ranks, slots even over experts), which :mod:`fmoe.memory.plan` uses too.

The step runs on the device given: ``cpu``, or ``cuda`` on a CUDA build of torch. A CPU-only
build cannot run backward on fake CUDA tensors (the autograd engine asks the CUDA device guard
for streams and aborts), so there ``--device cuda`` is refused with that reason; fake CPU tensors
take the CPU paths (e.g. the blocked expert kernel for bf16 rows where CUDA takes
``torch._grouped_mm``).

Example:
    >>> from fmoe.models import qwen3_moe
    >>> out = dry_run(qwen3_moe, qwen3_moe.Config.tiny(), nproc=2, ep=2, batch=1, seq=8)
    >>> [r["rank"] for r in out["ranks"]], out["ranks"][0]["measured"]["peak_bytes"] > 0
    ([0, 1], True)
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import tree as _tree
from .plan import VirtualMesh
from ..sharding import local_shape
from ..precision import Precision
from ..routing.state import is_state
from .tracker import CATEGORIES, CollectiveBytes, HostReads, StepTracker

__all__ = ["dry_run", "dry_run_report", "format_report", "rank_roles", "check_device", "StepTracker",
           "CollectiveBytes", "HostReads", "CATEGORIES", "CATEGORY_KEYS"]

#: the byte categories a rank reports, planned and measured alike
CATEGORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes")


def check_device(device: str) -> torch.device:
    """The dry run's device (``"auto"``: cuda on a CUDA build of torch, else cpu); ``ValueError``
    for ``cuda`` on a torch without CUDA (see above)."""
    if device == "auto":
        device = "cuda" if torch.backends.cuda.is_built() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"dry run: device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.backends.cuda.is_built():
        raise ValueError("dry run --device cuda: this torch build has no CUDA; its autograd engine aborts on "
                         "fake CUDA tensors in backward, so the step cannot run. Use --device cpu (same shapes "
                         "and dtypes, CPU expert kernels) or a CUDA build of torch")
    return torch.device(device)


def _placements(model: Any, cfg: Any, mesh) -> tuple[dict, dict, Any]:
    """Full meta shapes of this rank's pipeline stage and its placements (the trainer's plan,
    data-parallel splits), by path, and the stage's tree (other stages' layers None)."""
    from ..model import model_of
    from ..training.pipeline import stage_plan, stage_tree

    with torch.device("meta"):
        whole = model.init(cfg)
    m = model_of(model)                                 # the trainer's plan of the whole model, then the stage's
    plan = m.build_plan(cfg, m.build_plan(cfg, mesh=mesh), mesh, whole, data_parallel=True)
    plan, full = stage_plan(plan, whole, mesh.stage, mesh.pp), stage_tree(whole, mesh.stage, mesh.pp)
    return _tree.flatten(full), _tree.flatten(plan.resolve(full, mesh)), full


def rank_roles(model: Any, cfg: Any, *, nproc: int, tp: int = 1, ep: Optional[int] = None,
               dp_replicate: int = 1, tokens: int = 1, pp: int = 1, sp: bool = False, cp: int = 1) -> list[list[int]]:
    """Ranks grouped by role: equal local shapes of every leaf and equal token slice (the TP
    slice a rank dispatches) measure the same, so the dry run runs the first of each group.

    Example:
        >>> from fmoe.models import qwen3_moe
        >>> rank_roles(qwen3_moe, qwen3_moe.Config.tiny(), nproc=4, tp=2, ep=4, tokens=8)
        [[0, 1, 2, 3]]
    """
    from ..ep.token_dispatch import tp_slice_bounds

    roles: dict[tuple, list[int]] = {}
    for r in range(nproc):
        mesh = VirtualMesh(nproc, r, tp, ep, dp_replicate, pp, sp, cp)
        full, placed, _ = _placements(model, cfg, mesh)
        a, b = tp_slice_bounds(tokens // cp, tp, mesh.rank_in("tp"))
        key = (b - a, mesh.stage) + tuple(local_shape(tuple(t.shape), placed[p], mesh) for p, t in full.items())
        roles.setdefault(key, []).append(r)
    return list(roles.values())


def _fake_params(model: Any, cfg: Any, mesh, dtype: torch.dtype, device: torch.device) -> Any:
    """This rank's parameter slices as fake DTensors, placed as ``fmoe.shard`` places them."""
    from ..sharding import from_local_slice

    _, placed, tree = _placements(model, cfg, mesh)

    def fake(path: str, t: torch.Tensor) -> torch.Tensor:
        local = torch.empty(local_shape(tuple(t.shape), placed[path], mesh), dtype=dtype, device=device)
        return from_local_slice(local, t.shape, placed[path], mesh).requires_grad_(not is_state(path))

    return _tree.map_with_path(fake, tree)


def _run_rank(model, cfg, rank: int, *, nproc, tp, ep, dp_replicate, batch, seq, precision: Precision,
              remat, grad_accum, device, aux_weight, loss_chunks, parallel: dict) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .. import Mesh
    from ..model import model_of
    from ..optim import AdamWConfig
    from ..optim.adamw import init as adamw_init
    from ..training.step import StepConfig, train_step

    if dist.is_initialized():
        raise RuntimeError("dry run: a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=nproc)
    try:
        mesh = Mesh(tp=tp, ep=ep, dp_replicate=dp_replicate, device_type=device.type, pp=parallel["pp"],
                    sp=parallel["sp"], cp=parallel["cp"])
        cfg = model_of(model).with_aux_loss(cfg, aux_weight)
        step_cfg = StepConfig(opt=AdamWConfig(max_grad_norm=parallel["clip"] or None), dtype=precision.compute,
                              remat=remat, grad_accum=grad_accum, pp_schedule=parallel["pp_schedule"],
                              round_seed=0 if precision.master == "bf16" else None, donate=True,
                              loss_chunks=loss_chunks, optim_in_backward=parallel["optim_in_backward"])
        t0 = time.perf_counter()
        with FakeTensorMode(), HostReads():
            params = _fake_params(model, cfg, mesh, precision.master_dtype, device)
            opt_state = adamw_init(params, dtype=precision.optim_dtype)
            tokens = torch.zeros(batch * grad_accum, seq, dtype=torch.int64, device=device)
            tracker, comm = StepTracker(), CollectiveBytes()
            tracker.tag(params, "params")
            tracker.tag(opt_state, "optimizer")
            with tracker, comm:
                train_step(model, cfg, params, opt_state, (tokens, tokens), mesh=mesh, step_cfg=step_cfg, lr=1e-4)
        measured = {**tracker.peak(), "max_grads_bytes": tracker.max_grads_bytes, "collective_bytes": sum(comm.bytes.values()), "collectives": comm.bytes}
        return {"rank": rank, "measured": measured, "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        dist.destroy_process_group()


def dry_run(model: Any, cfg: Any, *, nproc: int, tp: int = 1, ep: Optional[int] = None, dp_replicate: int = 1,
            batch: int = 1, seq: int = 64, dtype: str = "fp32", master_dtype: str = "fp32",
            optim_dtype: str = "fp32", remat: str = "none", grad_accum: int = 1, loss_chunks: int = 1,
            device: str = "cpu", aux_weight: float = 0.01, optim_in_backward: bool = False,
            clip: Optional[float] = 1.0, sp: bool = False, pp: int = 1, microbatches: Optional[int] = None,
            pp_schedule: str = "1f1b", cp: int = 1) -> dict:
    """Measure one train step of every rank role on fake tensors (module docstring).

    Args:
        model, cfg: a model module of :mod:`fmoe.models` and its Config (any size: no weights).
        nproc, tp, ep, dp_replicate: the mesh, as the job's flags.
        batch, seq, dtype, master_dtype, optim_dtype, remat, grad_accum, loss_chunks, optim_in_backward,
            clip, sp, pp, microbatches, pp_schedule, cp: the job's flags (``batch``: rows per data-parallel
            batch; with ``pp`` split into ``microbatches`` (default ``pp``), without it each of the
            ``grad_accum`` micro-batches has ``batch`` rows).
        device: ``"cpu"`` or ``"cuda"`` (see :func:`check_device`).
        aux_weight: the router loss weight, as ``--aux-weight``.
    Returns:
        ``{"roles": [[ranks]], "ranks": [{"rank", "role", "measured": {"peak_bytes",
        "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
        "temporaries_bytes", "max_grads_bytes", "collective_bytes", "collectives": {op: bytes}},
        "seconds"}]}`` (``max_grads_bytes``: the most gradient bytes alive at any moment),
        every rank listed (a rank reports its role's measurement).
    """
    precision = Precision(dtype, master_dtype, optim_dtype)
    dev = check_device(device)
    VirtualMesh(nproc, 0, tp, ep, dp_replicate, pp, sp, cp)          # mesh errors before any work
    M = (microbatches or pp) if pp > 1 else 1
    if batch % M:
        raise ValueError(f"dry run: microbatches={M} must divide batch={batch} (each micro-batch is batch / M rows)")
    parallel = {"pp": pp, "sp": sp, "cp": cp, "microbatches": M, "pp_schedule": pp_schedule, "clip": clip,
                "optim_in_backward": optim_in_backward}
    roles = rank_roles(model, cfg, nproc=nproc, tp=tp, ep=ep, dp_replicate=dp_replicate, tokens=batch // M * seq,
                       pp=pp, sp=sp, cp=cp)
    ranks = {}
    for i, members in enumerate(roles):
        run = _run_rank(model, cfg, members[0], nproc=nproc, tp=tp, ep=ep, dp_replicate=dp_replicate,
                        batch=batch // M, seq=seq, precision=precision, remat=remat, grad_accum=grad_accum * M,
                        device=dev, aux_weight=aux_weight, loss_chunks=loss_chunks, parallel=parallel)
        for r in members:
            ranks[r] = {**run, "rank": r, "role": i, "measured_rank": members[0]}
    return {"roles": roles, "ranks": [ranks[r] for r in range(nproc)]}


def dry_run_report(plan: dict, model: Any, cfg: Any, *, device: str = "auto",
                   memory_gb: Optional[float] = None) -> dict:
    """Run :func:`dry_run` for the job a :func:`fmoe.memory.plan.memory_plan` result describes
    and set each rank's measured bytes beside its planned ones.

    Args:
        plan: ``memory_plan(...)``'s result (its mesh and job fields say what runs).
        model, cfg: the model and Config the plan was made for.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (:func:`check_device`).
        memory_gb: when given, ``"fits"`` says whether every measured peak is within it.
    Returns:
        the plan's fields, plus ``"dry_run": True``, ``"device"``, ``"roles"``,
        ``"ranks": [{"rank", "role", "measured_rank", "planned": {total_bytes, <categories>,
        collective_bytes}, "measured": {peak_bytes, <categories>, collective_bytes, ...},
        "seconds"}]``, ``"max_peak_bytes"`` (and ``"fits"`` with ``memory_gb``).
    """
    dev = check_device(device).type
    m = plan["mesh"]
    out = dry_run(model, cfg, nproc=m["nproc"], tp=m["tp"], ep=m["ep"], dp_replicate=m["dp_replicate"],
                  batch=plan["batch"], seq=plan["seq"], dtype=plan["dtype"], master_dtype=plan["master_dtype"],
                  optim_dtype=plan["optim_dtype"], remat=plan["remat"], grad_accum=plan["grad_accum"],
                  loss_chunks=plan["loss_chunks"], device=dev, optim_in_backward=plan["optim_in_backward"],
                  clip=plan["clip"], sp=m["sp"], pp=m["pp"], microbatches=plan["microbatches"],
                  pp_schedule=plan["pp_schedule"], cp=m.get("cp", 1))
    ranks = [{"rank": planned["rank"], "role": measured["role"], "measured_rank": measured["measured_rank"],
              "planned": {**planned["peak"], "collective_bytes": planned["collective_bytes"]},
              "measured": measured["measured"], "seconds": measured["seconds"]}
             for planned, measured in zip(plan["ranks"], out["ranks"])]
    result = {**{k: v for k, v in plan.items() if k != "ranks"}, "dry_run": True, "device": dev,
              "roles": out["roles"], "ranks": ranks, "max_peak_bytes": max(r["measured"]["peak_bytes"] for r in ranks)}
    if memory_gb is not None:
        result["fits"] = result["max_peak_bytes"] <= memory_gb * 1e9
    return result


def format_report(result: dict, memory_gb: Optional[float] = None) -> str:
    """A table of :func:`dry_run_report`'s result: per rank role, planned / measured GB by category."""
    m = result["mesh"]
    lines = [f"dry run: {result['model']} on {m['nproc']} ranks (tp={m['tp']} ep={m['ep']} fsdp={m['fsdp']}"
             + (f" cp={m['cp']}" if m.get("cp", 1) > 1 else "") + "), "
             f"batch {result['batch']} x seq {result['seq']}, dtype {result['dtype']}, master "
             f"{result['master_dtype']}, optim {result['optim_dtype']}, remat {result['remat']}, device "
             f"{result['device']}; GB = 1e9 bytes, planned / measured",
             f"{'ranks':>12} {'peak':>13} " + " ".join(f"{k[:-6]:>13}" for k in CATEGORY_KEYS) + f" {'sent':>13}"]
    for members in result["roles"]:
        r = result["ranks"][members[0]]
        p, x = r["planned"], r["measured"]
        cells = [f"{p['total_bytes'] / 1e9:6.2f}/{x['peak_bytes'] / 1e9:<6.2f}"]
        cells += [f"{p[k] / 1e9:6.2f}/{x[k] / 1e9:<6.2f}" for k in CATEGORY_KEYS]
        cells.append(f"{p['collective_bytes'] / 1e9:6.2f}/{x['collective_bytes'] / 1e9:<6.2f}")
        name = ",".join(map(str, members)) if len(members) <= 3 else f"{members[0]}..{members[-1]}"
        lines.append(f"{name:>12} " + " ".join(f"{c:>13}" for c in cells))
    if memory_gb is not None and not result.get("fits", True):
        lines.append(f"DOES NOT FIT: measured peak {result['max_peak_bytes'] / 1e9:.3g} GB exceeds --memory-gb {memory_gb}")
    return "\n".join(lines)
