"""What every model file shares: reading rope fields of a ``config.json``, and the config
fields a tensor-parallel split must divide (:data:`TP_FIELDS`, checked by
:meth:`fmoe.model.Model.build_plan`). The wrappers every model needs (``check_plan``, ``shard``,
``load_hf``, ``save_hf``) are :class:`fmoe.model.Model` methods, declared once per model file
as ``MODEL``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["rope_from_hf", "TP_FIELDS", "AUX_LOSS_FIELDS"]

#: (parameter name inside a layer, tensor dim) -> the config field tp must divide when that dim
#: is split over tp: attention by whole heads, a dense MLP by its hidden size.
TP_FIELDS = {
    ("attn.wq", 0): "num_attention_heads", ("attn.bq", 0): "num_attention_heads",
    ("attn.wo", 1): "num_attention_heads", ("attn.sinks", 0): "num_attention_heads",
    ("attn.wq_b", 0): "num_attention_heads", ("attn.wkv_b", 0): "num_attention_heads",  # MLA
    ("attn.wk", 0): "num_key_value_heads", ("attn.bk", 0): "num_key_value_heads",
    ("attn.wv", 0): "num_key_value_heads", ("attn.bv", 0): "num_key_value_heads",
    ("mlp.w_gate_up", 0): "intermediate_size", ("mlp.b_gate_up", 0): "intermediate_size",
    ("mlp.w_down", 1): "intermediate_size",
}

#: transformers' switch and weight of the router's load-balance loss (qwen3_moe, mixtral, gpt_oss):
#: the ``Model.aux_loss_fields`` the trainer sets through ``Model.with_aux_loss``.
AUX_LOSS_FIELDS = ("output_router_logits", "router_aux_loss_coef")


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
