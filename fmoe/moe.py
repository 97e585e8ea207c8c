"""The functional mixture-of-experts layer.

``y, aux = moe(params, x, router=..., mesh=..., impl=...)`` routes each of this rank's tokens
to ``K`` of ``E`` SwiGLU experts and returns the weighted sum of their outputs::

    logits = x @ router.T (+ router_bias)          # [T, E]
    weights, ids, aux = router(logits)             # [T, K] each
    y[t] = sum_k weights[t, k] * expert[ids[t, k]](x[t])

``params`` is ``{"router": [E, D], "w_gate_up": [E, 2I, D], "w_down": [E, D, I]}`` (optionally
``router_bias [E]``, ``b_gate_up [E, 2I]``, ``b_down [E, D]``): plain tensors in a single
process, or as placed by ``fmoe.shard`` with experts on ``P("ep", None, None)`` (any ``efsdp``
split is gathered for the call). Plain full expert tensors on an ``ep > 1`` mesh are sliced to
this rank's block.

Which implementation moves the tokens is chosen by ``impl`` (see :mod:`fmoe.ep` for the
contract, the gradient semantics and the built-ins): ``"all_to_all"``, ``"all_reduce"``,
``"auto"`` (all_reduce when the expert group shares one batch — ``ep == tp`` — and no gradient
is needed, all_to_all otherwise) or any name given to ``fmoe.ep.register``.

With sequence parallelism (``mesh.sp``: ``fmoe.Mesh(tp=n, sp=True)``) ``x`` is this rank's
piece of the tokens, distinct on each rank of a tp group (the model's activations are split over
tp on the sequence): the dispatch sends them as they are (no tp slicing, no gathering back), the
router's gradient is ``Partial`` over tp, the statistics are summed over tp too, and the
implementations that need a batch shared by the expert group (``all_reduce``) are refused.

Routers may take keyword inputs besides the logits (:func:`fmoe.routing.call`): their state,
every entry of ``params`` that is not a weight of the layer (:mod:`fmoe.routing.state`; e.g.
``expert_bias [E]``, detached: selection-only state updated by ``fmoe.routing.update_bias``
after each step, never by gradients), and every entry of ``router_inputs`` (per-batch
tensors such as ``token_ids [T]`` or ``seq_ids [T]``); the inputs every model offers
(``fmoe.routing.OFFERED``: ``token_ids``, ``layer``) reach only the routers that declare them. ``params["shared"]`` adds shared experts
(:mod:`fmoe.nn.shared_experts`).

``aux`` holds the router's own entries, with every :class:`fmoe.routing.global_stats.GlobalStat` (aux
losses, drop rates) reduced over the data-parallel batches and finished (a
:class:`fmoe.routing.Loss` unwrapped: a tensor loss becomes its mean over the batches), the
kind of each in ``router_keys`` (``{key: "loss" | "stat"}``: what a trainer adds to the loss,
what it logs; :mod:`fmoe.routing.core`), plus
``tokens_per_expert`` (``[E]`` int64, this rank's slots per global expert), ``dispatch_rows``
(rows this rank sent to *other* ranks), ``load`` (``[E]`` int64, routed slots per expert over all
batches), ``imbalance`` (max / mean of ``load``) and ``computed_slots`` (the active slots the
experts compute over all batches: inactive slots, expert id ``-1``, are neither sent nor
computed; logged per layer like a router statistic). All statistics travel in one small
all-reduce over the batches, or inside the token dispatch's split-size exchange when its expert
group holds the whole fsdp group (``impl.folds_stats``, :mod:`fmoe.ep.contract`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch.distributed.tensor import DTensor

from . import ep as _ep
from .experts.activations import Activation, swiglu
from .experts import LocalExperts, check_matmul
from .fsdp import unshard
from .mesh import Mesh
from .routing.global_stats import GlobalStat, finalize, pack, routed_load, stat_sums
from .routing import Router, call, validate
from .routing.core import active, as_stats
from .routing.inputs import accepted
from .routing.state import state_keys
from .nn.shared_experts import check_shared, shared_expert
from .precision import gemm
from .sharding import sequence_parallel
from .transforms import peel, refuse_compiled_transform

__all__ = ["moe"]

_EXPERT_KEYS = ("w_gate_up", "w_down", "b_gate_up", "b_down")


def _check_params(params: Any, x: torch.Tensor) -> tuple[int, int, int]:
    if not isinstance(params, dict):
        raise TypeError(f"moe: params must be a dict, got {type(params).__name__}")
    missing = [k for k in ("router", "w_gate_up", "w_down") if k not in params]
    if missing:
        raise ValueError(f"moe: params is missing {missing}; expected keys router [E, D], "
                         f"w_gate_up [E, 2I, D], w_down [E, D, I]")
    state = state_keys(params)
    bad = sorted(k for k in state if not isinstance(params[k], torch.Tensor)
                 or not params[k].dtype.is_floating_point)
    if bad:
        raise ValueError(f"moe: unexpected params {bad}; valid keys: router, router_bias, shared, "
                         f"{', '.join(_EXPERT_KEYS)}, and floating-point router state (e.g. expert_bias) that "
                         "the router declares as a keyword input")
    r, gu, dn = params["router"], params["w_gate_up"], params["w_down"]
    if r.ndim != 2:
        raise ValueError(f"moe: router must be [E, D], got shape {tuple(r.shape)}")
    E, D = r.shape
    if gu.ndim != 3 or gu.shape[0] != E or gu.shape[2] != D or gu.shape[1] % 2:
        raise ValueError(f"moe: w_gate_up must be [E={E}, 2I, D={D}], got shape {tuple(gu.shape)}")
    I = gu.shape[1] // 2
    if tuple(dn.shape) != (E, D, I):
        raise ValueError(f"moe: w_down must be [E={E}, D={D}, I={I}], got shape {tuple(dn.shape)}")
    shapes = (("router_bias", (E,)), ("expert_bias", (E,)), ("b_gate_up", (E, 2 * I)), ("b_down", (E, D)))
    for key, shape in shapes:
        if key in params and tuple(params[key].shape) != shape:
            raise ValueError(f"moe: {key} must have shape {shape}, got {tuple(params[key].shape)}")
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"moe: x must be a [T, D] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.shape[1] != D:
        raise ValueError(f"moe: x has model dim {x.shape[1]} but the router expects D={D}")
    if "shared" in params:
        check_shared(params["shared"], D, x.dtype)
    for key in params:
        if key == "shared" or key in state:      # checked above; router state may stay fp32
            continue
        if params[key].dtype != x.dtype:
            raise ValueError(f"moe: x dtype {x.dtype} differs from params[{key!r}] dtype "
                             f"{params[key].dtype}; cast one of them")
    return E, D, I


def _choose(impl: str, mesh, needs_grad: bool) -> str:
    """The registered name to run, read from what the registry declares (``ep.Declared``)."""
    if not isinstance(impl, str):
        raise TypeError(f"moe: impl must be a string, got {type(impl).__name__}")
    name = _ep.auto(mesh, needs_grad) if impl == "auto" else impl
    declared = _ep.declared(name)  # ValueError listing the registered names
    one_rank = mesh is None or mesh.ep == 1
    if declared.shared_batch and not one_rank and mesh.ep != mesh.tp:
        raise ValueError(f"moe: impl={name!r} requires ep == tp (the expert group must share "
                         f"one batch), got ep={mesh.ep}, tp={mesh.tp}; use impl='auto'")
    if declared.shared_batch and not one_rank and mesh.sp:
        raise ValueError(f"moe: impl={name!r} requires the expert group to share one batch, but with "
                         "sequence parallelism (mesh sp=True) each tp rank holds its own tokens; use impl='auto'")
    return declared.one_rank if one_rank and declared.one_rank is not None else name


def _local_experts(params: dict, E: int, mesh, act: Activation, matmul: str) -> LocalExperts:
    """This rank's block of experts."""
    ep = 1 if mesh is None else mesh.ep
    rng = range(0, E) if mesh is None else mesh.expert_range(E)
    weights = {}
    for key in _EXPERT_KEYS:
        if key not in params:
            continue
        w = unshard(params[key], keep=("ep",)) if isinstance(peel(params[key]), DTensor) else params[key]
        if ep > 1 and w.shape[0] == E:            # replicated / plain full experts: own block
            w = w[rng.start:rng.stop]
        if w.shape[0] != len(rng):
            hint = "; the experts are split over ep: pass mesh= (forward(..., mesh=mesh))" if ep == 1 else ""
            raise ValueError(f"moe: params[{key!r}] holds {w.shape[0]} experts on this rank, "
                             f"expected {len(rng)} (E={E} over ep={ep}){hint}")
        weights[key] = w
    return LocalExperts(weights, rng.start, E, act=act, matmul=matmul)


