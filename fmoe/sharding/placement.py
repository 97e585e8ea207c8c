"""Placements: which mesh axis shards which dimension of one tensor.

``P(*axes)`` gives one entry per tensor dimension, JAX ``PartitionSpec``-style: a mesh axis
name (``"tp"``, ``"fsdp"``, ``"ep"``, ``"efsdp"``, ``"dp_replicate"``), a tuple of axis names
(the dim is split by the first, each piece again by the next), or ``None`` (not split).
Dimensions past the last entry are not split; ``P()`` is fully replicated.

Two keyword options cover the styles a pure placement cannot say:

- ``packed=n``: the *packed dim* (the dim split by ``tp`` if any, else the first split dim)
  holds ``n`` equal blocks packed one after another (a fused ``[gate | up]`` projection) and
  each block is split separately, so the local slice is again
  ``[gate_shard | up_shard]`` and a local ``chunk(2)`` still separates gate from up;
- ``gather=True``: a layer that produces its output sharded along this placement gathers it
  back to the full width (colwise with gathered output).

Example:
    >>> P("ep", None, None)          # experts [E, 2I, D] split on E
    P('ep', None, None)
    >>> P("tp", None, packed=2)      # fused [2I, D] gate/up, each half split over tp
    P('tp', None, packed=2)
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

from ..mesh import AXES, DENSE_AXES, EXPERT_AXES

__all__ = ["P", "Axis", "chunk_range", "chunk_sizes", "check_fused_gate_up"]

Axis = Union[None, str, tuple]


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` when ``size`` entries split into ``parts`` pieces
    the way ``torch.chunk`` (and DTensor's ``Shard``) splits them: pieces of ``ceil(size / parts)``,
    the last ones shorter or empty. Even splits are the usual equal blocks.

    Example:
        >>> [chunk_range(97, 2, r) for r in range(2)], [chunk_range(5, 4, r)[1] for r in range(4)]
        ([(0, 49), (49, 48)], [2, 2, 1, 0])
    """
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size) - start


def chunk_sizes(size: int, parts: int) -> list[int]:
    """Every piece's length under :func:`chunk_range` (``[49, 48]`` for 97 over 2)."""
    return [chunk_range(size, parts, i)[1] for i in range(parts)]


