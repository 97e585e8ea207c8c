"""Spec combinators: build one fmoe tensor out of several checkpoint tensors.

Each node pushes a read's index down to its parts (see :mod:`fmoe.checkpoint.spec` for the
idea), so only the elements asked for are read, and inverts itself in ``split`` for saving:

==================================  =======================================================
``Cat(parts, dim)``                 fused ``[gate | up]`` rows from two keys
``Stack(parts, dim=0)``             per-expert keys -> ``[E, ...]``
``Transpose(part, d0, d1)``         ``x @ W`` checkpoint layouts -> fmoe's ``W @ x``
``Deinterleave(part, dim, n=2)``    gpt-oss interleaved ``gate_up`` -> ``[gate | up]`` blocks
==================================  =======================================================

Example:
    >>> import torch
    >>> s = Cat([Key("gate", (2, 3)), Key("up", (2, 3))], dim=0)
    >>> s.shape
    (4, 3)
    >>> sorted(s.split(torch.arange(12.0).view(4, 3)))
    ['gate', 'up']
"""

from __future__ import annotations

from typing import Sequence

import einops
import torch

from .spec import Index, Key, Spec, _check_dim, _clip, _replace, _size  # noqa: F401 (Key: docstring example)

__all__ = ["Cat", "Stack", "Transpose", "Deinterleave"]


def _check_parts(node: str, parts: Sequence[Spec]) -> list[Spec]:
    parts = list(parts) if isinstance(parts, (list, tuple)) else None
    if not parts or not all(isinstance(p, Spec) for p in parts):
        raise TypeError(f"{node}: parts must be a non-empty list of specs")
    return parts


def _check_part(node: str, part: Spec) -> Spec:
    if not isinstance(part, Spec):
        raise TypeError(f"{node}: part must be a spec, got {part!r}")
    return part


