"""The aux part of :func:`fmoe.testing.assert_parity` (``aux=True``): a router's aux values and
the gradients of its aux losses, on a mesh against one process.

``fn`` then returns ``(out, aux)``, ``aux`` as ``fmoe.moe`` returns it (one layer's dict, a
model's ``{"moe": [per-layer dicts]}``, or any dict / list holding such dicts). Compared, by their
dotted name (``moe.1.load_balance_loss``):

- the values every rank must agree on with one process: each loss entry (``router_keys`` kind
  ``"loss"``: a ``GlobalStat`` of the global batch, or a tensor loss averaged over the batches),
  ``load``, ``imbalance``, ``computed_slots``, and the statistics named in ``aux=[...]`` (a
  router's plain-tensor statistic is its rank's own value, so only the named ones are compared);
- the gradient of each loss key (summed over the layers) with respect to every parameter leaf:
  each rank backpropagates its copy of the global loss, and ``fmoe.gather`` sums the ranks'
  shares, which must equal the one-process gradient (:mod:`fmoe.routing.aux_losses`);
- each rank's own share of a replicated leaf's gradient (its pending sum, ``P(sum)``), against
  its batch's share in one process (:func:`shares`), so a bug on one rank names that rank.

A batch's share in one process: ``fn`` on that batch's inputs alone, each ``GlobalStat``'s sums
completed by the other batches' sums (detached), as a rank's all-reduce completes them (backward:
identity); the other batches' sums come from a first pass over every batch.

Example:
    >>> import torch
    >>> sorted(values({"moe": [{"z_loss": torch.tensor(1.0), "load": torch.ones(2), "note": torch.ones(1),
    ...                          "router_keys": {"z_loss": "loss", "note": "stat"}}]}, ()))
    ['moe.0.load', 'moe.0.z_loss']
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

from fmoe import tree as _tree
from fmoe.routing import global_stats as _stats

__all__ = ["batch", "leaves", "split", "values", "losses", "reference", "shares", "loss_grads", "grad_place", "GLOBAL_KEYS"]

#: the entries ``fmoe.moe`` writes that hold the global batch's value on every rank.
GLOBAL_KEYS = ("load", "imbalance", "computed_slots")


def batch(t: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Data-parallel batch ``b`` of ``n`` of an input (dim 0, as ``torch.tensor_split``)."""
    return torch.tensor_split(t, n, dim=0)[b]


def leaves(tree: Any, grads: bool) -> Any:
    """Fresh copies of the leaves, floating ones requiring grad (when grads are compared)."""
    return _tree.map_with_path(lambda _, t: t.detach().clone().requires_grad_(grads and t.is_floating_point()), tree)


def split(result: Any, aux: Any) -> tuple[torch.Tensor, Any]:
    """``fn``'s result as ``(out, aux)`` (``aux`` False: ``(result, None)``)."""
    if not aux:
        return result, None
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"assert_parity(aux=...): fn must return (out, aux) (the aux of fmoe.moe or of a model's "
                        f"forward with return_aux=True), got {type(result).__name__}")
    return result


def _dicts(aux: Any, prefix: str = "") -> Iterator[tuple[str, dict]]:
    """``(dotted prefix, dict)`` of every ``fmoe.moe`` aux dict (one with ``router_keys``) in ``aux``."""
    if isinstance(aux, dict) and "router_keys" in aux:
        yield prefix, aux
    elif isinstance(aux, dict):
        for k, v in aux.items():
            yield from _dicts(v, f"{prefix}{k}.")
    elif isinstance(aux, (list, tuple)):
        for i, v in enumerate(aux):
            yield from _dicts(v, f"{prefix}{i}.")


