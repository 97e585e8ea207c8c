"""A model's config: the ``Config`` base every model subclasses, its checks, and ``config.json``
both ways.

A model's ``Config`` is a frozen dataclass on :class:`ModelConfig` whose fields are named as in
transformers' config class. It states two tables as data: ``HF``, the fixed ``config.json``
fields (``model_type``, ``architectures``, ...: written by :meth:`ModelConfig.to_hf`, and
:meth:`ModelConfig.from_hf` refuses another value), and ``PRESETS``, preset name -> field values
(``Config.tiny(**changes)``)::

    @dataclass(frozen=True)
    class Config(kit.ModelConfig):
        vocab_size: int = 32000
        ...
        HF = {"model_type": "my_moe", "architectures": ["MyMoeForCausalLM"]}
        PRESETS = {"tiny": dict(vocab_size=128, hidden_size=64, ...), "small": dict(...)}

        def __post_init__(self):
            kit.check_config(self, experts="num_experts")   # from the field annotations

``config.json`` is read by :func:`from_hf_fields` (a null or absent ``head_dim`` /
``num_key_value_heads`` derived as transformers derives it; the rope by :func:`rope_from_hf`)
and written by :func:`to_hf_fields`.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Mapping, Optional, Sequence

import torch

from ..nn import rope_frequencies

__all__ = ["ModelConfig", "check_config", "rope", "rope_from_hf", "from_hf_fields", "to_hf_fields", "NOT_PASSED",
           "positions_warning"]

#: ``config.json`` keys read or written as the rope, and those describing the file rather than the
#: model (its weights' dtype, the writer's version): never passed through as unused fields.
NOT_PASSED = frozenset({"rope_parameters", "rope_scaling", "rope_theta", "dtype", "torch_dtype",
                        "transformers_version", "hf_extra"})


def check_config(cfg: Any, *, kv_heads: Optional[str] = "num_key_value_heads", experts: Optional[str] = None,
                 at_least_zero: Sequence[str] = (), rope_dim: Optional[int] = None) -> None:
    """The checks every ``Config.__post_init__`` shares, read from the field annotations.

    In field order: an ``int`` field is an int >= 1 (>= 0 if named in ``at_least_zero``), an
    ``Optional[int]`` None or that, a ``tuple`` a tuple; then ``pad_token_id`` None or a token id
    in ``[0, vocab_size)``, query heads a multiple of ``kv_heads``, top-k at most ``experts``, and
    the rope settings valid (:func:`rope`).

    Args:
        cfg: the config being built (call from its ``__post_init__``).
        kv_heads: the field of the KV heads (None: the model has none, e.g. latent attention).
        experts: the field of the routed expert count (None: no top-k check).
        at_least_zero: ``int`` fields that may be 0.
        rope_dim: rotary features (default ``cfg.head_dim``).
    Returns:
        None; ``ValueError`` (``TypeError`` for a tuple field) naming the field otherwise.

    Example:
        >>> from fmoe.models import mixtral
        >>> mixtral.Config.tiny(num_experts_per_tok=9)
        Traceback (most recent call last):
        ValueError: Config: num_experts_per_tok=9 exceeds num_local_experts=8
    """
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        v, hint, low = getattr(cfg, f.name), hints[f.name], 0 if f.name in (*at_least_zero, "pad_token_id") else 1
        if hint is int or (hint == Optional[int] and v is not None):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"Config: {f.name} must be {'None or ' * (hint is not int)}an int >= {low}, got {v!r}")
        elif hint is tuple and not isinstance(v, tuple):
            raise TypeError(f"Config: {f.name} must be a tuple, got {v!r}")
    if cfg.pad_token_id is not None and cfg.pad_token_id >= cfg.vocab_size:
        raise ValueError(f"Config: pad_token_id={cfg.pad_token_id} must be None or a token id below "
                         f"vocab_size={cfg.vocab_size}")
    if kv_heads is not None and cfg.num_attention_heads % getattr(cfg, kv_heads):
        raise ValueError(f"Config: num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                         f"{kv_heads}={getattr(cfg, kv_heads)}")
    if experts is not None and cfg.num_experts_per_tok > getattr(cfg, experts):
        raise ValueError(f"Config: num_experts_per_tok={cfg.num_experts_per_tok} exceeds "
                         f"{experts}={getattr(cfg, experts)}")
    rope(cfg, rope_dim)


def positions_warning(cfg: Any, positions: int, what: str) -> Optional[str]:
    """The warning for a sequence of ``positions`` longer than the model's ``max_position_embeddings``.

    transformers warns the same way and runs on: positions past the trained length are rope
    extrapolation, which a checkpoint trained at that length has never seen.

    Args:
        cfg: a model config (one not built on :class:`ModelConfig` states no limit).
        positions: the sequence's length (a prompt and its new tokens, or ``--seq``).
        what: how the caller names that length (``"--seq 4096"``).
    Returns:
        the warning text, or None when the length is within the model's (or it states none).

    Example:
        >>> from fmoe.models import llama
        >>> positions_warning(llama.Config.tiny(), 300, "--seq 300")
        "--seq 300 is longer than the model's max_position_embeddings=256: positions past it are extrapolated by the rope, never trained"
        >>> positions_warning(llama.Config.tiny(), 256, "--seq 256") is None
        True
    """
    limit = cfg.max_position_embeddings if isinstance(cfg, ModelConfig) else None
    if limit is None or positions <= limit:
        return None
    return (f"{what} is longer than the model's max_position_embeddings={limit}: positions past it are "
            "extrapolated by the rope, never trained")


def rope(cfg: Any, dim: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """The config's rotary frequencies (:func:`fmoe.nn.rope_frequencies`).

    Args:
        cfg: a config with ``head_dim``, ``rope_theta``, ``rope_scaling``, ``max_position_embeddings``.
        dim: rotary features (default ``cfg.head_dim``).
    Returns:
        ``(inv_freq [dim / 2], attention scaling)``.

    Example:
        >>> from fmoe.models import llama
        >>> rope(llama.Config.tiny())[0].shape
        torch.Size([8])
    """
    return rope_frequencies(cfg.head_dim if dim is None else dim, cfg.rope_theta, dict(cfg.rope_scaling) or None,
                            cfg.max_position_embeddings)


def rope_from_hf(hf: Mapping[str, Any], default_theta: float,
                 default: Optional[Mapping[str, Any]] = None) -> tuple[float, tuple]:
    """The rope settings of a ``config.json`` (transformers 4.x ``rope_scaling`` / ``rope_theta``
    or 5.x ``rope_parameters``).

    Args:
        hf: the ``config.json`` dict.
        default_theta: ``rope_theta`` when the file has none.
        default: the rope parameters when the file has none.
    Returns:
        ``(rope_theta, rope_scaling)``: ``rope_scaling`` is ``()`` for the default rope, else the
        sorted ``(key, value)`` pairs (hashable, for frozen configs).

    Example:
        >>> rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e4)
        (1000000.0, ())
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or default or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), () if kind == "default" else tuple(sorted(params.items()))


