"""Save and load any tree of tensors (plain or DTensor leaves), pickle-free, resharding on load.

``fmoe.save(tree, dir)`` writes the tree as a safetensors directory (the storage the trainer and
the HF checkpoints use: :func:`fmoe.checkpoint.safetensors_io.write_checkpoint` inside an
:func:`fmoe.checkpoint.atomic.atomic_directory`, so a crash leaves the previous directory
intact): one tensor per dotted path, full (DTensor leaves are gathered first), plus a
``config.json`` that records the paths. ``fmoe.load(dir, like=...)`` reads it back:

- ``like`` a tree: the result has ``like``'s structure, dtypes and placements. A DTensor leaf of
  ``like`` makes each rank read only its own block from the file (memory-mapped) and wrap it as a
  DTensor placed like that leaf: a tree saved on one mesh (or one process) loads onto any other.
- ``like`` a :class:`fmoe.Plan` (with ``mesh``): every leaf in the file, placed by the plan.
- ``like`` None: plain full tensors.

Call both on every rank (``save`` runs one collective per sharded leaf; rank 0 writes).

Example:
    >>> import tempfile, torch, fmoe
    >>> d = tempfile.mkdtemp() + "/tree"
    >>> fmoe.save({"w": torch.ones(2, 3), "opt": {"step": torch.tensor(4)}}, d)
    >>> back = fmoe.load(d)
    >>> back["w"].shape, int(back["opt"]["step"])
    (torch.Size([2, 3]), 4)
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import tree as _tree
from ..collectives import barrier
from ..mesh import Mesh
from ..sharding import Plan, from_local_slice, gather, placement_of, rank_blocks
from .atomic import atomic_directory
from .safetensors_io import CONFIG, Checkpoint, write_checkpoint

__all__ = ["save", "load"]

FORMAT = "fmoe.tree/1"


def _skeleton(tree: Any) -> Any:
    """The tree's structure as JSON: dicts and lists as themselves, every leaf ``0``."""
    if isinstance(tree, dict):
        return {k: _skeleton(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_skeleton(v) for v in tree]
    return 0


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save(tree: Any, path: Union[str, os.PathLike]) -> None:
    """Write ``tree`` (nested dicts of tensors / DTensors) to directory ``path``, atomically.

    Args:
        tree: the tree; every leaf a tensor (DTensor leaves are gathered to full tensors).
        path: the directory (replaced as a whole when it exists).
    Raises:
        TypeError: a leaf that is not a tensor (named by its path).
    """
    flat = _tree.flatten(tree)
    bad = {k: type(v).__name__ for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    if bad:
        raise TypeError(f"fmoe.save: every leaf must be a tensor, got {bad}")
    full = _tree.flatten(gather(flat))
    if _rank() == 0:
        with atomic_directory(path) as tmp:
            write_checkpoint(tmp, {k: v.detach().reshape(-1) if v.ndim == 0 else v.detach() for k, v in full.items()},
                             {"format": FORMAT, "paths": list(full), "structure": _skeleton(tree),
                              "scalars": [k for k, v in full.items() if v.ndim == 0]})
    barrier()


def _shape(ck: Checkpoint, key: str) -> tuple[int, ...]:
    return () if key in ck.config["scalars"] else ck.shape(key)


def _whole(ck: Checkpoint, key: str) -> torch.Tensor:
    """The whole tensor ``key`` (0-dim tensors are stored as one element: safetensors slices
    cannot index a 0-dim tensor)."""
    return ck.read(key).reshape(_shape(ck, key))


def _read(ck: Checkpoint, key: str, like: Any, mesh: Optional[Mesh]) -> torch.Tensor:
    shape = _shape(ck, key)
    if isinstance(like, torch.Tensor) and tuple(like.shape) != shape:
        raise ValueError(f"fmoe.load: {key!r} has shape {shape} in {ck.path!r} but like holds {tuple(like.shape)}")
    dtype = like.dtype if isinstance(like, torch.Tensor) else None
    if not isinstance(like, DTensor):
        t = _whole(ck, key)
        return t if dtype is None else t.to(dtype)
    if mesh is None:
        raise ValueError(f"fmoe.load: like[{key!r}] is a DTensor; pass mesh= (the fmoe.Mesh it lives on)")
    p = placement_of(like)
    if not p.sharded_dims():
        return from_local_slice(_whole(ck, key).to(dtype), shape, p, mesh).requires_grad_(like.requires_grad)
    blocks, dim = rank_blocks(shape, p, mesh)
    parts = [ck.read(key, b) for b in blocks]
    local = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)).to(dtype).contiguous()
    return from_local_slice(local, shape, p, mesh).requires_grad_(like.requires_grad)


def load(path: Union[str, os.PathLike], like: Union[Any, Plan, None] = None, mesh: Optional[Mesh] = None) -> Any:
    """Read a tree written by :func:`save`, placed like ``like`` (see the module docstring).

    Args:
        path: the directory.
        like: a tree (structure, dtypes, placements), a :class:`Plan`, or None (plain tensors).
        mesh: the :class:`Mesh` of ``like``'s DTensor leaves or of the plan.
    Returns:
        the tree.
    Raises:
        ValueError: not a tree directory, a path of ``like`` missing from it, or a shape mismatch.
    """
    with Checkpoint(path) as ck:
        if ck.config.get("format") != FORMAT:
            raise ValueError(f"fmoe.load: {os.path.join(os.fspath(path), CONFIG)} is not an fmoe.save "
                             f"directory (format {ck.config.get('format')!r}, expected {FORMAT!r})")
        saved = list(ck.config["paths"])
        structure = ck.config["structure"]
        build = lambda flat: _tree.unflatten(flat, like=structure)  # noqa: E731
        if isinstance(like, Plan):
            full = {k: torch.empty(_shape(ck, k), dtype=ck.dtype(k), device="meta") for k in saved}
            placements = _tree.flatten(like.resolve(build(full), mesh if mesh is not None else Mesh()))
            if mesh is None or mesh.dense is None:
                return build({k: _whole(ck, k) for k in saved})
            out = {}
            for k in saved:
                if not placements[k].sharded_dims():
                    out[k] = from_local_slice(_whole(ck, k), _shape(ck, k), placements[k], mesh)
                    continue
                blocks, dim = rank_blocks(ck.shape(k), placements[k], mesh)
                parts = [ck.read(k, b) for b in blocks]
                local = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)).contiguous()
                out[k] = from_local_slice(local, ck.shape(k), placements[k], mesh)
            return build(out)
        if like is None:
            return build({k: _whole(ck, k) for k in saved})
        flat_like = _tree.flatten(like)
        missing = sorted(set(flat_like) - set(saved))
        if missing:
            raise ValueError(f"fmoe.load: {path!r} has no {missing[:5]} (it holds {saved[:5]}...)")
        out = {k: _read(ck, k, v, mesh) for k, v in flat_like.items()}
        return _tree.unflatten(out, like=like)
