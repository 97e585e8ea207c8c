"""Expert MLPs on rows already grouped by expert: the grouped and loop matmul paths.

Weights are fused per expert: ``w_gate_up [E, 2I, D]`` (gate rows first, then up rows) and
``w_down [E, D, I]``, optionally with biases ``b_gate_up [E, 2I]`` and ``b_down [E, D]``
(gpt-oss). Rows arrive sorted by expert with ``counts[e]`` rows for expert ``e``; the caller
sorts once per layer.

Two matmul paths give the same numbers (the tests check it):

- ``grouped``: one ``torch._grouped_mm`` per projection over all experts (CPU and CUDA in
  torch >= 2.8). It needs 16-byte aligned strides (``D`` and ``I`` multiples of 4 in fp32,
  of 8 in bf16), rows, and bf16 on CUDA; ``"grouped"`` and ``"auto"`` fall back to the loop
  otherwise (float64, an expert block with no rows).
- ``loop``: one matmul per expert; an idle expert still gets a zero gradient, never ``None``.

Each row may carry a mixing weight ``scale[n]`` (the routing weight): the output is
``scale[n] * expert(x[n])``. For the common SwiGLU expert without biases the whole MLP is one
autograd Function (:class:`_SwiGLUExperts`) that applies ``scale`` to the ``[N, I]`` hidden
activation (``(s * h) W_down^T == s * (h W_down^T)``, fewer elements than the ``[N, D]`` output
when ``I < D``), keeps only ``x`` and the ``[N, 2I]`` projection for backward, recomputes the
cheap activation there and writes the gate and up gradients straight into one buffer (no
concatenation). Other activations and biased experts use plain autograd over the same GEMMs.

Activations are :mod:`fmoe.experts.activations` (``act(gate, up) -> h``); the fused Function runs when
the activation's name is ``"swiglu"`` (explicit data, so ``fmoe.nn.swiglu``, the same object, and
any ``Activation("swiglu", ...)`` take it), any other callable the general path.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .activations import Activation, activation_name, swiglu
from ..transforms import vmap_by_loop
from .fake_splits import is_fake
from .ops import check_matmul, grouped_mm

__all__ = ["expert_mlp", "grouped_mm_available", "use_grouped", "check_matmul", "check_groups"]


def grouped_mm_available() -> bool:
    """Whether this torch build has ``torch._grouped_mm``."""
    return hasattr(torch, "_grouped_mm")


@torch.compiler.disable
def _gmm(a: torch.Tensor, w: torch.Tensor, offs, counts: Sequence[int], grouped: bool, trans: bool) -> torch.Tensor:
    """Rows of group ``e``: ``a_e @ w[e].T`` (``trans``) or ``a_e @ w[e]``; plain tensors, no autograd.
    A kernel on host counts: Dynamo never traces it (nor :func:`_gmm_wgrad`), even in a frame of
    an eager fallback, where it would reach ``torch._grouped_mm``'s bf16-only meta rule."""
    if grouped:
        return torch._grouped_mm(a, w.transpose(1, 2) if trans else w, offs=offs)
    if torch.is_grad_enabled():   # double backward: differentiable ops, no out=
        return torch.cat([p @ (w[e].t() if trans else w[e]) for e, p in enumerate(a.split(counts))])
    out = a.new_empty((a.shape[0], w.shape[1] if trans else w.shape[2]))
    for e, (p, o) in enumerate(zip(a.split(counts), out.split(counts))):
        if p.shape[0]:
            torch.mm(p, w[e].t() if trans else w[e], out=o)
    return out


@torch.compiler.disable
def _gmm_wgrad(g: torch.Tensor, a: torch.Tensor, offs, counts: Sequence[int], grouped: bool) -> torch.Tensor:
    """Weight gradient ``[E, n_g, n_a]``: ``g_e^T @ a_e`` per group (zeros for an empty group)."""
    if grouped:
        return torch._grouped_mm(g.t(), a, offs=offs)
    return torch.stack([p.t() @ q for p, q in zip(g.split(counts), a.split(counts))])


