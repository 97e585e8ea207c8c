"""Resumable sharded training checkpoints: ``OUT/step-N/`` via ``torch.distributed.checkpoint``.

A checkpoint holds the parameters, the optimizer state, the step (which is also the data
position: batches are a pure function of the step) and the job's config. Every rank writes its
own shards (DCP), so saving never gathers a model, and loading on another mesh reshards: DCP
reads, for each destination shard, exactly the overlapping pieces of the saved shards.

Packed placements (a fused ``[gate | up]`` weight split per block) are not contiguous chunks of
the full tensor, which DCP cannot describe; such a leaf is stored as one tensor per block
(``path.__block0``, ``path.__block1``), each a plain chunked shard, so it reshards like any other
— also to and from a single process, where the same leaf is a plain tensor.

Atomicity: all ranks write into ``OUT/.step-N.tmp``; after a barrier rank 0 writes
``meta.json`` into it and renames the directory to ``OUT/step-N``. A crash at any point leaves
either the previous checkpoints untouched or a ``.tmp`` directory, which :func:`latest` never
picks (and the next save removes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .. import tree as _tree
from ..collectives import barrier

__all__ = ["save", "load", "latest", "read_meta", "packed_layout"]

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    barrier()


def packed_layout(plan: Any, params: Any, mesh: Any = None) -> dict[str, tuple[int, int]]:
    """``{path: (blocks, dim)}`` of every packed leaf under ``plan`` (mesh-independent)."""
    out = {}
    for path, p in _tree.flatten(plan.resolve(params, mesh)).items():
        if p.packed > 1:
            out[path] = (p.packed, p.packed_dim)
    return out


def _blocks(path: str, leaf: Any, k: int, d: int) -> list[Any]:
    """The ``k`` blocks of a packed leaf along ``d``, each a plain-chunked tensor/DTensor."""
    if not isinstance(leaf, DTensor):
        return [b.contiguous() for b in leaf.detach().chunk(k, dim=d)]
    pls = []
    for p in leaf.placements:
        if isinstance(p, _StridedShard) and p.dim == d and p.split_factor == k:
            pls.append(Shard(d))
        elif isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim == d:
            raise ValueError(f"checkpoint: {path!r} is saved as {k} packed blocks on dim {d}, but this "
                             f"DTensor splits dim {d} without packing ({leaf.placements})")
        else:
            pls.append(p)
    shape = list(leaf.shape)
    shape[d] //= k
    return [DTensor.from_local(b.contiguous(), leaf.device_mesh, pls, run_check=False,
                               shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
            for b in leaf._local_tensor.detach().chunk(k, dim=d)]


def _dcp_view(tree: Any, packed: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Flat ``{key: tensor}`` that DCP can save/load; packed leaves split into blocks."""
    out: dict[str, Any] = {}
    for path, leaf in _tree.flatten(tree).items():
        if path in packed:
            for j, b in enumerate(_blocks(path, leaf, *packed[path])):
                out[f"{path}.__block{j}"] = b
        else:
            out[path] = leaf
    return out


def _restore(tree: Any, view: dict[str, Any], packed: dict[str, tuple[int, int]]) -> None:
    """Copy loaded packed blocks back into their leaves (other leaves were loaded in place)."""
    with torch.no_grad():
        for path, leaf in _tree.flatten(tree).items():
            if path in packed:
                k, d = packed[path]
                blocks = [view[f"{path}.__block{j}"] for j in range(k)]
                blocks = [b._local_tensor if isinstance(b, DTensor) else b for b in blocks]
                dst = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
                dst.copy_(torch.cat(blocks, dim=d))


def _views(params: Any, opt_state: Any, packed: dict) -> dict:
    return {"params": _dcp_view(params, packed),
            "opt": {"step": opt_state["step"], "m": _dcp_view(opt_state["m"], packed),
                    "v": _dcp_view(opt_state["v"], packed)}}


def save(out_dir: str, step: int, params: Any, opt_state: Any, meta: dict,
         packed: Optional[dict] = None) -> str:
    """Write ``out_dir/step-{step}`` atomically; call on every rank. Returns the final path.

    Args:
        out_dir: the run directory.
        step: steps done.
        params, opt_state: trees to save (any placements).
        meta: JSON-able job description (config, mesh, data settings).
        packed: :func:`packed_layout` of the params (leaves stored as blocks).
    """
    packed = packed or {}
    final = os.path.join(out_dir, f"step-{step}")
    tmp = os.path.join(out_dir, f".step-{step}.tmp")
    rank0 = not _dist() or dist.get_rank() == 0
    if rank0:
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(out_dir):                 # leftovers of an interrupted save
            if name.startswith(".step-") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dcp.save(_views(params, opt_state, packed), checkpoint_id=tmp)
    _barrier()
    if rank0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "step": step}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            old = final + ".old.tmp"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    _barrier()
    return final


def latest(path: str) -> Optional[str]:
    """``path`` itself if it is a complete ``step-N`` checkpoint, else the complete ``step-N``
    with the largest N inside it (None if there is none)."""
    if os.path.isfile(os.path.join(path, "meta.json")) and _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        return path
    if not os.path.isdir(path):
        return None
    steps = [(int(m.group(1)), name) for name in os.listdir(path) if (m := _STEP_DIR.match(name))
             and os.path.isfile(os.path.join(path, name, "meta.json"))]
    return os.path.join(path, max(steps)[1]) if steps else None


def read_meta(ckpt: str) -> dict:
    """The ``meta.json`` of a complete checkpoint (``ValueError`` naming the path otherwise)."""
    meta = os.path.join(ckpt, "meta.json")
    if not os.path.isfile(meta):
        raise ValueError(f"{ckpt!r} is not a complete fmoe training checkpoint (no meta.json)")
    with open(meta) as f:
        return json.load(f)


def load(ckpt: str, params: Any, opt_state: Any, packed: Optional[dict] = None) -> dict:
    """Load a checkpoint into ``params`` and ``opt_state`` in place (any mesh: DCP reshards);
    call on every rank with the same ``packed`` layout as the save. Returns the meta."""
    meta = read_meta(ckpt)
    packed = packed or {}
    state = _views(params, opt_state, packed)
    with torch.no_grad():
        dcp.load(state, checkpoint_id=ckpt)
        opt_state["step"].copy_(state["opt"]["step"])
    _restore(params, state["params"], packed)
    _restore(opt_state["m"], state["opt"]["m"], packed)
    _restore(opt_state["v"], state["opt"]["v"], packed)
    return meta