class P:
    """Placement of one tensor: a mesh-axis entry (or None) per dimension.

    ``P`` is a pytree *leaf* (not a tuple), so a tree of placements has the same structure as
    the parameter tree it describes.

    Args:
        *axes: per-dim entry: None, an axis name, or a tuple of axis names.
        packed: number of equal blocks packed along the sharded dim (each split separately).
        gather: layers gather an output sharded like this back to full width.
    """

    __slots__ = ("axes", "packed", "gather")

    def __init__(self, *axes: Axis, packed: int = 1, gather: bool = False):
        norm = []
        for i, a in enumerate(axes):
            if a is None or isinstance(a, str):
                norm.append(a)
            elif isinstance(a, (tuple, list)) and a and all(isinstance(x, str) for x in a):
                norm.append(a[0] if len(a) == 1 else tuple(a))
            else:
                raise TypeError(
                    f"P: entry {i} must be None, a mesh axis name or a tuple of names, got {a!r}"
                )
        if isinstance(packed, bool) or not isinstance(packed, int) or packed < 1:
            raise ValueError(f"P: packed must be an int >= 1, got {packed!r}")
        self.axes: tuple = tuple(norm)
        self.packed = packed
        self.gather = bool(gather)

    # ------------------------------------------------------------------ structure
    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """Axis names splitting tensor dim ``dim`` (empty tuple if not split)."""
        a = self.axes[dim] if dim < len(self.axes) else None
        return () if a is None else ((a,) if isinstance(a, str) else a)

    def mesh_axes(self) -> tuple[str, ...]:
        """All axis names used, in entry order."""
        return tuple(x for d in range(len(self.axes)) for x in self.dim_axes(d))

    def sharded_dims(self) -> list[int]:
        return [d for d in range(len(self.axes)) if self.dim_axes(d)]

    @property
    def packed_dim(self) -> Optional[int]:
        """The dim holding the packed blocks: the one split by ``tp``, else the first split dim."""
        if self.packed == 1 or not self.sharded_dims():
            return None
        d = self.dim_of("tp")
        return d if d is not None else self.sharded_dims()[0]

    def dim_of(self, axis: str) -> Optional[int]:
        """The tensor dim that ``axis`` splits, or None."""
        for d in range(len(self.axes)):
            if axis in self.dim_axes(d):
                return d
        return None

    @property
    def is_replicated(self) -> bool:
        return not self.mesh_axes()

    def validate(self) -> None:
        """Raise ``ValueError`` for unknown axis names, an axis used twice, dense and expert axes
        mixed, a packed dim not split by one axis, or nested axes out of mesh order."""
        used = self.mesh_axes()
        for a in used:
            if a not in AXES:
                raise ValueError(f"{self!r}: unknown mesh axis {a!r}; valid axes are {list(AXES)}")
        if len(set(used)) != len(used):
            raise ValueError(f"{self!r}: a mesh axis may split only one tensor dim")
        dense = {"fsdp", "tp"} & set(used)
        expert = {"efsdp", "ep"} & set(used)
        if dense and expert:
            raise ValueError(
                f"{self!r}: mixes dense-mesh axes {sorted(dense)} with expert-mesh axes "
                f"{sorted(expert)}; one placement lives on one mesh"
            )
        if self.packed > 1 and (not self.sharded_dims() or len(self.dim_axes(self.packed_dim)) != 1):
            raise ValueError(f"{self!r}: the packed dim must be split by exactly one axis")
        mesh_axes = EXPERT_AXES if expert else DENSE_AXES
        for d in self.sharded_dims():                # DTensor splits nested axes in mesh order
            axes = self.dim_axes(d)
            if list(axes) != sorted(axes, key=mesh_axes.index):
                raise ValueError(f"{self!r}: axes splitting one dim must follow mesh order {mesh_axes}, got {axes}")

    # ------------------------------------------------------------------ value semantics
    def _key(self):
        axes = list(self.axes)
        while axes and axes[-1] is None:  # trailing Nones say nothing: P("tp") == P("tp", None)
            axes.pop()
        return (tuple(axes), self.packed, self.gather)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, P) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __iter__(self) -> Iterable[Axis]:
        return iter(self.axes)

    def __len__(self) -> int:
        return len(self.axes)

    def __getitem__(self, i: int) -> Axis:
        return self.axes[i]

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.axes]
        if self.packed > 1:
            parts.append(f"packed={self.packed}")
        if self.gather:
            parts.append("gather=True")
        return f"P({', '.join(parts)})"


def check_fused_gate_up(p: "P", what: str) -> None:
    """The fused ``[gate | up]`` rule, in one place: a ``w_gate_up [2I, D]`` (or its bias) split
    over ``tp`` on its output dim must be split per half (``packed=2``), or each rank would pair
    gates with gates. Checked when a model's plan is built (:meth:`fmoe.model.Model.build_plan`)
    and, for weights placed by hand, when :func:`fmoe.nn.swiglu_mlp` or ``fmoe.moe``'s shared
    experts receive them.

    Args:
        p: the weight's placement.
        what: how to name the weight in the error (path, rule).
    Raises:
        ValueError: naming ``what``, the placement and the valid style.

    Example:
        >>> check_fused_gate_up(P("tp", None, packed=2), "w_gate_up")     # fine
        >>> check_fused_gate_up(P("tp", None), "w_gate_up")
        Traceback (most recent call last):
        ValueError: w_gate_up is split over tp as P('tp', None); a fused [gate | up] weight must be split per half: use style 'packed_colwise' (P('tp', None, packed=2))
    """
    if p.dim_of("tp") == 0 and p.packed != 2:
        raise ValueError(f"{what} is split over tp as {p!r}; a fused [gate | up] weight must be split per "
                         "half: use style 'packed_colwise' (P('tp', None, packed=2))")