class _SwiGLUExperts(torch.autograd.Function):
    """``y = (scale * silu(x Wg^T) * (x Wu^T)) Wd^T`` per expert group, fwd + bwd by hand.

    Returns ``(y [N, D], h [N, 2I])``; ``h`` (the gate/up projection) is a non-differentiable
    output only so that it can be saved for backward (new-style Function, ``torch.func`` works).
    Forward mode: :func:`swiglu_jvp`; vmap: one call per batch element (``fmoe.moe`` takes the
    grouped-op path under transforms, see :mod:`fmoe.transforms`).
    """

    @staticmethod
    def forward(x, scale, w_gate_up, w_down, offs, counts, grouped):
        h = _gmm(x, w_gate_up, offs, counts, grouped, trans=True)                # [N, 2I]
        n_i = h.shape[1] // 2
        a = F.silu(h[:, :n_i])
        a.mul_(h[:, n_i:])                                                         # [N, I]
        if scale is not None:
            a.mul_(scale.unsqueeze(-1))
        return _gmm(a, w_down, offs, counts, grouped, trans=True), h             # [N, D]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale, w_gate_up, w_down, offs, ctx.counts, ctx.grouped = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)            # no zero-filled gradient for h
        ctx.save_for_backward(x, scale, w_gate_up, w_down, offs, output[1])
        ctx.save_for_forward(x, scale, w_gate_up, w_down, offs)

    @staticmethod
    def jvp(ctx, dx, dscale, dw_gate_up, dw_down, *_):
        x, scale, w_gate_up, w_down, offs = ctx.saved_tensors
        mm = lambda a, w: _gmm(a, w, offs, ctx.counts, ctx.grouped, trans=True)  # noqa: E731
        return swiglu_jvp(mm, x, scale, w_gate_up, w_down, dx, dscale, dw_gate_up, dw_down), None

    @staticmethod
    def backward(ctx, dy, _dh):
        x, scale, w_gate_up, w_down, offs, h = ctx.saved_tensors
        if dy is None:
            return None, None, None, None, None, None, None
        need = ctx.needs_input_grad
        dx, dscale, dw_gate_up, dw_down = swiglu_backward(
            x, dy, scale, w_gate_up, w_down, h, ctx.counts, (need[0], need[1], need[2], need[3]),
            offs=offs, grouped=ctx.grouped)
        return dx, dscale, dw_gate_up, dw_down, None, None, None


_SwiGLUExperts.vmap = staticmethod(vmap_by_loop(_SwiGLUExperts.apply))


def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return b if a is None else a if b is None else a + b


def swiglu_jvp(mm: Callable, x, scale, w_gate_up, w_down, dx, dscale, dw_gate_up, dw_down) -> torch.Tensor:
    """Tangent of ``y = (scale * silu(g) * u) W_down^T``, ``[g | u] = x W_gate_up^T`` (per expert
    group: ``mm(a, w)`` is the grouped ``a @ w[e]^T``) for the input tangents ``d*`` (None: zero).
    Product rule: ``dy = da W_down^T + a dW_down^T`` with ``da`` from ``dh = dx W^T + x dW^T``."""
    h = mm(x, w_gate_up)                                                       # [N, 2I]
    n_i = h.shape[1] // 2
    gate, up = h[:, :n_i], h[:, n_i:]
    s = F.silu(gate)
    a = s * up                                                                 # [N, I]
    dh = _add(mm(dx, w_gate_up) if dx is not None else None, mm(x, dw_gate_up) if dw_gate_up is not None else None)
    da = None
    if dh is not None:
        sig = torch.sigmoid(gate)
        da = dh[:, :n_i] * up * sig * (1 + gate * (1 - sig)) + s * dh[:, n_i:]
    if scale is not None:
        da = _add(da * scale.unsqueeze(-1) if da is not None else None,
                  a * dscale.unsqueeze(-1) if dscale is not None else None)
        a = a * scale.unsqueeze(-1)
    dy = _add(mm(da, w_down) if da is not None else None, mm(a, dw_down) if dw_down is not None else None)
    return dy if dy is not None else x.new_zeros(x.shape[0], w_down.shape[1])


def swiglu_backward(x, dy, scale, w_gate_up, w_down, h, counts: Sequence[int], need: Sequence[bool],
                    offs=None, grouped: bool = False):
    """Gradients ``(dx, dscale, dw_gate_up, dw_down)`` of ``y = (scale * silu(g) * u) W_down^T``
    with ``[g | u] = h = x W_gate_up^T`` per expert group (rows sorted by expert, ``counts``
    each); ``need`` says which of the four to compute (the others are None). Under grad mode
    (double backward, ``torch.func``) only out-of-place differentiable ops are used.
    """
    dy = dy.contiguous()
    if torch.is_grad_enabled():   # the saved h is a constant: recompute it so that it carries x and w
        h = _gmm(x, w_gate_up, offs, counts, grouped, trans=True)
    n_i = h.shape[1] // 2
    gate, up = h[:, :n_i], h[:, n_i:]
    s = F.silu(gate)
    a = s * up                                                                 # unscaled activation
    da = _gmm(dy, w_down, offs, counts, grouped, trans=False)                 # [N, I]
    dscale = None
    if scale is not None:
        if need[1]:
            dscale = torch.einsum("ni,ni->n", da, a)
        a, da = a * scale.unsqueeze(-1), da * scale.unsqueeze(-1)
    dw_down = _gmm_wgrad(dy, a, offs, counts, grouped) if need[3] else None    # [E, D, I]
    if torch.is_grad_enabled():   # double backward / torch.func: no out= or in-place ops
        sig = torch.sigmoid(gate)                  # silu'(g) = sig * (1 + g * (1 - sig)), twice differentiable
        dh = torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * s], dim=1)
    else:                         # d gate | d up written straight into one buffer
        dh = torch.empty_like(h)                                               # [N, 2I]
        torch.mul(da, s, out=dh[:, n_i:])
        torch.ops.aten.silu_backward.grad_input(da.mul_(up), gate, grad_input=dh[:, :n_i])
    dx = _gmm(dh, w_gate_up, offs, counts, grouped, trans=False) if need[0] else None
    dw_gate_up = _gmm_wgrad(dh, x, offs, counts, grouped) if need[2] else None  # [E, 2I, D]
    return dx, dscale, dw_gate_up, dw_down


