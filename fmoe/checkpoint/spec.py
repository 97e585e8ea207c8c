"""Source specs: how one fmoe parameter is made of Hugging Face checkpoint tensors.

An fmoe parameter and the checkpoint tensors it comes from rarely line up one to one. Qwen3-MoE
stores one ``gate_proj``/``up_proj`` per expert where fmoe keeps one fused ``w_gate_up [E, 2I, D]``;
gpt-oss stores ``gate_up_proj [E, D, 2I]`` transposed, with gate and up interleaved. A *spec* is
a small expression tree that says how the full parameter is built::

    Cat([Stack([Key("...experts.0.gate_proj.weight", (I, D)), ...]),      # [E, I, D]
         Stack([Key("...experts.0.up_proj.weight", (I, D)), ...])], dim=1)  # -> [E, 2I, D]

    Transpose(Deinterleave(Key("...experts.gate_up_proj", (E, D, 2 * I)), dim=2), 1, 2)

Every node knows its ``.shape`` without reading anything (a :class:`Key` declares the shape the
config implies, so a checkpoint that disagrees is caught before any read) and its ``.dtype`` once
bound to a source. ``read(index)`` returns exactly ``full[index]`` for a tuple of slices by
pushing the index down the tree: a ``Cat`` asks only the parts the range overlaps, a ``Stack``
only the stacked entries in range, a ``Transpose`` swaps the index entries, a ``Deinterleave``
turns each block's range into a strided range of its part, so the leaves read only the elements
asked for (``safe_open(...).get_slice(key)[...]``). ``split(full)`` is the
inverse used for saving: ``{hf_key: tensor}``.

A source is anything with ``read(name, index) -> Tensor`` and ``dtype(name) -> torch.dtype``
(:class:`fmoe.checkpoint.Checkpoint`); ``spec.bind(source)`` attaches it to every leaf.

This module holds the base class, :class:`Key` and the index arithmetic;
:mod:`fmoe.checkpoint.nodes` holds the combinators (``Cat``, ``Stack``, ``Transpose``,
``Deinterleave``).

Example:
    >>> import torch
    >>> k = Key("model.norm.weight", (4,))
    >>> k.shape, k.split(torch.ones(4))["model.norm.weight"].shape
    ((4,), torch.Size([4]))
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["Spec", "Key", "normalize_index"]

Index = tuple  # tuple[slice, ...], one slice with explicit start, stop, step >= 1 per dim


def normalize_index(index: Any, shape: Sequence[int]) -> Index:
    """Explicit ``(slice(start, stop), ...)`` for every dim of ``shape``.

    Args:
        index: a slice or tuple of slices (positive steps; fewer entries than dims means the rest
            in full).
        shape: the full shape the index applies to.
    Returns:
        a tuple of ``len(shape)`` slices with integer bounds and steps.
    """
    if isinstance(index, slice):
        index = (index,)
    if not isinstance(index, tuple):
        raise TypeError(f"read: index must be a tuple of slices, got {index!r}")
    if len(index) > len(shape):
        raise ValueError(f"read: index {index!r} has {len(index)} entries but the tensor has "
                         f"{len(shape)} dims (shape {tuple(shape)})")
    out = []
    for d, n in enumerate(shape):
        s = index[d] if d < len(index) else slice(None)
        if not isinstance(s, slice):
            raise TypeError(f"read: index entry {d} must be a slice, got {s!r}; use slice(i, i + 1) "
                            "for a single position")
        if s.step is not None and (isinstance(s.step, bool) or not isinstance(s.step, int) or s.step < 1):
            raise ValueError(f"read: index entry {d} has step {s.step!r}; steps must be ints >= 1")
        start, stop, step = s.indices(n)
        out.append(slice(start, max(start, stop), step))
    return tuple(out)


def _replace(index: Index, dim: int, s: slice) -> Index:
    return index[:dim] + (s,) + index[dim + 1:]


def _size(s: slice) -> int:
    return len(range(s.start, s.stop, s.step))


def _clip(s: slice, lo: int, hi: int) -> slice:
    """The positions of ``s`` that fall in ``[lo, hi)``, shifted by ``-lo`` (maybe empty)."""
    first = s.start + max(0, -(-(lo - s.start) // s.step)) * s.step
    stop = min(s.stop, hi)
    return slice(first - lo, max(first, stop) - lo, s.step)


def _check_dim(node: str, dim: int, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{node}: dim must be an int in [{-ndim}, {ndim}), got {dim!r}")
    return dim % ndim


class Spec:
    """A full fmoe tensor described in terms of checkpoint tensors (see the module docstring)."""

    shape: tuple[int, ...]
    parts: list["Spec"]

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the checkpoint tensors (all leaves of one spec must agree)."""
        leaves = self.leaves()
        dtypes = {k.dtype for k in leaves}
        if len(dtypes) != 1:
            found = {k.name: str(k.dtype) for k in leaves}
            raise ValueError(f"{self!r}: checkpoint tensors of one parameter have different dtypes {found}")
        return dtypes.pop()

    def leaves(self) -> list["Key"]:
        """The :class:`Key` leaves, in order."""
        return [k for p in self.parts for k in p.leaves()]

    def bind(self, source: Any) -> "Spec":
        """A copy of this spec whose leaves read from ``source``."""
        return self._rebuild([p.bind(source) for p in self.parts])

    def _rebuild(self, parts: list["Spec"]) -> "Spec":
        raise NotImplementedError

    def read(self, index: Any = ()) -> torch.Tensor:
        """Exactly ``full[index]``, reading only the checkpoint blocks that overlap it.

        Args:
            index: tuple of slices with steps >= 1 (missing trailing dims mean the whole dim).
        Returns:
            the block as a tensor.

        Example:
            >>> import shutil, tempfile
            >>> from fmoe.checkpoint import Cat, Checkpoint, write_checkpoint
            >>> tmp = tempfile.mkdtemp()
            >>> _ = write_checkpoint(tmp, {"gate": torch.zeros(2, 3), "up": torch.ones(2, 3)}, {})
            >>> with Checkpoint(tmp) as ck:
            ...     spec = Cat([Key("gate", (2, 3)), Key("up", (2, 3))], dim=0).bind(ck)
            ...     print(spec.read((slice(1, 3),)).tolist(), ck.bytes_read)   # one row of each: 2 x 12 bytes
            [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]] 24
            >>> shutil.rmtree(tmp)
        """
        idx = normalize_index(index, self.shape)
        if any(_size(s) == 0 for s in idx):
            return torch.empty([_size(s) for s in idx], dtype=self.dtype)
        return self._read(idx)

    def _read(self, idx: Index) -> torch.Tensor:
        raise NotImplementedError

    def split(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of reading: the checkpoint tensors ``{hf_key: tensor}`` that make ``full``.

        Args:
            full: a tensor of shape ``self.shape``.
        Returns:
            dict from checkpoint key to tensor (views of ``full`` where possible).
        """
        if not isinstance(full, torch.Tensor):
            raise TypeError(f"split: expected a tensor for {self!r}, got {type(full).__name__}")
        if tuple(full.shape) != self.shape:
            raise ValueError(f"split: {self!r} has shape {self.shape}, got a tensor of shape "
                             f"{tuple(full.shape)}")
        return self._split(full)

    def _split(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class Key(Spec):
    """One checkpoint tensor ``name`` of the ``shape`` the config implies.

    Args:
        name: the Hugging Face key, e.g. ``"model.layers.0.mlp.gate.weight"``.
        shape: its expected shape (checked against the checkpoint before reading).
        source: what to read from (normally set by :meth:`Spec.bind`).
    """

    def __init__(self, name: str, shape: Sequence[int], source: Any = None):
        if not isinstance(name, str) or not name:
            raise TypeError(f"Key: name must be a non-empty string, got {name!r}")
        try:
            shape = tuple(int(n) for n in shape)
        except TypeError:
            raise TypeError(f"Key {name!r}: shape must be a sequence of ints, got {shape!r}") from None
        if any(n < 0 for n in shape):
            raise ValueError(f"Key {name!r}: shape must have sizes >= 0, got {shape}")
        self.name, self.shape, self.source = name, shape, source

    @property
    def dtype(self) -> torch.dtype:
        return self._source().dtype(self.name)

    def _source(self) -> Any:
        if self.source is None:
            raise ValueError(f"{self!r} is not bound to a checkpoint; call spec.bind(checkpoint) first")
        return self.source

    def leaves(self) -> list["Key"]:
        return [self]

    def bind(self, source: Any) -> "Key":
        return Key(self.name, self.shape, source)

    def _read(self, idx: Index) -> torch.Tensor:
        return self._source().read(self.name, idx)

    def _split(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.name: full}

    def __repr__(self) -> str:
        return f"Key({self.name!r}, {self.shape})"
