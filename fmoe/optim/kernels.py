"""The per-leaf AdamW update of :mod:`fmoe.optim.adamw`, two ways with the same numbers.

- :func:`adam`: tensor math in at least float32 whatever the stored dtypes, stored back in
  them (bf16 weights stochastically rounded); it runs on float64 leaves, under transforms, with
  stochastic rounding, and by pieces for a donated update;
- :func:`fused_adamw`: torch's fused kernel ``torch._fused_adamw_`` over a group of plain
  contiguous fp32 / bf16 leaves of one dtype and device (:func:`fusable`), in place, one
  vectorized pass per tensor instead of ~15.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from ..precision import store
from ..transforms import active as _transform_active

__all__ = ["adam", "fusable", "fused_adamw"]


def adam(g0, m0, v0, p0, hyper, finite, rounding):
    """One AdamW update of local tensors, computed in at least float32 whatever the stored dtypes,
    then stored back in them (bf16 weights stochastically rounded with ``rounding``)."""
    scale, b1, b2, bc1, bc2, lr, wd, eps = hyper
    cd = torch.promote_types(p0.dtype, torch.float32)
    g = g0.to(cd) * scale.to(cd)
    m = m0.to(cd) * b1 + g * (1 - b1)
    v = v0.to(cd) * b2 + g.square() * (1 - b2)
    pl = p0.to(cd)
    if wd:
        pl = pl * (1 - lr * wd)
    denom = (v / bc2).sqrt().add_(eps)
    pl = pl - lr * (m / bc1) / denom
    pl, m, v = store(pl, p0.dtype, rounding), store(m, m0.dtype), store(v, v0.dtype)
    return torch.where(finite, pl, p0), torch.where(finite, m, m0), torch.where(finite, v, v0)


def fusable(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether torch's fused AdamW kernel can update this leaf: plain contiguous fp32 / bf16
    tensors of one dtype and device, outside any transform (float64 keeps the exact tensor math:
    the kernel takes its gradient scale in fp32)."""
    ts = (g, m, v, p)
    return (not _transform_active() and p.dtype in (torch.float32, torch.bfloat16)
            and p.device.type in ("cpu", "cuda") and all(t.dtype == p.dtype and t.device == p.device
                                                         and t.is_contiguous() for t in ts))


def fused_adamw(group: list, t: torch.Tensor, scale: torch.Tensor, finite: torch.Tensor,
                 lr: Union[float, torch.Tensor], cfg: Any, wd: float) -> None:
    """``torch._fused_adamw_`` over ``[(g, m, v, p), ...]`` in place at step ``t`` (the bias
    corrections' step count; ``cfg`` an :class:`fmoe.optim.AdamWConfig`): the same update as
    :func:`adam` in one vectorized pass per tensor (the tensor math makes ~15 passes over memory). The clip scale enters as the
    kernel's gradient divisor (``g`` is left scaled), a non-finite norm as its ``found_inf``
    (nothing is written)."""
    g, m, v, p = (list(x) for x in zip(*group))
    dev = p[0].device
    t = t.to(device=dev, dtype=torch.float32)
    b1, b2 = cfg.betas
    lr = lr.to(dev) if isinstance(lr, torch.Tensor) else float(lr)
    torch._fused_adamw_(p, g, m, v, [], [t] * len(p), lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=cfg.eps,
                        amsgrad=False, maximize=False, grad_scale=(1 / scale).to(dev, torch.float32),
                        found_inf=(~finite).to(dev, torch.float32))
