"""The model checks of a plan, run by :meth:`fmoe.model.Model.build_plan` before anything is placed.

A plan's placements are valid on their own (:meth:`fmoe.Plan.resolve` checks that the axes divide
the dims); what only the model knows is checked here:

- **whole tensor-parallel units**: a dim split over ``tp`` that holds heads (or experts' hidden
  units) must split whole ones, so ``tp`` divides the config field behind it (the model's
  ``tp_fields``), and a fused ``[gate | up]`` split over tp is packed, each half split alike;
- **sequence parallelism** (``fmoe.Mesh(tp=n, sp=True)``): between its tensor-parallel blocks a
  layer's activations are this rank's piece of the sequence, so the blocks must start colwise
  (gathering the sequence) and end rowwise (scattering it back), as the default plan splits
  them. A layer weight the default splits over tp that a plan replicates (attention over the
  piece only) or gathers (a full sequence added to the piece, broadcast silently when S == tp)
  would be silently wrong: refused.

Example:
    >>> from fmoe.models import qwen3_moe
    >>> cfg = qwen3_moe.Config.tiny()
    >>> shapes = qwen3_moe.init(cfg, seed=0)          # any tree with the shapes (meta tensors do)
    >>> check_tp_splits(qwen3_moe.plan(cfg), shapes, 2, cfg, qwen3_moe.MODEL.tp_fields, ())
    >>> check_sequence_parallel(qwen3_moe.plan(cfg).override({"layers.*.attn.wo": "replicate"}),
    ...                         qwen3_moe.plan(cfg), shapes)
    Traceback (most recent call last):
    ValueError: build_plan: with sequence parallelism (mesh sp=True) layers.0.attn.wo must keep ...
"""

from __future__ import annotations

from typing import Any, Mapping

from .. import tree as _tree
from ..sharding import Plan, check_fused_gate_up

__all__ = ["check_tp_splits", "check_sequence_parallel"]


def _rule(plan: Plan, path: str) -> str:
    return (plan.match(path) or ("<default>",))[0]


def check_tp_splits(plan: Plan, shapes: Any, tp: int, cfg: Any, tp_fields: Mapping[tuple, str],
                    fused_gate_up: tuple) -> None:
    """Raise ``ValueError`` naming the config field when ``plan`` splits part of a head over ``tp``.

    Args:
        plan: the plan to check.
        shapes: the parameter tree (meta tensors are enough).
        tp: the tensor-parallel size.
        cfg: the model config.
        tp_fields: ``{(name inside a layer, dim): config field}`` tp must divide when it splits that dim.
        fused_gate_up: layer parameter names holding a fused ``[gate | up]``.
    """
    problems: dict[str, str] = {}
    for path, p in _tree.flatten(plan.resolve(shapes)).items():
        d = p.dim_of("tp")
        if d is None or tp == 1:
            continue
        name = path.split(".", 2)[2] if path.startswith("layers.") else path
        if name in fused_gate_up:
            check_fused_gate_up(p, f"check_plan: {path} (rule {_rule(plan, path)!r})")
        fld = tp_fields.get((name, d))
        try:
            width = getattr(cfg, fld) if fld else None
        except AttributeError:
            raise ValueError(f"check_plan: {path} is split over tp, and the model's tp_fields name the config field "
                             f"{fld!r} for it, which {type(cfg).__name__} does not have") from None
        if fld and width % tp:
            problems.setdefault(fld, f"tp={tp} does not divide {fld}={getattr(cfg, fld)} "
                                     f"({path} is split over tp by rule {_rule(plan, path)!r})")
    if problems:
        order = list(dict.fromkeys(tp_fields.values()))
        raise ValueError("check_plan: " + "; ".join(problems[f] for f in order if f in problems))


def check_sequence_parallel(plan: Plan, default: Plan, shapes: Any) -> None:
    """Raise ``ValueError`` when ``plan`` changes the tensor-parallel split of a layer weight the
    ``default`` plan splits over tp (see the module docstring).

    Args:
        plan: the plan to check (user rules merged).
        default: the model's default plan.
        shapes: the parameter tree (meta tensors are enough).
    """
    given, want = _tree.flatten(plan.resolve(shapes)), _tree.flatten(default.resolve(shapes))
    for path, p in want.items():
        d = p.dim_of("tp")
        if not path.startswith("layers.") or d is None:
            continue
        q = given[path]
        if q.dim_of("tp") != d or q.gather != p.gather:
            raise ValueError(f"build_plan: with sequence parallelism (mesh sp=True) {path} must keep the "
                             f"default tensor-parallel split {p!r} (blocks start colwise, end rowwise); "
                             f"rule {_rule(plan, path)!r} places it {q!r}")
