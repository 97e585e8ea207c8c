"""Layer widths by shape letter: the config field that holds each one and their reading.

A model declares in ``Model.width_fields`` only the letters its config names otherwise than
transformers (:data:`WIDTH_FIELDS`), so the memory plan, the job and the checkpoint code read a
width through :meth:`fmoe.model.Model.widths` and never guess a config field.

Example:
    >>> from fmoe.models import mixtral
    >>> cfg = mixtral.Config.tiny()
    >>> read_widths(cfg, mixtral.MODEL.width_fields).E == cfg.num_local_experts
    True
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

__all__ = ["WIDTH_FIELDS", "Widths", "field_of", "read_widths"]

#: Shape letter -> the config field that holds it, transformers' names; a model declares in
#: ``Model.width_fields`` only the letters its config names otherwise (None: it has none).
WIDTH_FIELDS = {"D": "hidden_size", "H": "num_attention_heads", "G": "num_key_value_heads", "hd": "head_dim",
                "V": "vocab_size", "L": "num_hidden_layers", "E": "num_experts", "K": "num_experts_per_tok",
                "I": "moe_intermediate_size", "Id": "intermediate_size"}


class Widths(NamedTuple):
    """A model's layer widths (:meth:`fmoe.model.Model.widths`): model dim D, query heads H, KV
    heads G (H when the config has none), head dim hd (D // H when none), vocabulary V, layers L,
    routed experts E, top-k K, expert hidden I, dense MLP hidden Id (0 when none), shared-expert
    hidden Is (0 when none; read from the model's shape table, ``moe.shared.w_down [D, Is]``)."""

    D: int
    H: int
    G: int
    hd: int
    V: int
    L: int
    E: int
    K: int
    I: int
    Id: int
    Is: int = 0


def field_of(letter: str, width_fields: Mapping[str, Optional[str]]) -> Optional[str]:
    """The config field holding the width ``letter``.

    Args:
        letter: a key of :data:`WIDTH_FIELDS`.
        width_fields: a model's declared overrides (letter -> field, or None: the config has none).
    Returns:
        the field's name, or None.
    """
    return width_fields.get(letter, WIDTH_FIELDS[letter])


def read_widths(cfg: Any, width_fields: Mapping[str, Optional[str]]) -> Widths:
    """The layer widths of ``cfg`` (0 for a width its config does not have).

    Args:
        cfg: a model config.
        width_fields: the model's declared overrides of :data:`WIDTH_FIELDS`.
    Returns:
        the :class:`Widths`.
    """
    v = {k: 0 if field_of(k, width_fields) is None else getattr(cfg, field_of(k, width_fields)) for k in WIDTH_FIELDS}
    H = v["H"] or 1
    return Widths(**{**v, "H": H, "G": v["G"] or H, "hd": v["hd"] or v["D"] // H})
