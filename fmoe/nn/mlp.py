"""The dense SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``.

Gate and up are one fused weight ``w_gate_up [2I, D]`` (gate rows first), as in the experts.
Under tensor parallelism it is sharded ``packed_colwise`` (each half split separately), so the
local output is ``[gate_r | up_r]`` and ``chunk(2, -1)`` still pairs each gate with its up; the
down projection ``w_down [D, I]`` is ``rowwise`` and sums the partial products. A plain
``colwise`` (unpacked) split of ``w_gate_up`` would pair gates with gates; it is rejected.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..sharding import placement_of
from ._tp import tp_size_rank
from .linear import linear

__all__ = ["swiglu", "swiglu_mlp"]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``.

    Example:
        >>> swiglu(torch.zeros(2), torch.ones(2))
        tensor([0., 0.])
    """
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    return F.silu(gate) * up


def swiglu_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
               b_gate_up: Optional[torch.Tensor] = None, b_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense SwiGLU MLP with a fused gate/up weight.

    Args:
        x: ``[..., D]``.
        w_gate_up: ``[2I, D]``, gate rows first (replicated, ``packed_colwise``, or packed and
            gathered ``P("tp", None, packed=2, gather=True)``).
        w_down: ``[D, I]`` (replicated or ``rowwise``).
        b_gate_up: optional ``[2I]``; b_down: optional ``[D]``.
    Returns:
        ``[..., D]``.

    Example:
        >>> swiglu_mlp(torch.ones(3, 4), torch.ones(6, 4), torch.ones(4, 3)).shape
        torch.Size([3, 4])
    """
    p = placement_of(w_gate_up)
    if p.dim_of("tp") == 0 and p.packed != 2 and tp_size_rank(w_gate_up)[1] > 1:
        raise ValueError(f"swiglu_mlp: w_gate_up is split over tp as {p!r}; a fused [gate | up] weight "
                         "must be split per half: use style 'packed_colwise' (P('tp', None, packed=2))")
    gate, up = linear(x, w_gate_up, b_gate_up).chunk(2, dim=-1)
    return linear(swiglu(gate, up), w_down, b_down)
