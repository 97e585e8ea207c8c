"""Router auxiliary losses over the GLOBAL batch: load balancing, sequence balance, z-loss.

Each loss is a :class:`fmoe.routing.global_stats.GlobalStat`: sums over this rank's tokens plus a
``finish``. ``fmoe.moe`` sums them over the distinct data-parallel batches and finishes them,
so the value on every rank equals the single-process value on the union of all batches. The
losses (``T`` tokens, ``E`` experts, ``K`` slots, ``p`` the router's probabilities)::

    load_balance  = E * sum_e f_e * P_e       f_e = count_e / (T*K)   P_e = sum_t p_te / T
    seq_balance   = mean over sequences s of  E * sum_e f_se * P_se   (same, within s)
    z_loss        = sum_t logsumexp(logits_t)^2 / T

``count_e`` counts the routed slots per expert (Switch/GShard normalisation: 1.0 when perfectly
balanced; Hugging Face's ``load_balancing_loss_func`` is ``K`` times this). ``seq_balance`` is
DeepSeek-V3's complementary sequence-wise loss; a sequence must lie inside one data-parallel
batch, which is how batches are cut.

**Gradient convention.** Each rank calls ``backward()`` on its own copy of the global loss. The
reduction's backward is the identity, so rank ``r`` gets ``dL/dsums * dsums_r/dθ``: its batch's
share. **Summed over the data-parallel batches** (one rank per batch; the ranks of a
tensor-parallel group hold identical copies) these router gradients equal the single-process
gradient of the union.

**Which entries are losses** is decided by type, not by name (:mod:`fmoe.routing.core`): an
entry wrapped in :class:`fmoe.routing.Loss` is a term of the training loss, already weighted by
its coefficient (so a hand-written router can add ``aux["my_penalty"] = Loss(...)`` and every
trainer picks it up); ``fmoe.moe`` lists them in ``aux["router_keys"]``. :func:`with_losses`
writes ``Loss`` entries ``load_balance_loss``, ``seq_balance_loss`` and ``z_loss``;
:func:`total` sums the loss entries of all layers.

**What the trainer does.** ``fmoe.training.grads.reduce_grads`` sums gradients over the batches
and divides by their number ``N = mesh.num_batches`` (the per-batch mean that makes the LM loss
— a mean over each rank's batch — match one process). That division would shrink the aux loss
gradient ``N`` times, so each rank backpropagates::

    loss = lm_loss + mesh.num_batches * fmoe.routing.aux_losses.total(aux_per_layer)

(a trainer that only sums gradients uses ``lm_loss / N + total``). In one process ``N = 1``.
The functions below return unweighted GlobalStats for use inside any router.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from ..precision import at_least_f32, upcast
from .global_stats import GlobalStat, weighted_sum
from .core import Loss, Router, Routing, active, validate
from .inputs import call
from .state import state_of

__all__ = ["load_balance_loss", "seq_balance_loss", "z_loss", "softmax_probs", "normalized_sigmoid",
           "with_losses", "total"]


def softmax_probs(logits: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)`` at least in fp32 over experts (Switch/GShard/Mixtral probabilities)."""
    return torch.softmax(upcast(logits), dim=-1)


def normalized_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """``s / sum_e s`` with ``s = sigmoid(logits)`` (DeepSeek-V3's ``s'`` in its balance loss).

    Example:
        >>> normalized_sigmoid(torch.zeros(1, 4)).tolist()
        [[0.25, 0.25, 0.25, 0.25]]
    """
    s = torch.sigmoid(upcast(logits))
    return s / s.sum(dim=-1, keepdim=True)


def _counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    ids, on = active(expert_ids)                                                # inactive slots count 0
    return torch.zeros(num_experts, device=expert_ids.device).index_add(0, ids.reshape(-1), on.reshape(-1).float())


