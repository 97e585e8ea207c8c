"""What every model file shares: reading rope fields of a ``config.json`` and checking a plan
against the config (whole heads per tp rank, fused gate/up split per half).

Model files stay readable top to bottom; the few lines of bookkeeping they would otherwise
repeat live here.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch

import fmoe
from fmoe import P, Plan

__all__ = ["rope_from_hf", "check_plan", "TP_FIELDS"]

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


def check_plan(cfg: Any, rules: Union[Plan, Mapping[str, Union[str, P]], None], tp: int, *,
               default: Plan, shapes: Mapping[str, tuple]) -> Plan:
    """The plan to use — ``rules`` as a Plan, user rules merged over ``default`` by key, or
    ``default`` — after checking it can shard the model over ``tp`` ranks: tp divides every
    config field of :data:`TP_FIELDS` whose dim the plan splits over tp, and a split dense fused
    gate/up is packed (split per half). ``ValueError`` naming the fields otherwise.

    Args:
        cfg: the model config.
        rules: a Plan, user rules, or None.
        tp: tensor-parallel size.
        default: the model's default plan.
        shapes: every parameter path -> shape.
    Returns:
        the checked Plan.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"check_plan: tp must be an int >= 1, got {tp!r}")
    plan = rules if isinstance(rules, Plan) else default if rules is None else default.override(rules)
    tree = fmoe.tree.unflatten({k: torch.empty(tuple(s), device="meta") for k, s in shapes.items()})
    problems: dict[str, str] = {}
    for path, p in fmoe.tree.flatten(plan.resolve(tree)).items():
        d = p.dim_of("tp")
        if d is None or tp == 1:
            continue
        name = path.split(".", 2)[2] if path.startswith("layers.") else path
        rule = (plan.match(path) or ("<default>",))[0]
        if name in ("mlp.w_gate_up", "mlp.b_gate_up") and d == 0 and p.packed != 2:
            raise ValueError(f"check_plan: {path} is split over tp as {p!r} by rule {rule!r}; the fused "
                             "[gate | up] weight must be split per half (style 'packed_colwise')")
        field = TP_FIELDS.get((name, d))
        if field and getattr(cfg, field) % tp:
            problems.setdefault(field, f"tp={tp} does not divide {field}={getattr(cfg, field)} "
                                       f"({path} is split over tp by rule {rule!r})")
    if problems:
        order = list(dict.fromkeys(TP_FIELDS.values()))
        raise ValueError("check_plan: " + "; ".join(problems[f] for f in order if f in problems))
    return plan
