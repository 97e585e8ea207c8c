"""Resumable sharded training checkpoints: ``OUT/step-N/`` via ``torch.distributed.checkpoint``.

A checkpoint holds the parameters, the optimizer state, the step (which is also the data
position: batches are a pure function of the step) and the job's config. Every rank writes its
own shards (DCP), so saving never gathers a model, and loading on another mesh reshards: DCP
reads, for each destination shard, exactly the overlapping pieces of the saved shards.

Packed placements (a fused ``[gate | up]`` weight split per block) are not contiguous chunks of
the full tensor, which DCP cannot describe; such a leaf is stored as one DTensor per block
(``path.__block0``, ``path.__block1``), each a plain chunked shard, so it reshards like any other.

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

__all__ = ["save", "load", "latest", "read_meta"]

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _dcp_view(tree: Any) -> dict[str, Any]:
    """Flat ``{key: tensor}`` that DCP can save/load; packed leaves split into blocks."""
    out: dict[str, Any] = {}
    for path, leaf in _tree.flatten(tree).items():
        if isinstance(leaf, DTensor) and any(isinstance(p, _StridedShard) for p in leaf.placements):
            (d, k) = next((p.dim, p.split_factor) for p in leaf.placements if isinstance(p, _StridedShard))
            pls = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in leaf.placements]
            shape = list(leaf.shape)
            shape[d] //= k
            for j, block in enumerate(leaf._local_tensor.chunk(k, dim=d)):
                out[f"{path}.__block{j}"] = DTensor.from_local(
                    block.contiguous(), leaf.device_mesh, pls, run_check=False, shape=torch.Size(shape),
                    stride=torch.empty(shape, device="meta").stride())
        else:
            out[path] = leaf
    return out


def _restore(tree: Any, view: dict[str, Any]) -> None:
    """Copy loaded packed blocks back into their leaves (other leaves were loaded in place)."""
    with torch.no_grad():
        for path, leaf in _tree.flatten(tree).items():
            if f"{path}.__block0" in view:
                d = next(p.dim for p in leaf.placements if isinstance(p, _StridedShard))
                blocks, j = [], 0
                while f"{path}.__block{j}" in view:
                    blocks.append(view[f"{path}.__block{j}"]._local_tensor)
                    j += 1
                leaf._local_tensor.copy_(torch.cat(blocks, dim=d))


def save(out_dir: str, step: int, params: Any, opt_state: Any, meta: dict) -> str:
    """Write ``out_dir/step-{step}`` atomically; call on every rank. Returns the final path."""
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
    state = {"params": _dcp_view(params), "opt": _dcp_view(opt_state)}
    dcp.save(state, checkpoint_id=tmp)
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


def load(ckpt: str, params: Any, opt_state: Any) -> dict:
    """Load a checkpoint into ``params`` and ``opt_state`` in place (any mesh: DCP reshards);
    call on every rank. Returns the checkpoint's meta (with ``step``)."""
    meta = read_meta(ckpt)
    state = {"params": _dcp_view(params), "opt": _dcp_view(opt_state)}
    with torch.no_grad():
        dcp.load(state, checkpoint_id=ckpt)
    _restore(params, state["params"])
    _restore(opt_state, state["opt"])
    return meta