def values(aux: Any, stats: Sequence[str]) -> dict[str, torch.Tensor]:
    """``{dotted name: value}`` of the entries compared per rank (see the module docstring)."""
    out = {}
    for prefix, d in _dicts(aux):
        kinds = d["router_keys"]
        for k, v in d.items():
            if isinstance(v, torch.Tensor) and (kinds.get(k) == "loss" or k in GLOBAL_KEYS or k in stats):
                out[prefix + k] = v
    return out


def losses(aux: Any) -> dict[str, torch.Tensor]:
    """``{loss key: its sum over the layers}`` (differentiable)."""
    out: dict[str, torch.Tensor] = {}
    for _, d in _dicts(aux):
        for k, kind in d["router_keys"].items():
            if kind == "loss":
                out[k] = out[k] + d[k] if k in out else d[k]
    return dict(sorted(out.items()))


def reference(aux: Any, tree: Any, stats: Sequence[str], grads: bool) -> dict:
    """The one-process run's ``{"aux": values, "aux_grads": {loss key: {path: gradient}}}``."""
    ref = {"aux": {k: v.detach() for k, v in values(aux, stats).items()}}
    if grads:
        ref["aux_grads"] = {k: loss_grads(loss, tree) for k, loss in losses(aux).items()}
    return ref


def shares(fn: Callable, params: Any, inputs: Any, batches: int) -> list[dict]:
    """Each data-parallel batch's share of every aux loss's gradient, as the rank holding that
    batch computes it (module docstring): ``[{loss key: {path: gradient}}]``, one per batch.

    Args:
        fn: ``fn(params, inputs, mesh=None) -> (out, aux)``, run on one process.
        params: tree of full parameter tensors.
        inputs: a tensor or tree of tensors, split into ``batches`` along dim 0 (:func:`batch`).
        batches: the mesh's number of data-parallel batches.
    Returns:
        one dict per batch.
    """
    def run(b: int) -> tuple[Any, Any]:
        p = leaves(params, True)
        return p, split(fn(p, leaves(_tree.map_with_path(lambda _, t: batch(t, b, batches), inputs), False),
                           mesh=None), True)[1]

    sums: list[list[torch.Tensor]] = [[] for _ in range(batches)]

    def recorded(b: int) -> Callable:
        def reduce(tensors, mesh, summed_over_fsdp=None):
            sums[b].append(_stats.pack(list(tensors)).detach())
            return list(tensors)
        return reduce

    for b in range(batches):
        with mock.patch.object(_stats, "reduce_over_batches", recorded(b)):
            run(b)
    totals = [sum(s[i] for s in sums) for i in range(len(sums[0]))]
    out = []
    for b in range(batches):
        calls = iter(range(len(totals)))

        def completed(tensors, mesh, summed_over_fsdp=None, b=b, calls=calls):
            i, tensors = next(calls), list(tensors)
            return _stats._unpack(_stats.pack(tensors) + (totals[i] - sums[b][i]), tensors)

        with mock.patch.object(_stats, "reduce_over_batches", completed):
            p, aux = run(b)
            out.append({k: loss_grads(loss, p) for k, loss in losses(aux).items()})
    return out


def loss_grads(loss: torch.Tensor, tree: Any) -> dict:
    """``{path: d loss / d leaf}`` of every leaf that requires grad (zeros where unused); the graph
    is kept for the next loss."""
    flat = {k: t for k, t in _tree.flatten(tree).items() if t.requires_grad}
    if not loss.requires_grad:
        return {k: torch.zeros_like(t) for k, t in flat.items()}
    got = torch.autograd.grad(loss, list(flat.values()), retain_graph=True, allow_unused=True)
    return {k: g if g is not None else torch.zeros_like(flat[k]) for (k, g) in zip(flat, got)}


def grad_place(g: Any) -> str:
    """The placement of a gradient on its mesh (``fsdp=P(sum), ep=R``)."""
    if isinstance(g, DTensor):
        return ", ".join(f"{n}={p}" for n, p in zip(g.device_mesh.mesh_dim_names, g.placements))
    return "plain tensor"
