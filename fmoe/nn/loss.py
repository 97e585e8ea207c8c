"""Token-level losses on full (replicated) logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..precision import upcast
from ..transforms import data_checks_enabled
from ._tp import check_tensor

__all__ = ["cross_entropy"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens whose target is not ``ignore_index``.

    Computed in fp32. The caller aligns logits and targets (for language modelling:
    ``cross_entropy(logits[:, :-1], tokens[:, 1:])``). If every target is ignored the mean is
    NaN, as in ``torch.nn.functional.cross_entropy``.

    Args:
        logits: ``[..., V]`` full logits.
        targets: integer ``[...]`` (same leading shape), values in ``[0, V)`` or ``ignore_index``.
        ignore_index: target value excluded from the mean.
    Returns:
        scalar loss.

    Example:
        >>> cross_entropy(torch.zeros(2, 4), torch.tensor([1, -100])).item() == torch.log(torch.tensor(4.0)).item()
        True
    """
    check_tensor("cross_entropy", "logits", logits)
    check_tensor("cross_entropy", "targets", targets)
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"cross_entropy: targets must be an integer tensor, got dtype {targets.dtype}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} + [V]")
    flat = targets.reshape(-1)
    kept = flat[flat != ignore_index] if data_checks_enabled() else flat[:0]   # see fmoe.transforms
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= logits.shape[-1]):
        raise ValueError(f"cross_entropy: targets must lie in [0, {logits.shape[-1]}) or equal "
                         f"ignore_index={ignore_index}, got min {int(kept.min())}, max {int(kept.max())}")
    return F.cross_entropy(upcast(logits.reshape(-1, logits.shape[-1])), flat, ignore_index=ignore_index)
