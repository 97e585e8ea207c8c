"""Parameter pytrees addressed by dotted paths.

A parameter tree is a nested structure of ``dict`` (string keys) and ``list``/``tuple`` nodes
with tensors (or other leaves) at the bottom. Every leaf has a *dotted path* made of the keys
and indices on the way down::

    {"embed": w, "layers": [{"moe": {"w_down": t}}]}   ->   "embed", "layers.0.moe.w_down"

Paths name leaves everywhere in fmoe: plans, checkpoints and error messages. Flattening uses
optree, which sorts dict keys, so two trees are joined by path, never by position.

While Dynamo traces, trees of dict / list / tuple / namedtuple / ``OrderedDict`` / None nodes are
walked by plain recursion (:func:`_walk`, :func:`_rebuild`, :func:`_zip`; same order, paths and
results): Dynamo replays optree's C++ through Python polyfills, ~10 traced calls per node (a compiled
AdamW step of a tiny MoE model: 10.4k -> 4.2k). Other node types take optree.

Glob patterns select paths segment by segment (segments are separated by dots):

=========  ====================================================================
``*``      any characters inside one segment (``w_*`` matches ``w_down``)
``**``     any number (zero or more) of whole segments
other      ``fnmatch`` syntax inside the segment (``[0-3]``, ``?``)
=========  ====================================================================

``layers.*.moe.w_*`` matches ``layers.3.moe.w_down`` but not ``layers.3.x.moe.w_down``;
a plain ``fnmatch`` over the whole string would match both, because its ``*`` crosses dots.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import functools
import re
from typing import Any, Callable, Optional

import optree
import torch

__all__ = ["flatten", "unflatten", "paths", "map", "map_with_path", "glob_match", "leaves"]

_NONE_IS_NODE = dict(none_is_leaf=False, namespace="fmoe")


def _path_str(entries: tuple) -> str:
    return ".".join(str(e) for e in entries)


class _OtherNode(Exception):
    """A node type the plain walk leaves to optree (a tuple / list / dict subclass, a deque)."""


def _kind(node: Any) -> str:
    """How optree sees a node: ``"dict"`` (sorted keys), ``"odict"`` (insertion order), ``"seq"``
    (list, tuple, namedtuple), ``"none"`` or ``"leaf"``; :class:`_OtherNode` for the others."""
    t = type(node)
    if t is dict:
        return "dict"
    if t is list or t is tuple or (issubclass(t, tuple) and hasattr(t, "_fields")):
        return "seq"
    if t is collections.OrderedDict:
        return "odict"
    if node is None:
        return "none"
    if isinstance(node, (dict, list, tuple, collections.deque)):
        raise _OtherNode
    return "leaf"


def _keys(node: Any, kind: str) -> list:
    """The children's keys of a ``dict`` / ``odict`` / ``seq`` node, in optree's order."""
    return sorted(node) if kind == "dict" else list(node) if kind == "odict" else list(range(len(node)))


_NODES = (dict, list, tuple, collections.deque)      # a child of another type is a leaf (None: no leaf)


def _walk(tree: Any, prefix: str, out: dict) -> dict:
    """``{path: leaf}`` of a plain tree into ``out``, in optree's order (dict keys sorted). Leaves
    are stored inline, without a call each: what Dynamo traces is one call per node."""
    kind = _kind(tree)
    if kind == "leaf":
        out[prefix] = tree
    elif kind != "none":
        for k in _keys(tree, kind):
            child, path = tree[k], f"{prefix}.{k}" if prefix else str(k)
            if child is not None and not isinstance(child, _NODES):
                out[path] = child
            else:
                _walk(child, path, out)
    return out


def _traced(tree: Any) -> Optional[dict]:
    """``{path: leaf}`` by :func:`_walk` while Dynamo traces; None otherwise or for other node types."""
    if torch.compiler.is_compiling():
        with contextlib.suppress(_OtherNode):
            return _walk(tree, "", {})
    return None


def _rebuild(like: Any, prefix: str, flat: dict) -> Any:
    """``like``'s structure with the leaf at each path taken from ``flat`` (dicts keep their
    key order, as optree's unflatten does)."""
    kind = _kind(like)
    if kind == "leaf":
        return flat[prefix]
    if kind == "none":
        return None
    items = []
    for k in (like if kind != "seq" else range(len(like))):
        child, path = like[k], f"{prefix}.{k}" if prefix else str(k)
        items.append(flat[path] if child is not None and not isinstance(child, _NODES) else
                     _rebuild(child, path, flat))
    if kind != "seq":
        return type(like)(zip(like, items))
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


def _zip(tree: Any, rest: tuple, prefix: str, out: dict) -> dict:
    """``{path: (leaf, rest_at_path)}`` in optree's order into ``out`` (``rest`` must match ``tree``'s
    nodes; a leaf of ``tree`` takes their subtree); calls nothing, so a fallback precedes any fn call."""
    kind = _kind(tree)
    if kind == "leaf":
        out[prefix] = (tree, rest)
        return out
    for r in rest:
        if type(r) is not type(tree) or (kind == "seq" and len(r) != len(tree)) or (
                kind != "seq" and r is not None and r.keys() != tree.keys()):
            raise ValueError(f"map_with_path: the trees differ at {prefix or 'the root'!r}")
    if kind != "none":
        for k in _keys(tree, kind):
            _zip(tree[k], tuple(r[k] for r in rest), f"{prefix}.{k}" if prefix else str(k), out)
    return out