def load_balance_loss(probs: torch.Tensor, expert_ids: torch.Tensor) -> GlobalStat:
    """Switch/GShard loss ``E * sum_e f_e * P_e`` over all batches.

    Args:
        probs: ``[T, E]`` router probabilities (differentiable).
        expert_ids: ``[T, K]`` chosen experts (all slots count).
    Returns:
        a GlobalStat (``.local()`` gives this batch's value).

    Example:
        >>> load_balance_loss(torch.full((2, 2), 0.5), torch.tensor([[0], [1]])).local()
        tensor(1.)
    """
    T, E = probs.shape
    K = expert_ids.shape[1]
    sums = {"count": _counts(expert_ids, E), "prob": upcast(probs).sum(0),
            "tokens": probs.new_tensor(float(T), dtype=at_least_f32(probs.dtype))}

    def finish(s: dict) -> torch.Tensor:
        t = s["tokens"].clamp(min=1)
        return E * (s["count"] / (t * K) * s["prob"] / t).sum()

    return GlobalStat(sums, finish)


def seq_balance_loss(probs: torch.Tensor, expert_ids: torch.Tensor, seq_ids: torch.Tensor) -> GlobalStat:
    """DeepSeek-V3 sequence-wise balance loss: the load-balance loss per sequence, averaged.

    Args:
        probs: ``[T, E]`` (DeepSeek-V3: :func:`normalized_sigmoid` scores).
        expert_ids: ``[T, K]``.
        seq_ids: ``[T]`` integer sequence id of each token (any values; equal = same sequence).
    Returns:
        a GlobalStat: sum of per-sequence losses / number of sequences, over all batches.

    Example:
        >>> probs = torch.tensor([[.9, .1], [.9, .1], [.5, .5], [.5, .5]])
        >>> seq_balance_loss(probs, torch.tensor([[0], [0], [0], [1]]), torch.tensor([0, 0, 1, 1])).local()
        tensor(1.4000)
    """
    T, E = probs.shape
    K = expert_ids.shape[1]
    if (not isinstance(seq_ids, torch.Tensor) or seq_ids.shape != (T,)
            or seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool):
        got = (f"{tuple(seq_ids.shape)} {seq_ids.dtype}" if isinstance(seq_ids, torch.Tensor)
               else type(seq_ids).__name__)
        raise ValueError(f"seq_balance_loss: seq_ids must be a [T={T}] integer tensor, got {got}")
    _, seq = torch.unique(seq_ids.to(probs.device), return_inverse=True)                          # [T] in [0, S)
    S = int(seq.max()) + 1 if T else 0
    count = torch.zeros(S, E, device=probs.device)                               # [S, E]
    ids, on = active(expert_ids)                                                 # inactive slots count 0
    count.index_put_((seq.unsqueeze(1).expand(T, K).reshape(-1), ids.reshape(-1)),
                     on.reshape(-1).to(count.dtype), accumulate=True)
    prob = torch.zeros(S, E, device=probs.device, dtype=at_least_f32(probs.dtype)).index_add(0, seq, upcast(probs))  # [S, E]
    length = torch.bincount(seq, minlength=S).float()                            # [S]
    per_seq = E / K * (count * prob).sum(-1) / length.square()                   # [S]
    sums = {"loss": per_seq.sum(), "seqs": probs.new_tensor(float(S), dtype=at_least_f32(probs.dtype))}
    return GlobalStat(sums, lambda s: s["loss"] / s["seqs"].clamp(min=1))


def z_loss(logits: torch.Tensor) -> GlobalStat:
    """Router z-loss (ST-MoE): mean over tokens of ``logsumexp(logits)^2``.

    Example:
        >>> round(z_loss(torch.zeros(3, 4)).local().item(), 4)      # log(4)^2
        1.9218
    """
    lse = torch.logsumexp(upcast(logits), dim=-1)                                 # [T]
    sums = {"sq": lse.square().sum(), "tokens": lse.new_tensor(float(lse.shape[0]))}
    return GlobalStat(sums, lambda s: s["sq"] / s["tokens"].clamp(min=1))