def from_hf_fields(cls: type, hf: Mapping[str, Any], want: Mapping[str, Any]) -> dict:
    """``Config`` keyword arguments read from a ``config.json`` dict.

    ``ValueError`` unless every ``want`` key is absent or as wanted; the rope fields by
    :func:`rope_from_hf` (no rope given: the class's default ``rope_scaling``); every other field
    of ``cls`` that ``hf`` holds, a ``tuple`` field from a JSON list (null: empty). A ``head_dim``
    or ``num_key_value_heads`` that is null or absent is derived as transformers derives it
    (``hidden_size // num_attention_heads``; ``num_attention_heads``); any other null is passed on,
    for the config to take (an ``Optional`` field) or refuse, naming the field.

    Args:
        cls: the ``Config`` dataclass.
        hf: the ``config.json`` dict.
        want: fixed fields (``{"model_type": ...}``).
    Returns:
        the keyword arguments of ``cls``.

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
    known = {f.name for f in fields(cls)} | set(cls.HF) | NOT_PASSED
    tuples = {name for name, hint in typing.get_type_hints(cls).items() if hint is tuple}
    kw = {f.name: tuple(hf[f.name] or ()) if f.name in tuples else hf[f.name] for f in fields(cls)
          if f.name in hf and f.name not in ("rope_theta", "rope_scaling")}
    H = kw.get("num_attention_heads", getattr(cls, "num_attention_heads", None))
    derived = {"num_key_value_heads": H,
               "head_dim": kw.get("hidden_size", cls.hidden_size) // H if isinstance(H, int) and H > 0 else None}
    kw.update({k: v for k, v in derived.items() if k in {f.name for f in fields(cls)} and kw.get(k) is None})
    kw["hf_extra"] = tuple(sorted((k, v) for k, v in hf.items() if k not in known))   # passed through to to_hf
    return {"rope_theta": theta, "rope_scaling": scaling, **kw}


def to_hf_fields(cfg: Any, head: Mapping[str, Any]) -> dict:
    """The ``config.json`` of ``cfg``.

    Args:
        cfg: a config dataclass.
        head: the fixed fields written first (model type, architectures, ...).
    Returns:
        ``head``, every field (a tuple as a list), then ``rope_parameters``.

    Example:
        >>> from fmoe.models import llama
        >>> to_hf_fields(llama.Config.tiny(), {"model_type": "llama"})["rope_parameters"]
        {'rope_type': 'default', 'rope_theta': 10000.0}
    """
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()
           if k not in ("rope_theta", "rope_scaling", "hf_extra")}
    params = {"rope_type": "default", **dict(cfg.rope_scaling), "rope_theta": cfg.rope_theta}
    return {**dict(cfg.hf_extra if isinstance(cfg, ModelConfig) else ()), **head, **out, "rope_parameters": params}


@dataclass(frozen=True)
class ModelConfig:
    """The base of every model's frozen ``Config`` dataclass.

    A subclass states two tables: ``HF``, the fixed ``config.json`` fields of transformers' class
    (``model_type``, ``architectures``, ...: written by :meth:`to_hf`, and :meth:`from_hf` refuses
    another value), and ``PRESETS``, preset name -> field values (``Config.tiny(**changes)``).

    Attributes:
        pad_token_id: the one field every model shares, as transformers' ``PretrainedConfig``:
            the token whose embedding row gets no gradient (:func:`fmoe.model.start` passes it to
            ``fmoe.nn.embedding(padding_idx=)``, as transformers' ``nn.Embedding(padding_idx=)``);
            None: every row learns. A subclass may redeclare its default (OLMoE's is 1).
        max_position_embeddings: the longest sequence the model was trained for, as transformers'
            field (None: not stated). fmoe does not refuse longer sequences (rope extrapolates), but
            ``fmoe train --seq`` and :func:`fmoe.generate` warn past it (:func:`positions_warning`).
        hf_extra: the ``config.json`` fields the model does not use (sorted ``(key, value)``
            pairs, :func:`from_hf_fields`), written back by :meth:`to_hf` so a loaded and saved
            checkpoint keeps them (``bos_token_id``, ``use_cache``, ...); not compared.
    """

    HF: ClassVar[Mapping[str, Any]] = {}
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    pad_token_id: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    hf_extra: tuple = field(default=(), compare=False, repr=False)

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