def _router_inputs(params: dict, router_inputs: Optional[Mapping[str, Any]], router: Router) -> dict:
    """Keyword inputs for the router: its state entries (detached) and ``router_inputs``."""
    if router_inputs is not None and not isinstance(router_inputs, Mapping):
        raise TypeError(f"moe: router_inputs must be a mapping of name -> value, got "
                        f"{type(router_inputs).__name__}")
    inputs = dict(router_inputs or {})
    bad = [k for k in inputs if not isinstance(k, str)]
    if bad:
        raise TypeError(f"moe: router_inputs keys must be strings, got {bad}")
    var_kw, names, _ = accepted(router)
    for key in state_keys(params):
        if key in inputs:
            raise ValueError(f"moe: {key} is given both in params and in router_inputs; keep one")
        if not var_kw and key not in names:
            raise ValueError(f"moe: params[{key!r}] is router state, but router "
                             f"{getattr(router, '__name__', router)!r} does not accept keyword input(s) [{key!r}] "
                             f"(it accepts {sorted(names)}); use a router that reads it, or drop the entry")
        inputs[key] = unshard(params[key], keep=()).detach()
    return inputs


def moe(
    params: dict,
    x: torch.Tensor,
    *,
    router: Router,
    mesh=None,
    impl: str = "auto",
    act: Activation = swiglu,
    matmul: str = "auto",
    router_inputs: Optional[Mapping[str, Any]] = None,
) -> tuple[torch.Tensor, dict]:
    """Mixture-of-experts layer over this rank's tokens.

    Args:
        params: ``router [E, D]``, ``w_gate_up [E, 2I, D]``, ``w_down [E, D, I]`` (+ optional
            ``router_bias``, ``b_gate_up``, ``b_down``); plain or placed by ``fmoe.shard``.
        x: ``[T, D]`` this rank's tokens (T may be 0); the same on every rank of a tp group,
            or with ``mesh.sp`` this rank's own piece of them.
        router: ``router(logits[T, E]) -> Routing`` (e.g. ``fmoe.routing.topk(2)``).
        mesh: ``fmoe.Mesh`` or None for a single process.
        impl: ``"auto"``, ``"all_to_all"``, ``"all_reduce"`` or a registered name.
        act: expert activation ``act(gate, up)`` (default SwiGLU).
        matmul: expert path (:mod:`fmoe.experts`): ``"grouped"`` (whole-tensor
            ``torch._grouped_mm``), ``"loop"`` (one expert at a time; on CPU the fused blocked
            path) or ``"auto"`` (CPU: blocked from ``fmoe.experts.BLOCKED_MIN_ROWS`` rows per
            local expert on, grouped below; CUDA: grouped where aligned). Same numbers on every path.
        router_inputs: extra keyword inputs for the router, e.g. ``{"token_ids": ids [T], "layer": 0}``
            (the :data:`fmoe.routing.OFFERED` names are passed only if the router declares them).
    Returns:
        ``(y [T, D], aux)``.

    Example:
        >>> import torch, fmoe
        >>> p = {"router": torch.randn(4, 8), "w_gate_up": torch.randn(4, 6, 8),
        ...      "w_down": torch.randn(4, 8, 3)}
        >>> y, aux = fmoe.moe(p, torch.randn(5, 8), router=fmoe.routing.topk(2))
        >>> y.shape, aux["tokens_per_expert"].sum().item()
        (torch.Size([5, 8]), 10)
    """
    E, D, I = _check_params(params, x)
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"moe: mesh must be an fmoe.Mesh or None, got {type(mesh).__name__}")
    refuse_compiled_transform(mesh)
    if not callable(router):
        raise TypeError(f"moe: router must be callable (e.g. fmoe.routing.topk(2)), got {router!r}")
    check_matmul("moe", "matmul", matmul)          # before any gather or dispatch
    inputs = _router_inputs(params, router_inputs, router)
    trained = [v for k, v in params.items() if k not in ("shared", *state_keys(params))]
    trained += list(params.get("shared", {}).values())
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(v.requires_grad for v in trained))
    sp = mesh is not None and mesh.sp
    placed = isinstance(peel(params["router"]), DTensor)
    if placed and sequence_parallel(params["router"]) != sp:
        raise ValueError(f"moe: mesh has sp={sp} but params were sharded on a mesh with sp={not sp}; "
                         "shard the params on the mesh you pass (fmoe.shard(params, plan, mesh))")
    name = _choose(impl, mesh, needs_grad)
    partial = ("tp",) if sp else ()             # sequence parallel: the router saw this rank's tokens only
    router_w = unshard(params["router"], keep=(), partial_grad=partial)
    logits = gemm(torch.matmul, x, router_w.t())                                # [T, E]
    if "router_bias" in params:
        logits = logits + unshard(params["router_bias"], keep=(), partial_grad=partial)
    routing = validate(call(router, logits, inputs), x.shape[0], E)
    experts = _local_experts(params, E, mesh, act, matmul)
    router_stats, router_keys = as_stats(routing.aux)     # losses unwrapped (fmoe.routing.core)
    stats = {**router_stats, **routed_load(routing.weights, routing.expert_ids, E),
             "computed_slots": GlobalStat({"slots": (routing.expert_ids >= 0).sum().float()}, lambda s: s["slots"])}
    chosen = _ep.get(name)
    packed = pack(stat_sums(stats)) if _ep.takes_stats(chosen, mesh) else None   # summed by the dispatch
    result = _ep.run(chosen, x, routing.weights, routing.expert_ids, experts, mesh, packed)
    out = result.y
    if "shared" in params:
        out = out + shared_expert(params["shared"], x, act=act).to(out.dtype)
    aux = finalize(stats, mesh, summed_over_fsdp=result.stats_sum)
    ids, on = active(routing.expert_ids.flatten())    # bincount without a data-dependent shape; inactive: 0
    aux["tokens_per_expert"] = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add(0, ids, on.long())
    aux["dispatch_rows"] = result.sent_rows
    aux.update(result.extra)
    aux["router_keys"] = {**router_keys, "computed_slots": "stat"}   # which entries train, which are logged
    return out.to(x.dtype), aux
