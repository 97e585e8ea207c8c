"""The one precision rule: compute "at least float32".

Norms, losses, routers, statistics and attention probabilities compute in
``torch.promote_types(dtype, torch.float32)``: bf16 / fp16 inputs are computed in fp32 (as
before), float32 stays float32, and float64 stays float64, so a float64 model is float64 end to
end and ``torch.autograd.gradcheck`` or finite differences can check it.

Example:
    >>> at_least_f32(torch.bfloat16), at_least_f32(torch.float64)
    (torch.float32, torch.float64)
    >>> upcast(torch.ones(2, dtype=torch.float16)).dtype
    torch.float32
"""

from __future__ import annotations

import torch

__all__ = ["at_least_f32", "upcast"]


def at_least_f32(dtype: torch.dtype) -> torch.dtype:
    """``torch.promote_types(dtype, torch.float32)``: the dtype fmoe computes a ``dtype`` input in."""
    return torch.promote_types(dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`at_least_f32` of its dtype (``t`` itself when it already is)."""
    return t.to(at_least_f32(t.dtype))