def paths(tree: Any) -> list[str]:
    """Dotted paths of every leaf, in optree's (sorted-key) order.

    Args:
        tree: nested dict/list/tuple of leaves.
    Returns:
        list of dotted paths.

    Example:
        >>> paths({"b": 1, "a": [2, 3]})
        ['a.0', 'a.1', 'b']
    """
    flat = _traced(tree)
    return list(flat) if flat is not None else [_path_str(p) for p in optree.tree_paths(tree, **_NONE_IS_NODE)]


def leaves(tree: Any) -> list[Any]:
    """Leaves of ``tree`` in the same order as :func:`paths`."""
    flat = _traced(tree)
    return list(flat.values()) if flat is not None else optree.tree_leaves(tree, **_NONE_IS_NODE)


def flatten(tree: Any) -> dict[str, Any]:
    """Flatten a tree to ``{dotted path: leaf}``.

    Args:
        tree: nested dict/list/tuple of leaves.
    Returns:
        dict from dotted path to leaf (insertion order = optree order).

    Example:
        >>> flatten({"layers": [{"w": 1}], "embed": 2})
        {'embed': 2, 'layers.0.w': 1}
    """
    if (flat := _traced(tree)) is not None:
        return flat
    ps, ls, _ = optree.tree_flatten_with_path(tree, **_NONE_IS_NODE)
    return {_path_str(p): leaf for p, leaf in zip(ps, ls)}


def unflatten(flat: dict[str, Any], like: Any = None) -> Any:
    """Rebuild a tree from ``{dotted path: leaf}``.

    Args:
        flat: mapping from dotted path to leaf.
        like: optional tree with the wanted structure; its paths must equal ``flat``'s keys.
            Without it, nested dicts are built and every level whose keys are exactly
            ``0..n-1`` becomes a list.
    Returns:
        the nested tree.

    Example:
        >>> unflatten({"layers.0.w": 1, "layers.1.w": 2, "embed": 3})
        {'layers': [{'w': 1}, {'w': 2}], 'embed': 3}
    """
    if like is not None:
        want = paths(like)
        missing, extra = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
        if missing or extra:
            raise ValueError(f"unflatten: paths differ from the reference tree: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        if torch.compiler.is_compiling():
            with contextlib.suppress(_OtherNode):
                return _rebuild(like, "", flat)
        treedef = optree.tree_structure(like, **_NONE_IS_NODE)
        return optree.tree_unflatten(treedef, [flat[p] for p in want])
    root: dict = {}
    for path, leaf in flat.items():
        node = root
        parts = path.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"unflatten: path {path!r} descends into leaf {part!r}")
            node = child
        if parts[-1] in node:
            raise ValueError(f"unflatten: path {path!r} is both a leaf and a node")
        node[parts[-1]] = leaf
    return _lists_from_digit_dicts(root)


def _lists_from_digit_dicts(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _lists_from_digit_dicts(v) for k, v in node.items()}
    if out and all(k.isdigit() for k in out) and sorted(int(k) for k in out) == list(range(len(out))):
        return [out[str(i)] for i in range(len(out))]
    return out


def map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:          # the name of jax.tree.map
    """``fn(leaf, *rest_leaves)`` over a tree, keeping its structure (``jax.tree.map``).

    Args:
        fn, tree, rest: as :func:`map_with_path` takes them, ``fn`` without the path.
    Returns:
        a tree of ``fn``'s results.

    Example:
        >>> map(lambda x, y: x + y, {"a": [1, 2]}, {"a": [10, 20]})
        {'a': [11, 22]}
    """
    return map_with_path(lambda _, x, *r: fn(x, *r), tree, *rest)


def map_with_path(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Map ``fn(path, leaf, *rest_leaves)`` over a tree, keeping its structure.

    Args:
        fn: called with the dotted path, the leaf and the leaves of ``rest`` at the same path.
        tree: the tree to map over.
        *rest: trees with the same structure as ``tree``.
    Returns:
        a tree of ``fn``'s results.

    Example:
        >>> map_with_path(lambda p, x: f"{p}={x}", {"a": [1]})
        {'a': ['a.0=1']}
    """
    if torch.compiler.is_compiling():
        with contextlib.suppress(_OtherNode):        # the walk raises it before any call of fn
            pairs = _zip(tree, rest, "", {})
            return _rebuild(tree, "", {p: fn(p, x, *r) for p, (x, r) in pairs.items()})
    return optree.tree_map_with_path(
        lambda p, x, *r: fn(_path_str(p), x, *r), tree, *rest, **_NONE_IS_NODE
    )


@functools.lru_cache(maxsize=4096)
def _segment_regex(segment: str) -> re.Pattern:
    return re.compile(fnmatch.translate(segment))


def glob_match(pattern: str, path: str) -> bool:
    """Whether dotted ``path`` matches ``pattern`` segment by segment.

    Args:
        pattern: dotted glob (``*`` inside one segment, ``**`` any number of segments).
        path: dotted leaf path.
    Returns:
        True if it matches.

    Example:
        >>> glob_match("layers.*.moe.w_*", "layers.3.moe.w_down")
        True
        >>> glob_match("layers.*", "layers.3.moe.w_down")
        False
        >>> glob_match("**.w_down", "layers.3.moe.w_down")
        True
    """
    return _match(tuple(pattern.split(".")), tuple(path.split(".")))


@functools.lru_cache(maxsize=65536)
def _match(pat: tuple[str, ...], segs: tuple[str, ...]) -> bool:
    if not pat:
        return not segs
    head, tail = pat[0], pat[1:]
    if head == "**":
        return any(_match(tail, segs[i:]) for i in range(len(segs) + 1))
    if not segs:
        return False
    return bool(_segment_regex(head).fullmatch(segs[0])) and _match(tail, segs[1:])