def with_losses(router: Router, *, load_balance: Optional[float] = None, seq_balance: Optional[float] = None,
                z: Optional[float] = None, seq_len: Optional[int] = None,
                probs: Callable[[torch.Tensor], torch.Tensor] = softmax_probs) -> Router:
    """Add weighted aux losses to any router (a coefficient of None skips that loss).

    Args:
        router: the router to wrap (it receives every input except ``seq_ids``).
        load_balance: coefficient of :func:`load_balance_loss` (e.g. 0.01).
        seq_balance: coefficient of :func:`seq_balance_loss` (e.g. 1e-4).
        z: coefficient of :func:`z_loss` (e.g. 1e-3).
        seq_len: sequences are consecutive runs of ``seq_len`` tokens (a flattened ``[B, S]``
            batch); otherwise the router needs ``router_inputs={"seq_ids": [T]}``.
        probs: ``probs(logits) -> [T, E]`` used by the balance losses (default softmax; use
            :func:`normalized_sigmoid` with ``fmoe.routing.sigmoid_topk``).
    Returns:
        ``router(logits, **inputs)`` adding ``Loss(coefficient * loss)`` as ``aux["<name>_loss"]``.

    Example:
        >>> import fmoe
        >>> r = with_losses(fmoe.routing.topk(1), load_balance=0.01, z=1e-3)(torch.zeros(2, 2))
        >>> sorted(r.aux)
        ['load_balance_loss', 'z_loss']
    """
    coefs = {"load_balance": load_balance, "seq_balance": seq_balance, "z": z}
    for name, c in coefs.items():
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))):
            raise TypeError(f"with_losses: {name} must be a number or None, got {c!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"with_losses: seq_len must be an int >= 1 or None, got {seq_len!r}")
    if not callable(router):
        raise TypeError(f"with_losses: router must be callable, got {router!r}")

    def wrapped(logits: torch.Tensor, **inputs) -> Routing:
        seq_ids = inputs.pop("seq_ids", None)
        # checked before the losses index by expert id (the layer's own check comes after the router)
        routing = validate(call(router, logits, inputs), logits.shape[0], logits.shape[-1])
        aux = dict(routing.aux)
        if load_balance is not None or seq_balance is not None:
            p = probs(logits)
        if load_balance is not None:
            aux["load_balance_loss"] = Loss(weighted_sum([(load_balance, load_balance_loss(p, routing.expert_ids))]))
        if seq_balance is not None:
            T = logits.shape[0]
            if seq_ids is None:
                if seq_len is None:
                    raise ValueError("with_losses: seq_balance needs seq_len=S or "
                                     "fmoe.moe(..., router_inputs={'seq_ids': [T] tensor})")
                if T % seq_len:
                    raise ValueError(f"with_losses: T={T} tokens is not a whole number of "
                                     f"sequences of seq_len={seq_len}")
                seq_ids = torch.arange(T, device=logits.device) // seq_len
            aux["seq_balance_loss"] = Loss(weighted_sum([(seq_balance, seq_balance_loss(p, routing.expert_ids, seq_ids))]))
        if z is not None:
            aux["z_loss"] = Loss(weighted_sum([(z, z_loss(logits))]))
        return Routing(routing.weights, routing.expert_ids, aux)

    wrapped.__name__ = f"with_losses({getattr(router, '__name__', 'router')})"
    wrapped.state = state_of(router)               # the wrapped router's state (fmoe.routing.state)
    return wrapped


def total(auxes: Sequence[Mapping[str, object]]) -> torch.Tensor:
    """Sum of every loss entry of every layer's aux (``aux["router_keys"][key] == "loss"``, as
    ``fmoe.moe`` records them): the aux training loss.

    Args:
        auxes: one finalized aux dict per MoE layer (as returned by ``fmoe.moe``).
    Returns:
        a scalar tensor (0.0 when there is none).

    Example:
        >>> total([{"z_loss": torch.tensor(0.5), "load": torch.ones(4), "router_keys": {"z_loss": "loss"}},
        ...        {"z_loss": torch.tensor(0.25), "router_keys": {"z_loss": "loss"}}])
        tensor(0.7500)
    """
    out = torch.zeros(())
    for aux in auxes:
        for key, kind in aux.get("router_keys", {}).items():
            v = aux[key]
            if kind == "loss":
                if not isinstance(v, torch.Tensor) or v.ndim != 0:
                    raise ValueError(f"aux_losses.total: aux[{key!r}] must be a scalar tensor "
                                     f"(finalized by fmoe.moe), got {type(v).__name__}")
                out = out.to(v.device) + v
    return out
