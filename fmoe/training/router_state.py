"""The routers' state in a training step (:mod:`fmoe.routing.state`): which states a run carries,
their update after each optimizer step, their log-row entries, and the leaves they add.

A run's states are its router's own (``router.state``, e.g. ReMoE's ``l1_coef``) and the expert
bias when the parameters hold ``expert_bias``, moved at ``StepConfig.bias_rate``
(:func:`fmoe.routing.state.bias_state`: ``--balance bias``, deepseek_v3's default; 0: frozen, logged). Each is updated
by the same loop, from the same per-layer statistics: the layer's ``load`` over the step's
micro-batches and global batch, and every statistic the router reports, averaged over the
micro-batches. The state entries are parameter leaves, so checkpoints save them and ``--resume``
continues them bitwise. A resume into a stateful router from a checkpoint without its state
(``--router remoe --router-changed`` on a top-k run) starts the missing entries from the router's
``init``, and a state the new router does not read is dropped; both said on stderr
(:func:`on_resume`, with the router change itself).

Example:
    >>> import fmoe
    >>> states = run_states(fmoe.routing.remoe(k=2), {"layers.0.moe.router": torch.zeros(4, 2)}, 0.0, "sign")
    >>> sorted(names(states, 4))
    ['l1_coef']
"""

from __future__ import annotations

from typing import Any, Collection, Optional, Sequence

import torch

from ..routing.state import RouterState, bias_state, init_layer, is_state, scalars, state_of, update_layer
from ..sharding import gather

__all__ = ["run_states", "names", "with_states", "on_resume", "update", "metrics"]


def run_states(router: Any, flat: dict, bias_rate: float, bias_update: str) -> list[RouterState]:
    """The states a step updates and logs: the router's own, then the expert bias when the params
    hold one (frozen at ``bias_rate`` 0)."""
    own = state_of(router) if router is not None else None
    biased = any(p.endswith("moe.expert_bias") for p in flat)
    return [s for s in (own, bias_state(bias_rate, bias_update) if biased else None) if s is not None]


def names(states: Sequence[RouterState], num_experts: int) -> list[str]:
    """The entries the states declare (their ``init`` keys)."""
    return [n for s in states for n in s.init(num_experts)]


def with_states(full: dict, router: Any) -> dict:
    """A model tree with the router's initial state in every MoE layer lacking it.

    Example:
        >>> import fmoe
        >>> t = with_states({"layers": [{"moe": {"router": torch.zeros(4, 2)}}]}, fmoe.routing.remoe())
        >>> t["layers"][0]["moe"]["l1_coef"]
        tensor(0.0010)
    """
    state = state_of(router) if router is not None else None
    if state is None:
        return full
    layers = [{**layer, "moe": init_layer(layer["moe"], state)} if layer is not None and "moe" in layer else layer
              for layer in full["layers"]]
    return {**full, "layers": layers}


def on_resume(where: str, old: Optional[str], new: Optional[str], saved: Collection[str],
              paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """What a resume does with router state: the state leaves of ``paths`` (this rank's
    parameters) that the checkpoint's ``saved`` paths lack, which keep their ``init`` values,
    and the notes to print (the router change ``old`` -> ``new``, the entries started fresh, those dropped).

    Example:
        >>> fresh, notes = on_resume("run/step-2", "topk:k=2", "remoe", {"layers.0.moe.router"},
        ...                          ["layers.0.moe.router", "layers.0.moe.l1_coef"])
        >>> fresh
        ['layers.0.moe.l1_coef']
        >>> print(notes[1])
        --resume run/step-2 holds no router state l1_coef: 1 leaf starts from --router remoe's init
    """
    name = lambda p: p.rsplit(".", 1)[-1]                                    # noqa: E731
    own = "(the model's own)"
    fresh = [p for p in paths if is_state(p) and p not in saved]
    notes = [f"--router-changed: --resume {where} trained with --router {old or own}; continuing with --router "
             f"{new or own}"] if old != new else []
    if fresh:
        notes.append(f"--resume {where} holds no router state {', '.join(sorted({name(p) for p in fresh}))}: "
                     f"{len(fresh)} lea{'f starts' if len(fresh) == 1 else 'ves start'} from --router {new or own}'s init")
    dropped = sorted({name(p) for p in saved if is_state(p)} - {name(p) for p in paths if is_state(p)})
    if dropped and any(p.endswith("moe.router") for p in paths):          # (a pipeline stage without MoE layers: none)
        notes.append(f"--resume {where}: router state {', '.join(dropped)} is not read by --router {new or own}; dropped")
    return fresh, notes


def update(states: Sequence[RouterState], flat: dict, moe_paths: Sequence[str], loads: Optional[list],
           per_micro: Sequence[dict]) -> None:
    """Move every MoE layer's state in ``flat`` (in place) by each state's update from the step's
    statistics of that layer (see the module docstring)."""
    for i, p in enumerate(moe_paths):
        stats = {k: torch.stack([m[k][i].to(torch.float64) for m in per_micro]).mean(0)
                 for k in (per_micro[0] if per_micro else {}) if per_micro[0][k][i] is not None}
        if loads is not None:
            stats["load"] = loads[i]
        for state in states:
            keys = list(state.init(flat[p + ".router"].shape[0]))
            new = update_layer(state, {k: flat[f"{p}.{k}"] for k in keys}, stats)
            flat.update({f"{p}.{k}": v for k, v in new.items()})


def metrics(states: Sequence[RouterState], flat: dict, moe_paths: Sequence[str]) -> dict:
    """The log-row entries of the states: per MoE layer, a scalar entry's value, a vector's largest
    magnitude (``expert_bias_absmax``). Collective (a sharded entry is gathered)."""
    if not states or not moe_paths:
        return {}
    keys = names(states, flat[moe_paths[0] + ".router"].shape[0])
    full = gather({f"{p}.{k}": flat[f"{p}.{k}"].detach() for p in moe_paths for k in keys})
    out: dict = {}
    for k in keys:
        for p in moe_paths:
            name, value = scalars(k, full[f"{p}.{k}"])
            out.setdefault(name, []).append(value)
    return out
