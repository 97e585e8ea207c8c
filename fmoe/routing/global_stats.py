"""Statistics over all data-parallel batches, computed by routers that never communicate.

A router sees only this rank's tokens, yet the load of an expert, a drop rate or a
load-balancing loss are properties of the *global* batch: the union of the distinct
data-parallel batches (the ranks of a tensor-parallel group hold the same batch and count once).
Such a quantity is written as a :class:`GlobalStat`: a dict of **sums over this rank's tokens**
(additive across batches) and a ``finish`` function applied to the sums over all batches::

    drop = GlobalStat({"dropped": n_dropped, "routed": n_routed},
                      lambda s: s["dropped"] / s["routed"])

A router puts it in ``Routing.aux``; ``fmoe.moe`` calls :func:`finalize`, which sums every
``GlobalStat``'s tensors over the data-parallel batches in **one** packed all-reduce (a tensor
shared by several stats is sent once) and replaces each entry by ``finish(global sums)``. In a
single process ``finish`` gets the local sums, so the value on N ranks equals the
single-process value on the union of their batches. The token dispatch can carry the packed
vector (:func:`pack` of :func:`stat_sums`) in its split-size exchange and hand ``finalize`` the
sum over the ``fsdp`` group (``summed_over_fsdp``): the same values and gradients, one
collective fewer per layer.

The all-reduce is ``fmoe.collectives.all_reduce`` (backward: identity) over the ranks with the
same tensor-parallel index: the ``fsdp`` group, then the ``dp_replicate`` group (sizes 1 are
skipped, so ``(dp_replicate, fsdp)`` needs no flattened group). Its backward gives each rank
``d finish / d sums`` times the derivative of *its own* sums: summed over the batches (one rank
per batch), the gradient equals the single-process gradient. :mod:`fmoe.routing.aux_losses` explains
what the trainer does with that.

``fmoe.moe`` adds, per layer: ``load`` (``[E]`` int64, routed assignments per expert over all
batches: slots with non-zero weight), ``imbalance`` (max / mean of ``load``, 1.0 when nothing is
routed), next to ``tokens_per_expert`` (this rank's slots per expert, zero-weight ones included).
Routers that drop tokens add ``drop_rate``. :func:`stack_layers` turns a model's per-layer aux
dicts into ``[L, ...]`` metrics.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import torch

from ..collectives import all_reduce, group_size

__all__ = ["GlobalStat", "finalize", "reduce_over_batches", "routed_load", "imbalance", "batch_mean",
           "weighted_sum", "stack_layers", "pack", "stat_sums"]


class GlobalStat(NamedTuple):
    """A quantity over the tokens of all data-parallel batches.

    Attributes:
        sums: name -> tensor, each a sum over this rank's tokens (same shapes on every rank).
        finish: ``finish(sums) -> tensor`` applied to the sums over all batches.
    """

    sums: dict
    finish: Callable[[dict], torch.Tensor]

    def local(self) -> torch.Tensor:
        """``finish`` on this rank's sums alone (the single-process value).

        Example:
            >>> GlobalStat({"n": torch.tensor(3.0)}, lambda s: s["n"] * 2).local()
            tensor(6.)
        """
        return self.finish(self.sums)


def _batch_groups(mesh, fsdp: bool = True) -> list:
    """Groups whose reduction sums over the distinct batches (same tp index): fsdp, dp_replicate;
    and tp with sequence parallelism (each tp rank routes its own piece of the sequence)."""
    sp = getattr(mesh, "sp", False)
    if mesh is None or (getattr(mesh, "num_batches", 1) == 1 and not sp):
        return []
    groups = ([mesh.group("fsdp")] + ([mesh.group("tp")] if sp else [])) if fsdp else []
    return [g for g in groups + [mesh.group("dp_replicate")] if group_size(g) > 1]


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors as one fp64 vector (integer counts stay exact): what the reduction sends."""
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])


def _unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for t in tensors:
        piece = flat[start:start + t.numel()].reshape(t.shape)
        start += t.numel()
        out.append(piece.round().to(t.dtype) if not t.dtype.is_floating_point else piece.to(t.dtype))
    return out


def reduce_over_batches(tensors: Sequence[torch.Tensor], mesh, summed_over_fsdp: Optional[torch.Tensor] = None
                        ) -> list[torch.Tensor]:
    """Sum each tensor over the distinct data-parallel batches (differentiable, backward identity).

    All tensors travel in one fp64 vector (:func:`pack`); results keep each input's dtype and
    shape. A no-op without a mesh or with one batch.

    Args:
        tensors: per-rank sums, same shapes on every rank.
        mesh: ``fmoe.Mesh`` or None.
        summed_over_fsdp: ``pack(tensors)`` already summed over the ``fsdp`` group by another
            exchange (the token dispatch folds it into its split-size exchange when its expert
            group holds the whole fsdp group); only ``dp_replicate`` is then left to reduce.
    Returns:
        the global sums, in order.

    Example:
        >>> reduce_over_batches([torch.tensor([1, 2])], None)
        [tensor([1, 2])]
    """
    tensors = list(tensors)
    if not _batch_groups(mesh) or not tensors:
        return tensors
    flat = pack(tensors) if summed_over_fsdp is None else summed_over_fsdp
    for g in _batch_groups(mesh, fsdp=summed_over_fsdp is None):
        flat = all_reduce(flat, g)
    return _unpack(flat, tensors)


def stat_sums(aux: Mapping[str, Any]) -> list[torch.Tensor]:
    """The distinct sum tensors of every :class:`GlobalStat` in ``aux`` (each once, in order):
    what :func:`finalize` reduces."""
    unique: list[torch.Tensor] = []
    for v in aux.values():
        if not isinstance(v, GlobalStat):
            continue
        for name, t in v.sums.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"GlobalStat sums must be tensors, got {name}={type(t).__name__}")
            if _index_of(t, unique) is None:       # by identity, not id(): torch.compile guards on ids
                unique.append(t)
    return unique


