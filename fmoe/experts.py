"""Expert compute: SwiGLU MLPs on rows already grouped by expert.

Weights are fused per expert: ``w_gate_up [E, 2I, D]`` (gate rows first, then up rows) and
``w_down [E, D, I]``, optionally with biases ``b_gate_up [E, 2I]`` and ``b_down [E, D]``
(gpt-oss). Rows arrive sorted by expert with ``counts[e]`` rows for expert ``e``; the caller
sorts once per layer.

Two paths give the same numbers (the tests check it):

- ``grouped``: one ``torch._grouped_mm`` per projection over all experts (CPU and CUDA in
  torch >= 2.8). It needs 16-byte aligned strides (``D`` and ``I`` multiples of 4 in fp32,
  of 8 in bf16) and bf16 on CUDA; ``"auto"`` falls back to the loop otherwise. Its backward needs contiguous gradients, so it is wrapped in a small autograd
  Function that makes them so.
- ``loop``: one matmul per expert; every expert is visited even with zero rows, so its weights
  stay in the autograd graph and an idle expert gets a zero gradient, never ``None``.

Activations are functions ``act(gate, up) -> h``: :func:`swiglu` (``silu(gate) * up``) or
:func:`clamped_swiglu` (gpt-oss: clamped, ``(up + 1) * gate * sigmoid(alpha * gate)``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["swiglu", "clamped_swiglu", "expert_mlp", "grouped_mm_available"]

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Qwen3-MoE, Mixtral, Llama)."""
    return F.silu(gate) * up


def clamped_swiglu(alpha: float = 1.702, limit: float = 7.0) -> Activation:
    """gpt-oss activation: gate clamped above at ``limit``, up clamped to ``[-limit, limit]``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``.

    Example:
        >>> act = clamped_swiglu()
        >>> act(torch.tensor([10.0]), torch.tensor([0.0])).item() == 7.0 * torch.sigmoid(torch.tensor(1.702 * 7.0)).item()
        True
    """

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    act.__name__ = f"clamped_swiglu(alpha={alpha}, limit={limit})"
    return act


def grouped_mm_available() -> bool:
    """Whether this torch build has ``torch._grouped_mm``."""
    return hasattr(torch, "_grouped_mm")


class _GroupedMM(torch.autograd.Function):
    """``out[rows of e] = x[rows of e] @ w[e].T`` for all experts at once."""

    @staticmethod
    def forward(x, w, offs):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, offs = inputs
        ctx.save_for_backward(x, w, offs)

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        g = g.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = torch._grouped_mm(g, w, offs=offs)                              # [N, D]
        if ctx.needs_input_grad[1]:
            gw = torch._grouped_mm(g.t(), x, offs=offs)                          # [E, out, in]
        return gx, gw, None


def _loop_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    pieces = x.split(list(counts))
    return torch.cat([p @ w[e].t() for e, p in enumerate(pieces)])


def _grouped_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """grouped_mm needs 16-byte aligned strides (both devices) and bf16 on CUDA."""
    if not grouped_mm_available() or x.dtype != w.dtype:
        return False
    if x.is_cuda and x.dtype != torch.bfloat16:
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w.shape[1] % align == 0 and w.shape[2] % align == 0


def _project(x, w, counts, offs, impl: str) -> torch.Tensor:
    if impl == "grouped" or (impl == "auto" and _grouped_ok(x, w)):
        return _GroupedMM.apply(x.contiguous(), w, offs)
    return _loop_mm(x, w, counts)


def expert_mlp(
    x: torch.Tensor,
    counts: Sequence[int],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: Optional[torch.Tensor] = None,
    b_down: Optional[torch.Tensor] = None,
    act: Activation = swiglu,
    impl: str = "auto",
) -> torch.Tensor:
    """Run each expert's MLP on its rows.

    Args:
        x: ``[N, D]`` rows sorted by expert.
        counts: rows per local expert, ``len(counts) == E_local``, ``sum(counts) == N``.
        w_gate_up: ``[E_local, 2I, D]``; w_down: ``[E_local, D, I]``.
        b_gate_up: optional ``[E_local, 2I]``; b_down: optional ``[E_local, D]``.
        act: ``act(gate, up) -> h``.
        impl: ``"grouped"``, ``"loop"`` or ``"auto"`` (grouped where available and aligned).
    Returns:
        ``[N, D]`` unweighted expert outputs, in the same row order.

    Example:
        >>> w1, w2 = torch.randn(2, 6, 4), torch.randn(2, 4, 3)
        >>> expert_mlp(torch.randn(5, 4), [2, 3], w1, w2).shape
        torch.Size([5, 4])
    """
    if impl not in ("auto", "grouped", "loop"):
        raise ValueError(f"expert_mlp: impl must be 'auto', 'grouped' or 'loop', got {impl!r}")
    counts = [int(c) for c in counts]
    if len(counts) != w_gate_up.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"expert_mlp: counts {counts} do not fit {w_gate_up.shape[0]} experts "
                         f"and {x.shape[0]} rows")
    offs = torch.tensor(counts, dtype=torch.int64, device=x.device).cumsum(0).to(torch.int32)
    h = _project(x, w_gate_up, counts, offs, impl)                              # [N, 2I]
    if b_gate_up is not None:
        h = h + _per_row(b_gate_up, counts)
    gate, up = h.chunk(2, dim=-1)                                               # [N, I] each
    out = _project(act(gate, up), w_down, counts, offs, impl)                   # [N, D]
    if b_down is not None:
        out = out + _per_row(b_down, counts)
    return out


def _per_row(b: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Expand per-expert biases ``[E, n]`` to per-row ``[N, n]`` (differentiable)."""
    idx = torch.repeat_interleave(torch.arange(len(counts), device=b.device),
                                  torch.tensor(counts, device=b.device))
    return b.index_select(0, idx)
