"""Freeze part of a parameter tree by path globs: masks, partitions and their inverse.

Globs are the plan's (:func:`fmoe.tree.glob_match`: ``*`` inside one dot-separated segment,
``**`` any number of whole segments). A frozen subtree either stays out of the differentiated
argument (:func:`partition` / :func:`combine`, the ``torch.func`` way), or is masked in the optimizer
(``mask`` for :func:`fmoe.optim.adamw.update`), or stops requiring grad (``freeze``, the
``.backward()`` way).

Example:
    >>> import torch
    >>> p = {"embed": torch.ones(2), "layers": {"0": {"attn": {"wq": torch.ones(2)}, "norm": torch.ones(2)}}}
    >>> frozen, train = partition(p, "layers.*.attn.**")
    >>> _tree.paths(frozen), _tree.paths(train)
    (['layers.0.attn.wq'], ['embed', 'layers.0.norm'])
    >>> _tree.paths(combine(frozen, train)) == _tree.paths(p)
    True
"""

from __future__ import annotations

from typing import Any

from .. import tree as _tree

__all__ = ["matches", "mask", "partition", "combine", "freeze"]


def _check(globs: tuple, fn: str) -> None:
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise TypeError(f"{fn}: globs must be one or more non-empty strings, got {globs!r}")


def matches(path: str, *globs: str) -> bool:
    """Whether ``path`` matches any of ``globs``.

    Example:
        >>> matches("layers.3.moe.w_down", "layers.*.moe.w_*")
        True
    """
    return any(_tree.glob_match(g, path) for g in globs)


def mask(tree: Any, *globs: str, unmatched_ok: bool = False) -> Any:
    """A tree of bools shaped like ``tree``: True where the leaf is trained (matches no glob).

    Args:
        tree: parameter tree.
        globs: paths to freeze; each must match some leaf unless ``unmatched_ok``.
    Returns:
        the mask tree (for ``fmoe.optim.adamw.update(..., mask=)``).

    Example:
        >>> import torch
        >>> mask({"a": torch.ones(1), "b": torch.ones(1)}, "b")
        {'a': True, 'b': False}
    """
    _check(globs, "mask")
    paths = _tree.paths(tree)
    if not unmatched_ok:
        unused = [g for g in globs if not any(_tree.glob_match(g, p) for p in paths)]
        if unused:
            raise ValueError(f"mask: glob(s) {unused} match no leaf; paths look like {paths[:3]}")
    return _tree.map_with_path(lambda path, _: not matches(path, *globs), tree)


def partition(tree: Any, *globs: str, unmatched_ok: bool = False) -> tuple[Any, Any]:
    """Split ``tree`` into ``(matching, rest)``: two nested trees, joined back by :func:`combine`.

    Args:
        tree: parameter tree.
        globs: the paths of the first part; each must match some leaf unless ``unmatched_ok``.
    Returns:
        ``(matching, rest)``.
    """
    keep = _tree.flatten(mask(tree, *globs, unmatched_ok=unmatched_ok))
    flat = _tree.flatten(tree)
    return (_tree.unflatten({k: v for k, v in flat.items() if not keep[k]}),
            _tree.unflatten({k: v for k, v in flat.items() if keep[k]}))


def combine(*trees: Any) -> Any:
    """The union of disjoint trees (the inverse of :func:`partition`).

    Raises:
        ValueError: when two trees hold the same path.
    """
    out: dict = {}
    for t in trees:
        for k, v in _tree.flatten(t).items():
            if k in out:
                raise ValueError(f"combine: path {k!r} is in more than one tree")
            out[k] = v
    return _tree.unflatten(out)


def freeze(tree: Any, *globs: str) -> Any:
    """``tree`` with the matching leaves detached (``requires_grad=False``): ``.backward()``
    gives them no gradient and :func:`fmoe.optim.adamw.update` leaves them as they are.

    Example:
        >>> import torch
        >>> freeze({"a": torch.ones(1, requires_grad=True)}, "a")["a"].requires_grad
        False
    """
    keep = _tree.flatten(mask(tree, *globs))
    return _tree.map_with_path(lambda path, t: t if keep[path] else t.detach(), tree)
