"""Global-batch load balance (Qiu et al. 2025): the Switch loss with expert frequencies over the
whole step, i.e. summed over the data-parallel batches *and* the gradient-accumulation
micro-batches, exact against one process on the union of them.

The loss of a step with ``N`` micro-batches (``F`` slots per expert and ``T`` tokens over the
step, ``S^(i)`` the summed probabilities of micro-batch ``i``, all over the data-parallel
batches)::

    L = E * sum_e (F_e / sum F) * (sum_i S^(i)_e) / T   =   sum_i  E * sum_e f_e S^(i)_e / T

``f`` is a constant (counts), so ``L`` is a sum of per-micro-batch shares, and so is its
gradient: micro-batch ``i`` backpropagates its share. ``F`` must be known before the first
share, so :func:`step_counts` runs the step's micro-batches forward once first (routing only,
no backward; about a third more compute per step), with the same implementation and
recomputation settings as the step itself. The router must report the sums
(:func:`fmoe.routing.balance.with_balance_sums`); ``fmoe.moe`` sums them over the batches.
With ``grad_accum == 1`` the result equals the ``aux`` method (the frequencies of one batch
are already global over the data-parallel batches).

Example:
    >>> import fmoe
    >>> from fmoe.routing import balance, topk
    >>> g = torch.Generator().manual_seed(0)
    >>> params = {"router": torch.randn(4, 8, generator=g), "w_gate_up": torch.randn(4, 8, 8, generator=g),
    ...           "w_down": torch.randn(4, 8, 4, generator=g)}                    # E=4, D=8, I=4
    >>> router = balance.with_balance_sums(topk(2))
    >>> forward = lambda x: (None, {"moe": [fmoe.moe(params, x, router=router)[1]]})
    >>> micro_batches = torch.randn(2, 6, 8, generator=g).unbind(0)              # 2 x [T=6, D]
    >>> counts, tokens = step_counts(forward, micro_batches)
    >>> [int(c.sum()) for c in counts], [int(t) for t in tokens]                 # 12 tokens x top-2
    ([24], [12])
    >>> share_of(forward(micro_batches[0])[1], counts, tokens, weight=0.01).ndim  # added to its loss
    0
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..routing.balance import BALANCE_SUMS, global_balance_loss

__all__ = ["step_counts", "share_of"]


def _sums(aux: dict, where: str) -> list[dict]:
    layers = aux.get("moe", [])
    missing = [n for n in BALANCE_SUMS if layers and n not in layers[0]]
    if not layers or missing:
        raise ValueError(f"{where}: StepConfig.global_balance needs a router that reports {list(BALANCE_SUMS)} "
                         "(wrap it with fmoe.routing.balance.with_balance_sums); "
                         f"the layers' aux lack {missing or list(BALANCE_SUMS)}")
    return layers


def step_counts(forward: Any, micro_batches: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Slots per expert and tokens per MoE layer, summed over the step's micro-batches.

    Args:
        forward: ``forward(tokens) -> (logits, aux)`` as the step calls the model.
        micro_batches: the step's micro-batch token tensors (this rank's).
    Returns:
        ``(counts [E] per layer, tokens per layer)``, over all data-parallel batches too.
    """
    counts: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    for mt in micro_batches:          # with autograd on, as in the step: the same dispatch path
        _, aux = forward(mt)          # (fmoe.moe's impl="auto" picks by whether grads are needed)
        layers = _sums(aux, "global balance")
        c = [layer["balance_count"].detach().double() for layer in layers]
        t = [layer["balance_tokens"].detach().double() for layer in layers]
        counts = c if not counts else [a + b for a, b in zip(counts, c)]
        tokens = t if not tokens else [a + b for a, b in zip(tokens, t)]
        del aux
    return counts, tokens


def share_of(aux: dict, counts: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor], weight: float) -> torch.Tensor:
    """This micro-batch's weighted share of the global-batch loss, summed over MoE layers.

    Args:
        aux: the micro-batch's model aux (``{"moe": [per-layer dicts]}``).
        counts, tokens: from :func:`step_counts`.
        weight: the loss coefficient.
    Returns:
        a differentiable scalar (the same value on every rank).
    """
    layers = _sums(aux, "global balance")
    total = torch.zeros((), dtype=torch.float32)
    for layer, c, t in zip(layers, counts, tokens):
        p = layer["balance_prob"]
        total = total.to(p.device) + global_balance_loss(c.to(p.device), t.to(p.device), p)
    return weight * total
