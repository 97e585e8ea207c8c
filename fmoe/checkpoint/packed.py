"""Packed leaves in a training checkpoint: the blocks DCP saves and loads, and their way back.

A leaf placed with ``P(..., packed=k)`` (a fused ``[gate | up]`` weight split per half over tp)
is not one plain shard per rank, so DCP cannot reshard it as a whole: :func:`dcp_view` saves it
as ``k`` blocks along its packed dim (``PATH.__block{j}``), each a plainly sharded tensor, and
:func:`restore` concatenates the loaded blocks back into the leaf. Every other leaf is saved and
loaded in place. The layout (``{path: (k, dim)}``) is :func:`fmoe.checkpoint.training.packed_layout`;
:func:`saved_paths` lists the leaves a checkpoint holds.
"""

from __future__ import annotations

from typing import Any, Collection

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .. import tree as _tree
from ..sharding import local_shard

__all__ = ["dcp_view", "restore", "views", "saved_paths"]


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


def dcp_view(tree: Any, packed: dict[str, tuple[int, int]], skip: Collection[str] = ()) -> dict[str, Any]:
    """Flat ``{key: tensor}`` that DCP can save/load; packed leaves split into blocks; the paths
    in ``skip`` left out (leaves a checkpoint lacks, kept as they are)."""
    out: dict[str, Any] = {}
    for path, leaf in _tree.flatten(tree).items():
        if path in skip:
            continue
        if path in packed:
            for j, b in enumerate(_blocks(path, leaf, *packed[path])):
                out[f"{path}.__block{j}"] = b
        else:
            out[path] = leaf
    return out


def restore(tree: Any, view: dict[str, Any], packed: dict[str, tuple[int, int]]) -> None:
    """Copy loaded packed blocks back into their leaves (other leaves were loaded in place)."""
    with torch.no_grad():
        for path, leaf in _tree.flatten(tree).items():
            if path in packed:
                k, d = packed[path]
                blocks = [view[f"{path}.__block{j}"] for j in range(k)]
                local_shard(leaf).copy_(torch.cat([local_shard(b) for b in blocks], dim=d))


def views(params: Any, opt_state: Any, packed: dict, skip: Collection[str] = ()) -> dict:
    """What DCP saves and loads: the parameters and the optimizer state, packed leaves as blocks
    (``skip``: as :func:`dcp_view`'s)."""
    return {"params": dcp_view(params, packed, skip),
            "opt": {"step": opt_state["step"], "m": dcp_view(opt_state["m"], packed, skip),
                    "v": dcp_view(opt_state["v"], packed, skip)}}


def saved_paths(ckpt: str) -> set[str]:
    """The parameter paths a training checkpoint directory holds (a packed leaf by its own path);
    reads the safetensors headers only (JSON)."""
    keys = dcp.HuggingFaceStorageReader(ckpt).read_metadata().state_dict_metadata
    return {k[len("params."):].split(".__block")[0] for k in keys if k.startswith("params.")}