class Cat(Spec):
    """Concatenation of ``parts`` along ``dim`` (e.g. fused ``[gate | up]`` rows).

    Args:
        parts: specs whose shapes agree on every dim but ``dim``.
        dim: the concatenation dim.
    """

    def __init__(self, parts: Sequence[Spec], dim: int):
        self.parts = _check_parts("Cat", parts)
        first = self.parts[0].shape
        self.dim = _check_dim("Cat", dim, len(first))
        for p in self.parts:
            if len(p.shape) != len(first) or any(a != b for i, (a, b) in enumerate(zip(p.shape, first))
                                                 if i != self.dim):
                raise ValueError(f"Cat: part shapes must agree except on dim {self.dim}, got "
                                 f"{[q.shape for q in self.parts]} ({self.parts!r})")
        self.shape = _replace(first, self.dim, sum(p.shape[self.dim] for p in self.parts))

    def _rebuild(self, parts: list[Spec]) -> "Cat":
        return Cat(parts, self.dim)

    def _read(self, idx: Index) -> torch.Tensor:
        d, pieces, off = self.dim, [], 0
        for p in self.parts:
            local = _clip(idx[d], off, off + p.shape[d])
            if _size(local):
                pieces.append(p._read(_replace(idx, d, local)))
            off += p.shape[d]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)

    def _split(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        chunks = torch.split(full, [p.shape[self.dim] for p in self.parts], dim=self.dim)
        return _merge(p._split(c) for p, c in zip(self.parts, chunks))

    def __repr__(self) -> str:
        return f"Cat({self.parts!r}, dim={self.dim})"


class Stack(Spec):
    """``parts`` of equal shape stacked along a new ``dim`` (per-expert keys -> ``[E, ...]``).

    Args:
        parts: specs of one shape.
        dim: position of the new dim (default 0).
    """

    def __init__(self, parts: Sequence[Spec], dim: int = 0):
        self.parts = _check_parts("Stack", parts)
        first = self.parts[0].shape
        if any(p.shape != first for p in self.parts):
            raise ValueError(f"Stack: parts must share one shape, got {sorted({p.shape for p in self.parts})} "
                             f"({self.parts!r})")
        self.dim = _check_dim("Stack", dim, len(first) + 1)
        self.shape = first[:self.dim] + (len(self.parts),) + first[self.dim:]

    def _rebuild(self, parts: list[Spec]) -> "Stack":
        return Stack(parts, self.dim)

    def _read(self, idx: Index) -> torch.Tensor:
        d = self.dim
        rest = idx[:d] + idx[d + 1:]
        return torch.stack([p._read(rest) for p in self.parts[idx[d]]], dim=d)

    def _split(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        return _merge(p._split(t) for p, t in zip(self.parts, full.unbind(self.dim)))

    def __repr__(self) -> str:
        return f"Stack({self.parts!r}, dim={self.dim})"


class Transpose(Spec):
    """``part`` with dims ``d0`` and ``d1`` swapped (HF ``x @ W`` layouts vs fmoe ``W @ x``).

    Args:
        part: the spec to transpose.
        d0, d1: the two dims to swap.
    """

    def __init__(self, part: Spec, d0: int, d1: int):
        self.part = _check_part("Transpose", part)
        nd = len(part.shape)
        self.parts, self.d0, self.d1 = [part], _check_dim("Transpose", d0, nd), _check_dim("Transpose", d1, nd)
        self.shape = self._swap(part.shape)

    def _swap(self, seq: tuple) -> tuple:
        s = list(seq)
        s[self.d0], s[self.d1] = s[self.d1], s[self.d0]
        return tuple(s)

    def _rebuild(self, parts: list[Spec]) -> "Transpose":
        return Transpose(parts[0], self.d0, self.d1)

    def _read(self, idx: Index) -> torch.Tensor:
        return self.part._read(self._swap(idx)).transpose(self.d0, self.d1)

    def _split(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.part._split(full.transpose(self.d0, self.d1))

    def __repr__(self) -> str:
        return f"Transpose({self.part!r}, {self.d0}, {self.d1})"


class Deinterleave(Spec):
    """``part`` with ``n`` interleaved streams on ``dim`` laid out one block after another.

    gpt-oss keeps gate and up interleaved (``gate = x[..., ::2]``, ``up = x[..., 1::2]``);
    ``Deinterleave(part, dim, 2)`` is ``cat([x[..., ::2], x[..., 1::2]], dim)``: position
    ``k * L/n + j`` of the result is position ``j * n + k`` of ``part``. A range inside block
    ``k`` is a strided range of ``part``, so a read copies only the elements asked for.

    Args:
        part: the interleaved spec.
        dim: the interleaved dim (its size must be divisible by ``n``).
        n: number of interleaved streams.
    """

    def __init__(self, part: Spec, dim: int, n: int = 2):
        self.part = _check_part("Deinterleave", part)
        self.dim = _check_dim("Deinterleave", dim, len(part.shape))
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or part.shape[self.dim] % n:
            raise ValueError(f"Deinterleave: n must be an int >= 1 dividing dim {self.dim} of size "
                             f"{part.shape[self.dim]}, got n={n!r} ({part!r})")
        self.parts, self.n, self.shape = [part], n, part.shape

    def _rebuild(self, parts: list[Spec]) -> "Deinterleave":
        return Deinterleave(parts[0], self.dim, self.n)

    def _read(self, idx: Index) -> torch.Tensor:
        d, n = self.dim, self.n
        blk = self.shape[d] // n
        pieces = []
        for k in range(n):                       # block k of the result = stream k of part
            j = _clip(idx[d], k * blk, (k + 1) * blk)
            if _size(j):
                src = slice(j.start * n + k, (j.stop - 1) * n + k + 1, j.step * n)
                pieces.append(self.part._read(_replace(idx, d, src)))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)

    def _split(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        x = full.movedim(self.dim, -1)
        x = einops.rearrange(x, "... (b j) -> ... (j b)", b=self.n)   # blocks back to interleaved
        return self.part._split(x.movedim(-1, self.dim))

    def __repr__(self) -> str:
        return f"Deinterleave({self.part!r}, dim={self.dim}, n={self.n})"


def _merge(dicts) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for d in dicts:
        for k, v in d.items():
            if k in out:
                raise ValueError(f"split: checkpoint key {k!r} appears twice in one spec")
            out[k] = v
    return out
