"""The dense SwiGLU feed-forward block ``down(act(gate(x), up(x)))``, for dense layers and shared
experts (:mod:`fmoe.nn.shared_experts`) alike.

Gate and up are one fused weight ``w_gate_up [2I, D]`` (gate rows first), as in the experts.
Under tensor parallelism it is sharded ``packed_colwise`` (each half split separately), so the
local output is ``[gate_r | up_r]`` and ``chunk(2, -1)`` still pairs each gate with its up; the
down projection ``w_down [D, I]`` is ``rowwise`` and sums the partial products. A plain
``colwise`` (unpacked) split of ``w_gate_up`` would pair gates with gates; it is rejected
(:func:`fmoe.sharding.check_fused_gate_up`). The activation is :func:`swiglu`
(:mod:`fmoe.experts.activations`, the same object the experts use) unless another is given.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from ..experts.activations import Activation, swiglu
from ..sharding import check_fused_gate_up, placement_of
from ._tp import tp_size_rank
from .linear import linear

__all__ = ["swiglu", "swiglu_mlp"]


def swiglu_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
               b_gate_up: Optional[torch.Tensor] = None, b_down: Optional[torch.Tensor] = None, *,
               act: Union[Activation, Callable] = swiglu) -> torch.Tensor:
    """Dense SwiGLU MLP with a fused gate/up weight.

    Args:
        x: ``[..., D]``.
        w_gate_up: ``[2I, D]``, gate rows first (replicated, ``packed_colwise``, or packed and
            gathered ``P("tp", None, packed=2, gather=True)``).
        w_down: ``[D, I]`` (replicated or ``rowwise``).
        b_gate_up: optional ``[2I]``; b_down: optional ``[D]``.
        act: ``act(gate, up)`` (:mod:`fmoe.experts.activations`; default SwiGLU).
    Returns:
        ``[..., D]``.

    Example:
        >>> swiglu_mlp(torch.ones(3, 4), torch.ones(6, 4), torch.ones(4, 3)).shape
        torch.Size([3, 4])
    """
    if tp_size_rank(w_gate_up)[1] > 1:
        check_fused_gate_up(placement_of(w_gate_up), "swiglu_mlp: w_gate_up")
    gate, up = linear(x, w_gate_up, b_gate_up).chunk(2, dim=-1)
    return linear(act(gate, up), w_down, b_down)
