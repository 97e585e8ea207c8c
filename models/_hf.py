"""Hugging Face interop every model file shares: the ``Config`` base (:class:`ModelConfig`:
presets as data, ``config.json`` both ways through :func:`from_hf_fields`, :func:`to_hf_fields`,
:func:`rope_from_hf`) and the checkpoint name map turned into specs.

A model's name map is a table: parameter name inside layer N -> what it is made of, under the
key prefix ``model.layers.N.``::

    "attn.wq": "self_attn.q_proj.weight"                                 # one key
    "mlp.w_gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]       # keys concatenated on dim 0
    "moe.w_gate_up": Experts("mlp.experts.", "gate_proj", "up_proj")      # one key per expert, stacked
    "moe.w_down": lambda k, shape: Transpose(Key(k + "...", ...), 1, 2)   # any spec

:func:`hf_specs` reads it with the model's parameter shapes (the model's ``shapes(cfg)``, the
one table ``init`` uses too), so a spec's shape is never written twice.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, Union

from fmoe.checkpoint import Cat, Key, Spec, Stack

__all__ = ["ModelConfig", "rope_from_hf", "from_hf_fields", "to_hf_fields", "HF_TOP", "Experts", "hf_specs", "hf_names"]


# ---------------------------------------------------------------------------- config.json
def rope_from_hf(hf: Mapping[str, Any], default_theta: float,
                 default: Optional[Mapping[str, Any]] = None) -> tuple[float, tuple]:
    """``(rope_theta, rope_scaling)`` from a ``config.json`` (transformers 4.x ``rope_scaling`` /
    ``rope_theta`` or 5.x ``rope_parameters``); ``rope_scaling`` is ``()`` for the default rope,
    else the sorted ``(key, value)`` pairs (hashable, for frozen configs).

    Example:
        >>> rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e4)
        (1000000.0, ())
    """
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or default or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", default_theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    return float(theta), () if kind == "default" else tuple(sorted(rope.items()))


def from_hf_fields(cls: type, hf: Mapping[str, Any], want: Mapping[str, Any]) -> dict:
    """``Config`` keyword arguments read from a ``config.json`` dict: ``ValueError`` unless every
    ``want`` key is absent or as wanted; the rope fields by :func:`rope_from_hf` (no rope given:
    the class's default ``rope_scaling``); every other field of ``cls`` that ``hf`` holds, a
    ``tuple`` field from a JSON list (null: empty). A ``head_dim`` or ``num_key_value_heads``
    that is null or absent is derived as transformers derives it (``hidden_size //
    num_attention_heads``; ``num_attention_heads``); any other null is passed on, for the config
    to take (an ``Optional`` field) or refuse, naming the field.

    Example:
        >>> from fmoe.models import llama
        >>> from_hf_fields(llama.Config, {"model_type": "mixtral"}, {"model_type": "llama"})
        Traceback (most recent call last):
        ValueError: Config.from_hf: model_type must be 'llama', got 'mixtral'
        >>> from_hf_fields(llama.Config, {"hidden_size": 96, "num_attention_heads": 4, "head_dim": None}, {})["head_dim"]
        24
    """
    for key, value in want.items():
        if hf.get(key, value) != value:
            raise ValueError(f"Config.from_hf: {key} must be {value!r}, got {hf.get(key)!r}")
    theta, scaling = rope_from_hf(hf, cls.rope_theta, default=dict(cls.rope_scaling))
    tuples = {name for name, hint in typing.get_type_hints(cls).items() if hint is tuple}
    kw = {f.name: tuple(hf[f.name] or ()) if f.name in tuples else hf[f.name] for f in fields(cls)
          if f.name in hf and f.name not in ("rope_theta", "rope_scaling")}
    H = kw.get("num_attention_heads", getattr(cls, "num_attention_heads", None))
    derived = {"num_key_value_heads": H,
               "head_dim": kw.get("hidden_size", cls.hidden_size) // H if isinstance(H, int) and H > 0 else None}
    kw.update({k: v for k, v in derived.items() if k in {f.name for f in fields(cls)} and kw.get(k) is None})
    return {"rope_theta": theta, "rope_scaling": scaling, **kw}


def to_hf_fields(cfg: Any, head: Mapping[str, Any]) -> dict:
    """The ``config.json`` of ``cfg``: ``head`` (model type, ...), every field (a tuple as a
    list), then ``rope_parameters``.

    Example:
        >>> from fmoe.models import llama
        >>> to_hf_fields(llama.Config.tiny(), {"model_type": "llama"})["rope_parameters"]
        {'rope_type': 'default', 'rope_theta': 10000.0}
    """
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()
           if k not in ("rope_theta", "rope_scaling")}
    rope = {"rope_type": "default", **dict(cfg.rope_scaling), "rope_theta": cfg.rope_theta}
    return {**head, **out, "rope_parameters": rope}

class ModelConfig:
    """The base of every model's frozen ``Config`` dataclass (it adds no field).

    A subclass states two tables: ``HF``, the fixed ``config.json`` fields of transformers' class
    (``model_type``, ``architectures``, ...: written by :meth:`to_hf`, and :meth:`from_hf` refuses
    another value), and ``PRESETS``, preset name -> field values (``Config.tiny(**changes)``).
    """

    HF: ClassVar[Mapping[str, Any]] = {}
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    @classmethod
    def preset(cls, name: str, **changes: Any) -> Any:
        """The preset ``name`` of ``PRESETS`` with ``changes``; ``ValueError`` listing the presets otherwise."""
        if name not in cls.PRESETS:
            raise ValueError(f"{cls.__module__}.Config: unknown preset {name!r}; valid: {list(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **changes})

    @classmethod
    def tiny(cls, **changes: Any) -> Any:
        """The test-sized preset (2-3 layers, D=64: tp <= 4 and ep <= 8 divide it), with ``changes``.

        Example:
            >>> from fmoe.models import mixtral
            >>> mixtral.Config.tiny(num_hidden_layers=3).num_hidden_layers
            3
        """
        return cls.preset("tiny", **changes)

    @classmethod
    def small(cls, **changes: Any) -> Any:
        """The example and benchmark preset (4 layers, D=256), with ``changes``."""
        return cls.preset("small", **changes)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Any:
        """Read a Hugging Face ``config.json`` dict (:func:`from_hf_fields`).

        Example:
            >>> from fmoe.models import gpt_oss
            >>> gpt_oss.Config.from_hf(gpt_oss.Config.tiny().to_hf()) == gpt_oss.Config.tiny()
            True
        """
        return cls(**from_hf_fields(cls, hf, {k: v for k, v in cls.HF.items() if k != "architectures"}))

    def to_hf(self) -> dict:
        """The ``config.json`` fields transformers' class reads (:func:`to_hf_fields`)."""
        return to_hf_fields(self, self.HF)


# ---------------------------------------------------------------------------- checkpoint name maps
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
    "up_proj")``: ``w_gate_up [E, 2I, D]``)."""

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
    """Every parameter path of ``shapes`` -> its spec: top-level paths from :data:`HF_TOP`,
    ``layers.N.<name>`` from ``layer_names[name]`` under the prefix ``model.layers.N.``. Where
    ``keys`` (the checkpoint's) hold the layer's ``mlp.experts.gate_up_proj`` (transformers'
    fused in-memory layout), the entries of ``fused`` replace those of ``layer_names``.

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
    """Each parameter path -> the checkpoint key(s) it is made of (several: concatenated on dim 0),
    for name maps of plain keys only.

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
