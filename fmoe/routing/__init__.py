"""Routers: pure functions from router logits to a routing decision.

A router is any callable ``router(logits[T, E]) -> Routing(weights[T, K], expert_ids[T, K],
aux)``. It sees only this rank's tokens and never communicates, so a scheme written in a few
lines runs distributed unchanged: ``fmoe.moe`` dispatches the tokens and reduces the global
statistics a router reports (:class:`fmoe.routing.global_stats.GlobalStat`). Extra per-batch inputs
(token ids, the layer index, the router's state) arrive as keyword arguments (see :mod:`fmoe.routing.inputs`).

A new scheme, e.g. top-1 on noisy logits::

    def noisy_top1(logits):
        probs = torch.softmax(logits.float() + torch.randn_like(logits), -1)
        w, ids = probs.max(-1, keepdim=True)
        return Routing(w, ids, {"penalty": Loss(1e-3 * probs.max(-1).values.mean()),   # trained
                                "top_prob": w.mean().detach()})                        # logged

Every ``aux`` entry is a loss (:class:`Loss`: trained and logged) or a statistic (a tensor or a
``GlobalStat``: logged); anything else is an error naming the key (:mod:`fmoe.routing.core`).

The built-in schemes:

==========================  ===========================================================
``topk(k, normalize)``      softmax -> top-k (-> renormalise): Qwen3-MoE, Mixtral
``topk_softmax(k)``         top-k logits -> softmax over them: gpt-oss
``group_topk(k, G, g)``     best ``g`` of ``G`` expert groups, then top-k: DeepSeek-V2
``sigmoid_topk(k, ...)``    sigmoid scores, selection biased by ``expert_bias``: DeepSeek-V3
                            (aux-loss-free balancing; :func:`update_bias` after each step)
``switch(cf, k)``           top-k with expert capacity, overflow dropped (weight 0)
``expert_choice(cf, k)``    each expert picks its top-C tokens
``hash_router(k)``          fixed experts per token id (``token_ids``: offered by every model)
``balanced(k)``             round-robin by position (benchmarks)
``random_topk(k, seed)``    random distinct experts (benchmarks)
``replay(DIR)``             the ids a ``--record-routing DIR`` run chose, weights recomputed
``remoe(k)``                ReLU gates, an L1 penalty whose coefficient is router state moved
                            toward ``k`` active experts per token (ReMoE)
==========================  ===========================================================

Router state (the expert bias, ReMoE's L1 coefficient): tensors in the parameter tree, read as
keyword inputs and moved by a pure update after each step (:mod:`fmoe.routing.state`).

A router named by text (``--router``, ``meta.json``): :func:`from_spec` (``"switch:capacity_factor=1.25"``,
``"my.module:factory:k=v"``; :mod:`fmoe.routing.spec`).

Aux losses (load balancing, sequence balance, z-loss) wrap any router:
:func:`with_losses` (from :mod:`fmoe.routing.aux_losses`). Shared experts are params, not a router
(:mod:`fmoe.nn.shared_experts`).

Example:
    >>> import torch
    >>> r = topk(2)(torch.tensor([[0.0, 1.0, 2.0, 3.0]]))
    >>> r.expert_ids.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
    ([[3, 2]], [0.7311, 0.2689])
"""

from . import aux_losses, balance  # noqa: F401  (submodules: fmoe.routing.aux_losses, .balance)
from .aux_losses import with_losses
from .bias import sigmoid_topk, update_bias
from .capacity import capacity, expert_choice, switch
from .core import Loss, Router, Routing, validate
from .inputs import OFFERED, call
from .fixed import balanced, hash_router, random_topk, token_hash
from .record import replay
from .relu import remoe
from .state import RouterState, state_of, with_state
from .spec import ROUTERS, from_spec, parse_spec
from .topk import group_mask, group_topk, topk, topk_softmax

__all__ = ["Routing", "Router", "Loss", "OFFERED", "validate", "call", "topk", "topk_softmax", "group_topk", "group_mask",
           "sigmoid_topk", "update_bias", "switch", "expert_choice", "capacity", "hash_router",
           "token_hash", "balanced", "random_topk", "replay", "remoe", "RouterState", "state_of", "with_state",
           "with_losses", "ROUTERS", "from_spec", "parse_spec"]
