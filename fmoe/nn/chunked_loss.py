"""Cross-entropy by chunks of tokens: the fp32 ``[T, V]`` log-softmax never exists whole.

:func:`fmoe.nn.cross_entropy` on ``T`` tokens of a ``V``-word vocabulary keeps an fp32
``[T, V]`` log-softmax for backward and makes two more of that size in backward (Qwen3-30B-A3B,
2048 tokens: 1.25 GB each, about 3 GB at the start of backward on every rank, whatever the
mesh). :func:`chunked_cross_entropy` splits the rows into ``chunks`` pieces and computes each
piece's summed loss under activation checkpointing (``torch.utils.checkpoint``): forward keeps
only the bf16 / fp32 logits the model returned, backward recomputes one chunk's fp32
log-softmax at a time. The result is the same mean (each chunk's sum in fp32, the chunk sums
added, divided by the number of counted targets): equal to the plain loss up to fp32
summation order, and so are the gradients.

Example:
    >>> import torch
    >>> from fmoe.nn import cross_entropy
    >>> x, y = torch.randn(2, 6, 5), torch.randint(0, 5, (2, 6))
    >>> torch.allclose(chunked_cross_entropy(x, y, chunks=4), cross_entropy(x, y))
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..transforms import data_checks_enabled
from ._tp import check_tensor
from ..precision import upcast

__all__ = ["chunked_cross_entropy"]


def _chunk_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(upcast(logits), targets, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunks: int,
                          ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy, as :func:`fmoe.nn.cross_entropy`, by ``chunks`` pieces of rows.

    Args:
        logits: ``[..., V]`` full logits (any float dtype; each chunk computes in at least fp32).
        targets: integer ``[...]``, values in ``[0, V)`` or ``ignore_index``.
        chunks: pieces of rows (``>= 1``; more pieces than rows gives one row per piece).
        ignore_index: target value excluded from the mean.
    Returns:
        scalar loss in at least fp32 (float64 logits give a float64 loss) (NaN if every target is ignored).
    """
    check_tensor("chunked_cross_entropy", "logits", logits)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunked_cross_entropy: chunks must be an int >= 1, got {chunks!r}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"chunked_cross_entropy: targets must be an integer tensor, got dtype {targets.dtype}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"chunked_cross_entropy: logits {tuple(logits.shape)} must be targets "
                         f"{tuple(targets.shape)} + [V]")
    V = logits.shape[-1]
    flat_l, flat_t = logits.reshape(-1, V), targets.reshape(-1)                  # [T, V], [T]
    if data_checks_enabled():                                                  # see fmoe.transforms
        kept = flat_t[flat_t != ignore_index]
        if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= V):
            raise ValueError(f"chunked_cross_entropy: targets must lie in [0, {V}) or equal "
                             f"ignore_index={ignore_index}, got min {int(kept.min())}, max {int(kept.max())}")
    total = None
    for lc, tc in zip(flat_l.chunk(chunks), flat_t.chunk(chunks)):
        s = checkpoint(_chunk_sum, lc, tc, ignore_index, use_reentrant=False)
        total = s if total is None else total + s
    return total / (flat_t != ignore_index).sum().to(total.dtype)
