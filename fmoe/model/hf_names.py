"""A model's Hugging Face name map: which checkpoint keys each parameter is made of.

A model's name map is a table: parameter name inside layer N -> what it is made of, under the
key prefix ``model.layers.N.``::

    "attn.wq": "self_attn.q_proj.weight"                                 # one key
    "mlp.w_gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]       # keys concatenated on dim 0
    "moe.w_gate_up": Experts("mlp.experts.", "gate_proj", "up_proj")      # one key per expert, stacked
    "moe.w_down": lambda k, shape: Transpose(Key(k + "...", ...), 1, 2)   # any spec

:func:`hf_specs` reads it with the model's parameter shapes (the model's ``shapes(cfg)``, the
one table ``init`` uses too), so a spec's shape is never written twice; the paths outside the
layers are :data:`HF_TOP`. A model's own ``hf_specs(cfg, keys=None)`` is one call::

    def hf_specs(cfg, keys=None):
        return kit.hf_specs(shapes(cfg), HF_LAYER, keys, fused=HF_FUSED)

(``fused``: transformers' in-memory layout, ``mlp.experts.gate_up_proj`` ``[E, 2I, D]``, read in
the layers where the checkpoint holds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

from ..checkpoint import Cat, Key, Spec, Stack

__all__ = ["HF_TOP", "Names", "Experts", "hf_specs", "hf_names"]

#: the paths outside the layers -> their checkpoint keys (the same in every model here).
HF_TOP = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}

#: a name-map entry: one key, several keys concatenated on dim 0, per-expert keys, or any spec
#: ``entry(layer_prefix, shape)``.
Names = Union[str, list, "Experts", Callable[[str, tuple], Spec]]


@dataclass(frozen=True)
class Experts:
    """A name-map entry for ``[E, ...]`` expert weights saved one key per expert
    (``{prefix}{e}.{name}.weight``, what ``save_pretrained`` writes) and stacked on a new expert
    dim; several names are concatenated on dim 1 (``Experts("mlp.experts.", "gate_proj",
    "up_proj")``: ``w_gate_up [E, 2I, D]``).

    Example:
        >>> [k.name for k in Experts("mlp.experts.", "down_proj").spec("model.layers.0.", (2, 4, 3)).leaves()]
        ['model.layers.0.mlp.experts.0.down_proj.weight', 'model.layers.0.mlp.experts.1.down_proj.weight']
    """

    prefix: str
    names: tuple

    def __init__(self, prefix: str, *names: str):
        object.__setattr__(self, "prefix", prefix)
        object.__setattr__(self, "names", names)

    def spec(self, k: str, shape: tuple) -> Spec:
        """The spec of layer prefix ``k``'s ``shape``-d parameter."""
        E, rows, *rest = shape
        part = (rows // len(self.names), *rest)
        stacks = [Stack([Key(f"{k}{self.prefix}{e}.{n}.weight", part) for e in range(E)]) for n in self.names]
        return stacks[0] if len(stacks) == 1 else Cat(stacks, dim=1)


def _spec(entry: Names, k: str, shape: tuple) -> Spec:
    if isinstance(entry, str):
        return Key(k + entry, tuple(shape))
    if isinstance(entry, list):
        part = (shape[0] // len(entry), *shape[1:])
        return Cat([Key(k + e, part) for e in entry], dim=0)
    if isinstance(entry, Experts):
        return entry.spec(k, shape)
    return entry(k, shape)


def hf_specs(shapes: Mapping[str, tuple], layer_names: Mapping[str, Names], keys: Optional[Sequence[str]] = None,
             fused: Optional[Mapping[str, Names]] = None) -> dict[str, Spec]:
    """Every parameter path of a shape table -> its checkpoint spec.

    Args:
        shapes: path -> shape (the model's ``shapes(cfg)``).
        layer_names: name inside a layer -> its entry (:data:`Names`), under ``model.layers.N.``.
        keys: the checkpoint's keys, or None (writing).
        fused: entries that replace ``layer_names``'s in the layers where ``keys`` hold
            ``mlp.experts.gate_up_proj`` (transformers' fused in-memory layout).
    Returns:
        path -> spec; the top-level paths from :data:`HF_TOP`.

    Example:
        >>> s = hf_specs({"layers.0.moe.w_down": (2, 4, 3)}, {"moe.w_down": Experts("mlp.experts.", "down_proj")})
        >>> s["layers.0.moe.w_down"].shape, [k.name for k in s["layers.0.moe.w_down"].leaves()]
        ((2, 4, 3), ['model.layers.0.mlp.experts.0.down_proj.weight', 'model.layers.0.mlp.experts.1.down_proj.weight'])
    """
    keys, out = set(keys or ()), {}
    for path, shape in shapes.items():
        if not path.startswith("layers."):
            out[path] = Key(HF_TOP[path], tuple(shape))
            continue
        _, i, name = path.split(".", 2)
        k = f"model.layers.{i}."
        names = {**layer_names, **fused} if fused and k + "mlp.experts.gate_up_proj" in keys else layer_names
        out[path] = _spec(names[name], k, shape)
    return out


def hf_names(shapes: Mapping[str, tuple], layer_names: Mapping[str, Union[str, list]]) -> dict[str, list[str]]:
    """Each parameter path -> the checkpoint key(s) it is made of, for name maps of plain keys only.

    Args:
        shapes: path -> shape.
        layer_names: name inside a layer -> one key, or keys concatenated on dim 0.
    Returns:
        path -> its keys.

    Example:
        >>> hf_names({"norm": (4,), "layers.0.mlp.w_down": (4, 8)}, {"mlp.w_down": "mlp.down_proj.weight"})
        {'norm': ['model.norm.weight'], 'layers.0.mlp.w_down': ['model.layers.0.mlp.down_proj.weight']}
    """
    out = {}
    for path in shapes:
        if not path.startswith("layers."):
            out[path] = [HF_TOP[path]]
            continue
        _, i, name = path.split(".", 2)
        entry = layer_names[name]
        out[path] = [f"model.layers.{i}.{e}" for e in ([entry] if isinstance(entry, str) else entry)]
    return out
