"""Plans: an ordered table of ``glob -> placement`` rules over dotted parameter paths.

A worked example. With the plan::

    plan = Plan({
        "embed":               "vocab",            # style name -> P("tp", None)
        "layers.*.attn.w[qkv]": "colwise",          # P("tp", None)
        "layers.*.attn.wo":     "rowwise",          # P(None, "tp")
        "layers.*.moe.w_*":     P("ep", None, None),
        "**":                   P(),               # everything else replicated
    })

the leaf ``layers.1.attn.wq`` is matched by the second rule (segments compare one by one:
``layers`` / ``*`` / ``attn`` / ``w[qkv]``) and gets ``P("tp", None)``; ``layers.1.moe.router``
is not matched by ``w_*`` and falls through to ``**``. The first matching rule wins, so put
specific rules before general ones. ``plan.explain(params, mesh)`` prints this table per leaf.

Rule values are a :class:`~fmoe.sharding.placement.P` or a *style* name (see :data:`STYLES`), which is
turned into a ``P`` from the leaf's number of dims (a colwise bias is ``P("tp")``, a rowwise
bias ``P()``).

Validation (``ValueError``, always before any communication): a strict rule that matches no
leaf (with the closest paths suggested), a leaf that no rule covers when there is no default,
an unknown style or axis, a ``P`` with more entries than the tensor has dims, and a dim that
the mesh axis sizes do not divide. Rules from a model's default plan are not strict: one that
matches nothing only warns (models share plans across sizes); user overrides are strict.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .. import tree as _tree
from .placement import P, chunk_range

__all__ = ["Plan", "STYLES", "style"]

Rule = Union[P, str]


def _colwise(nd: int, **kw) -> P:
    return P("tp", *([None] * (nd - 1)), **kw)


def _rowwise(nd: int, **kw) -> P:
    return P() if nd == 1 else P(*([None] * (nd - 1)), "tp", **kw)


#: Style name -> function(ndim) -> P, for the tensor-parallel styles users know by name.
STYLES: dict[str, Callable[[int], P]] = {
    "colwise": lambda nd: _colwise(nd),
    "colwise_gather": lambda nd: _colwise(nd, gather=True),
    "rowwise": lambda nd: _rowwise(nd),
    "packed_colwise": lambda nd: _colwise(nd, packed=2),
    "packed_rowwise": lambda nd: P() if nd == 1 else _rowwise(nd, packed=2),
    "vocab": lambda nd: _colwise(nd),
    "local": lambda nd: _colwise(nd),
    "replicate": lambda nd: P(),
    "expert": lambda nd: P("ep", *([None] * (nd - 1))),
}


def style(name: str, ndim: int) -> P:
    """The placement that style ``name`` gives a tensor with ``ndim`` dims.

    Example:
        >>> style("rowwise", 2), style("rowwise", 1)
        (P(None, 'tp'), P())
    """
    if name not in STYLES:
        raise ValueError(f"unknown sharding style {name!r}; supported styles: {sorted(STYLES)}")
    return STYLES[name](ndim)


class Plan:
    """An ordered list of ``(glob, placement-or-style)`` rules; the first match wins.

    Args:
        rules: mapping or sequence of ``(glob, P | style name)`` pairs.
        default: placement for leaves no rule covers (None: such a leaf is an error).
        strict: a rule that matches no leaf is an error (True) or a warning (False).

    Example:
        >>> plan = Plan({"layers.*.moe.w_*": P("ep", None, None)}, default=P())
        >>> import torch
        >>> plan.resolve({"layers": [{"moe": {"w_down": torch.zeros(4, 2, 3)}}]})
        {'layers': [{'moe': {'w_down': P('ep', None, None)}}]}
    """

    def __init__(
        self,
        rules: Union[Mapping[str, Rule], Sequence[tuple[str, Rule]]] = (),
        default: Optional[P] = None,
        *,
        strict: bool = True,
    ):
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        self._rules: list[tuple[str, Rule, bool]] = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"Plan: each rule must be (glob str, P or style name), got {item!r}")
            glob, value = item
            self._check_value(glob, value)
            self._rules.append((glob, value, strict))
        if default is not None and not isinstance(default, P):
            raise TypeError(f"Plan: default must be a P or None, got {default!r}")
        if default is not None:
            default.validate()
        self.default = default

    @staticmethod
    def _check_value(glob: str, value: Rule) -> None:
        if isinstance(value, P):
            value.validate()
        elif isinstance(value, str):
            if value not in STYLES:
                raise ValueError(
                    f"Plan rule {glob!r}: unknown sharding style {value!r}; "
                    f"supported styles: {sorted(STYLES)}"
                )
        else:
            raise TypeError(f"Plan rule {glob!r}: value must be a P or a style name, got {value!r}")

    @property
    def rules(self) -> list[tuple[str, Rule]]:
        """The rules in match order."""
        return [(g, v) for g, v, _ in self._rules]

    def override(self, rules: Union[Mapping[str, Rule], Sequence[tuple[str, Rule]]]) -> "Plan":
        """A new plan with user rules merged in by key (user rules are strict).

        A key already in the plan keeps its position and takes the new value; new keys go in
        front, so a specific user rule wins over the broader defaults it refines.

        Example:
            >>> base = Plan({"**.wo": "rowwise"}, default=P(), strict=False)
            >>> base.override({"layers.0.wo": "replicate"}).rules
            [('layers.0.wo', 'replicate'), ('**.wo', 'rowwise')]
        """
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        new = Plan((), self.default)
        existing = {g: i for i, (g, _, _) in enumerate(self._rules)}
        merged = list(self._rules)
        front = []
        for glob, value in items:
            self._check_value(glob, value)
            if glob in existing:
                merged[existing[glob]] = (glob, value, True)
            else:
                front.append((glob, value, True))
        new._rules = front + merged
        return new

    # ------------------------------------------------------------------ resolution
    def match(self, path: str) -> Optional[tuple[str, Rule]]:
        """The first rule matching ``path`` (or None)."""
        for glob, value, _ in self._rules:
            if _tree.glob_match(glob, path):
                return glob, value
        return None

    def _resolve_flat(self, flat: Mapping[str, Any], mesh=None) -> dict[str, tuple[Optional[str], P]]:
        out: dict[str, tuple[Optional[str], P]] = {}
        used = set()
        uncovered = []
        for path, leaf in flat.items():
            hit = self.match(path)
            if hit is None:
                if self.default is None:
                    uncovered.append(path)
                    continue
                glob, p = None, self.default
            else:
                glob, value = hit
                used.add(glob)
                p = style(value, _ndim(leaf)) if isinstance(value, str) else value
            _check_leaf(path, leaf, p, glob, mesh)
            out[path] = (glob, p)
        if uncovered:
            raise ValueError(
                f"Plan: {len(uncovered)} parameter(s) covered by no rule and the plan has no "
                f"default: {uncovered[:8]}; add a rule (e.g. '**': P()) or Plan(..., default=P())"
            )
        for glob, _, strict in self._rules:
            if glob in used:
                continue
            close = difflib.get_close_matches(glob, list(flat), n=3, cutoff=0.0)
            msg = f"Plan rule {glob!r} matches no parameter; closest paths: {close}"
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, stacklevel=3)
        return out

    def resolve(self, params: Any, mesh=None) -> Any:
        """Tree of :class:`P` with ``params``' structure; validated (against ``mesh`` if given).

        Args:
            params: parameter tree (tensors or anything with ``.shape``).
            mesh: optional :class:`fmoe.Mesh`; checks divisibility by its axis sizes.
        Returns:
            tree of placements.
        """
        flat = _tree.flatten(params)
        res = self._resolve_flat(flat, mesh)
        return _tree.unflatten({k: res[k][1] for k in flat}, like=params)

    def explain(self, params: Any, mesh=None) -> str:
        """A readable table: path, shape, matching rule, placement (and local shape with a mesh).

        Example:
            >>> import torch
            >>> print(Plan({"w": "colwise"}).explain({"w": torch.zeros(4, 2)}))  # doctest: +NORMALIZE_WHITESPACE
            path  shape   rule  placement
            w     (4, 2)  w     P('tp', None)
        """
        flat = _tree.flatten(params)
        res = self._resolve_flat(flat, mesh)
        head = ["path", "shape", "rule", "placement"] + (["local shape"] if mesh is not None else [])
        rows = [head]
        for path, leaf in flat.items():
            glob, p = res[path]
            row = [path, str(tuple(leaf.shape)), glob if glob is not None else "(default)", repr(p)]
            if mesh is not None:
                row.append(str(local_shape(tuple(leaf.shape), p, mesh)))
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def __repr__(self) -> str:
        body = ", ".join(f"{g!r}: {v!r}" for g, v, _ in self._rules)
        return f"Plan({{{body}}}, default={self.default!r})"


def _ndim(leaf: Any) -> int:
    shape = getattr(leaf, "shape", None)
    if shape is None:
        raise TypeError(f"Plan: leaves must be tensors (with .shape), got {type(leaf).__name__}")
    return len(shape)


def _check_leaf(path: str, leaf: Any, p: P, glob: Optional[str], mesh) -> None:
    nd = _ndim(leaf)
    where = f"parameter {path!r} (shape {tuple(leaf.shape)}, rule {glob!r})"
    if len(p) > nd:
        raise ValueError(f"{where}: placement {p!r} has {len(p)} entries but the tensor has {nd} dims")
    if mesh is None:
        return
    for d in p.sharded_dims():
        axes = p.dim_axes(d)
        n = 1
        for a in axes:
            n *= mesh.size(a)
        packed = p.packed if d == p.packed_dim else 1
        n *= packed
        if leaf.shape[d] % n and (packed > 1 or "ep" in axes):  # other splits may be uneven (torch.chunk sizes)
            sizes = ", ".join(f"{a}={mesh.size(a)}" for a in axes)
            extra = f" x packed={packed}" if packed > 1 else ""
            why = "each packed block must split evenly" if packed > 1 else "experts must split evenly over ep"
            raise ValueError(
                f"{where}: dim {d} of size {leaf.shape[d]} is not divisible by {sizes}{extra} "
                f"(= {n}); {why}"
            )


def local_shape(shape: tuple, p: P, mesh) -> tuple:
    """Shape of one rank's slice of a tensor of ``shape`` placed by ``p`` on ``mesh`` (uneven
    splits take ``torch.chunk`` sizes, nested axes one after the other, as DTensor does)."""
    out = list(shape)
    for d in p.sharded_dims():
        if d == p.packed_dim:                 # validated even: each block split alike
            for a in p.dim_axes(d):
                out[d] //= mesh.size(a)
            continue
        for a in p.dim_axes(d):
            n = mesh.size(a)
            out[d] = out[d] // n if out[d] % n == 0 else chunk_range(out[d], n, mesh.rank_in(a))[1]
    return tuple(out)
