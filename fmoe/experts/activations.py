"""Expert and MLP activations ``act(gate, up) -> h``, each with a name the expert code reads.

An :class:`Activation` is a callable carrying its ``name``; the expert code picks its fused
SwiGLU kernels when ``act.name == "swiglu"`` (explicit data, not object identity), so
``fmoe.nn.swiglu`` and ``fmoe.experts.swiglu`` (the same object) and any
``Activation("swiglu", ...)`` take the fast path, and any other function the general one.

Example:
    >>> swiglu(torch.zeros(2), torch.ones(2))
    tensor([0., 0.])
    >>> swiglu.name, clamped_swiglu().name
    ('swiglu', 'clamped_swiglu(alpha=1.702, limit=7.0)')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.nn.functional as F

__all__ = ["Activation", "swiglu", "clamped_swiglu", "activation_name"]


@dataclass(frozen=True)
class Activation:
    """``fn(gate, up) -> h`` with a name: ``"swiglu"`` is the one the fused expert paths run."""

    name: str
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.fn(gate, up)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    return F.silu(gate) * up


#: ``silu(gate) * up`` (Qwen3-MoE, Mixtral, Llama, DeepSeek): dense MLPs and experts alike.
swiglu = Activation("swiglu", _swiglu)


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

    return Activation(f"clamped_swiglu(alpha={alpha}, limit={limit})", act)


def activation_name(act: Union[Activation, Callable]) -> str:
    """``act.name`` for an :class:`Activation`, ``""`` for a plain function (general path)."""
    return act.name if isinstance(act, Activation) else ""