def _loop_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    pieces = x.split(list(counts))
    return torch.cat([p @ w[e].t() for e, p in enumerate(pieces)])


def _grouped_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """grouped_mm needs 16-byte aligned strides (both devices), rows (an empty operand's strides
    are 0, which it refuses), one of fp32 / bf16 / fp16, and bf16 on CUDA (and on fake tensors:
    its meta kernel takes bf16 only)."""
    if not grouped_mm_available() or x.dtype != w.dtype or x.shape[0] == 0:
        return False
    if (x.is_cuda or is_fake(x)) and x.dtype != torch.bfloat16:
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w.shape[1] % align == 0 and w.shape[2] % align == 0


def use_grouped(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, matmul: str = "auto") -> bool:
    """Whether ``expert_mlp(..., matmul=matmul)`` runs ``torch._grouped_mm`` for these tensors:
    ``"grouped"`` and ``"auto"`` where it applies (:func:`_grouped_ok`), the loop otherwise (every
    dtype the experts accept, float64 included, whatever ``matmul`` asks), as the grouped
    operators' kernels decide (:mod:`fmoe.experts.ops`)."""
    return matmul != "loop" and _grouped_ok(x, w_gate_up) and _grouped_ok(x, w_down)


def _project(x, w, counts, offs, grouped: bool) -> torch.Tensor:
    if grouped:
        return grouped_mm(x.contiguous(), w, offs, matmul="grouped")
    return _loop_mm(x, w, counts)


def expert_mlp(
    x: torch.Tensor,
    counts: Sequence[int],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: Optional[torch.Tensor] = None,
    b_down: Optional[torch.Tensor] = None,
    act: Activation = swiglu,
    matmul: str = "auto",
    scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Run each expert's MLP on its rows, optionally weighting each row's output.

    Args:
        x: ``[N, D]`` rows sorted by expert.
        counts: rows per local expert, ``len(counts) == E_local``, ``sum(counts) == N``.
        w_gate_up: ``[E_local, 2I, D]``; w_down: ``[E_local, D, I]``.
        b_gate_up: optional ``[E_local, 2I]``; b_down: optional ``[E_local, D]``.
        act: ``act(gate, up) -> h``.
        matmul: ``"grouped"``, ``"loop"`` or ``"auto"`` (grouped where available and aligned).
        scale: optional ``[N]`` per-row weights (differentiable), same dtype as ``x``.
    Returns:
        ``[N, D]`` expert outputs (times ``scale``), in the same row order.

    Example:
        >>> w1, w2 = torch.randn(2, 6, 4), torch.randn(2, 4, 3)
        >>> expert_mlp(torch.randn(5, 4), [2, 3], w1, w2).shape
        torch.Size([5, 4])
    """
    check_matmul("expert_mlp", "matmul", matmul)
    counts = check_groups("expert_mlp", counts, w_gate_up.shape[0], x.shape[0], "rows", scale)
    offs = torch.tensor(counts, dtype=torch.int64, device=x.device).cumsum(0).to(torch.int32)
    grouped = use_grouped(x, w_gate_up, w_down, matmul)
    if activation_name(act) == "swiglu" and b_gate_up is None and b_down is None:
        return _SwiGLUExperts.apply(x.contiguous(), scale, w_gate_up, w_down, offs, counts, grouped)[0]
    h = _project(x, w_gate_up, counts, offs, grouped)                           # [N, 2I]
    if b_gate_up is not None:
        h = h + _per_row(b_gate_up, counts)
    gate, up = h.chunk(2, dim=-1)                                               # [N, I] each
    out = _project(act(gate, up), w_down, counts, offs, grouped)                # [N, D]
    if b_down is not None:
        out = out + _per_row(b_down, counts)
    return out if scale is None else out * scale.unsqueeze(-1)


def check_groups(fn: str, counts: Sequence[int], num_experts: int, n: int, what: str,
                 scale: Optional[torch.Tensor]) -> list[int]:
    """``counts`` as ints after checking that they split ``n`` rows (or assignments) over
    ``num_experts`` experts and that ``scale`` is ``[n]``; ValueError naming ``fn`` otherwise."""
    counts = [int(c) for c in counts]
    if len(counts) != num_experts or sum(counts) != n:
        raise ValueError(f"{fn}: counts {counts} do not fit {num_experts} experts and {n} {what}")
    if scale is not None and tuple(scale.shape) != (n,):
        raise ValueError(f"{fn}: scale must have shape ({n},), got {tuple(scale.shape)}")
    return counts


def _per_row(b: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Expand per-expert biases ``[E, n]`` to per-row ``[N, n]`` (differentiable)."""
    idx = torch.repeat_interleave(torch.arange(len(counts), device=b.device),
                                  torch.tensor(counts, device=b.device))
    return b.index_select(0, idx)