def _index_of(t: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Optional[int]:
    """Position of ``t`` itself (identity) in ``tensors``, or None."""
    return next((i for i, u in enumerate(tensors) if u is t), None)


def finalize(aux: Mapping[str, Any], mesh=None, summed_over_fsdp: Optional[torch.Tensor] = None) -> dict:
    """Replace every :class:`GlobalStat` in ``aux`` by its value over all data-parallel batches.

    Args:
        aux: a router's aux dict (other entries pass through unchanged).
        mesh: ``fmoe.Mesh`` or None (single process: local sums).
        summed_over_fsdp: ``pack(stat_sums(aux))`` already summed over the fsdp group (see
            :func:`reduce_over_batches`).
    Returns:
        a new dict.

    Example:
        >>> finalize({"rate": GlobalStat({"a": torch.tensor(1.0), "b": torch.tensor(4.0)},
        ...                              lambda s: s["a"] / s["b"]), "x": 1})
        {'rate': tensor(0.2500), 'x': 1}
    """
    sums = stat_sums(aux)
    reduced = reduce_over_batches(sums, mesh, summed_over_fsdp)
    out = dict(aux)
    for key, st in aux.items():
        if isinstance(st, GlobalStat):
            graph = any(t.requires_grad for t in st.sums.values())   # a sum of detached values stays detached
            out[key] = st.finish({n: reduced[_index_of(t, sums)] if graph else reduced[_index_of(t, sums)].detach()
                                  for n, t in st.sums.items()})
    return out


def weighted_sum(terms: Sequence[tuple[float, GlobalStat]]) -> GlobalStat:
    """``sum(coef * stat)`` as one GlobalStat (its tensors are shared with the terms, so
    :func:`finalize` sends them once).

    Example:
        >>> a = GlobalStat({"v": torch.tensor(2.0)}, lambda s: s["v"])
        >>> weighted_sum([(0.5, a), (3.0, a)]).local()
        tensor(7.)
    """
    terms = list(terms)
    sums = {f"{i}.{n}": t for i, (_, st) in enumerate(terms) for n, t in st.sums.items()}

    def finish(s: dict) -> torch.Tensor:
        total = 0.0
        for i, (coef, st) in enumerate(terms):
            total = total + coef * st.finish({n: s[f"{i}.{n}"] for n in st.sums})
        return torch.as_tensor(total)

    return GlobalStat(sums, finish)


def batch_mean(value: torch.Tensor) -> GlobalStat:
    """The mean over the data-parallel batches of a per-batch value (e.g. a router's loss on its
    own tokens): every rank gets the same value, and each rank's gradient is ``1/N`` of its own
    term's (what ``fmoe.moe`` makes of a :class:`fmoe.routing.Loss` of a plain tensor).

    Example:
        >>> batch_mean(torch.tensor(0.5)).local()
        tensor(0.5000)
    """
    return GlobalStat({"value": value, "batches": torch.ones((), dtype=value.dtype, device=value.device)},
                      lambda s: s["value"] / s["batches"])


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """``max(load) / mean(load)`` over experts (1.0 for a perfectly balanced or empty load).

    Example:
        >>> imbalance(torch.tensor([3, 1, 0, 0]))
        tensor(3.)
    """
    load = load.float()
    total = load.sum()
    return torch.where(total > 0, load.max() * load.numel() / total.clamp(min=1e-30), load.new_ones(()))


def routed_load(weights: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> dict[str, GlobalStat]:
    """``load`` and ``imbalance`` stats of a routing: assignments with non-zero weight per expert.

    Args:
        weights: ``[T, K]``.
        expert_ids: ``[T, K]`` global ids.
        num_experts: E.
    Returns:
        ``{"load": GlobalStat -> [E] int64, "imbalance": GlobalStat -> scalar}`` sharing one count.

    Example:
        >>> s = routed_load(torch.tensor([[1.0, 0.0]]), torch.tensor([[2, 0]]), 4)
        >>> s["load"].local().tolist(), s["imbalance"].local().item()
        ([0, 0, 1, 0], 4.0)
    """
    routed = (weights.detach() != 0).reshape(-1).long()                       # [T*K]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids.device)
    counts = counts.scatter_add(0, expert_ids.reshape(-1).clamp(min=0), routed)   # inactive (-1): weight 0
    return {"load": GlobalStat({"load": counts}, lambda s: s["load"]),
            "imbalance": GlobalStat({"load": counts}, lambda s: imbalance(s["load"]))}


def stack_layers(auxes: Sequence[Mapping[str, Any]], keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Per-layer aux dicts -> ``{key: [L, ...] tensor}`` for the keys every layer has (metrics).

    Args:
        auxes: one aux dict per MoE layer, in layer order.
        keys: keys to stack (default: every tensor key common to all layers).
    Returns:
        dict of stacked (detached) tensors.

    Example:
        >>> stack_layers([{"imbalance": torch.tensor(2.0)}, {"imbalance": torch.tensor(1.5)}])
        {'imbalance': tensor([2.0000, 1.5000])}
    """
    auxes = list(auxes)
    if not auxes:
        return {}
    if keys is None:
        keys = [k for k, v in auxes[0].items() if isinstance(v, torch.Tensor)
                and all(isinstance(a.get(k), torch.Tensor) and a[k].shape == v.shape for a in auxes)]
    missing = [k for k in keys if any(k not in a for a in auxes)]
    if missing:
        raise ValueError(f"stack_layers: keys {missing} are missing from some layers' aux")
    return {k: torch.stack([a[k].detach() for a in auxes]) for k in keys}
