"""Context parallelism: a sequence split over ``cp`` ranks in load-balanced causal chunks.

A sequence of ``S`` tokens is cut into ``2 cp`` chunks of ``L = S / (2 cp)``; rank ``c`` of the
cp group holds chunk ``c`` (its head) and chunk ``2 cp - 1 - c`` (its tail). Under a causal mask
a query's cost grows with its position, so pairing an early chunk with a late one gives every
rank the same attention work (``(2 cp + 1) L^2`` visible scores each, against ``L^2`` to
``(4 cp - 1) L^2`` for contiguous pieces). Everything but attention is per token (norms, MLPs,
experts, the loss), so a rank runs it on its ``2 L`` tokens only; the rope positions are the
chunks' own (:meth:`ContextParallel.positions`).

Attention needs every earlier key: each rank all-gathers the K/V of the cp group
(:func:`fmoe.collectives.all_gather`, backward a reduce-scatter of their gradients: K/V
``[B, S, Hkv, hd]``, a ``2 L`` slice sent per rank) and attends its ``2 L`` queries, at their
positions, to the whole sequence by blocks (:mod:`fmoe.nn.blocked_attention`). All-gather
rather than a ring: with grouped KV heads K/V are ``Hq / Hkv`` times smaller than the queries,
one exchange per layer and direction has no latency chain, and the blocked attention keeps the
scores bounded anyway; a ring would only save the ``S x Hkv x hd`` gathered K/V per layer.

Example:
    >>> cp = ContextParallel(None, size=2, rank=1)
    >>> cp.chunks(), cp.segments(8)
    ((1, 2), ((2, 2), (4, 2)))
    >>> cp.shard(torch.arange(8)[None], dim=1).tolist()
    [[2, 3, 4, 5]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..collectives import all_gather

__all__ = ["ContextParallel", "check_sequence"]


def check_sequence(seq: int, cp: int, what: str = "sequence length") -> None:
    """Refuse a sequence that does not split into ``2 cp`` equal chunks.

    Example:
        >>> check_sequence(12, 2)
        >>> check_sequence(10, 2)
        Traceback (most recent call last):
        ...
        ValueError: context parallelism: sequence length 10 must be divisible by 2 * cp = 4 (each cp rank holds a head and a tail chunk); e.g. 8 or 12
    """
    n = 2 * cp
    if seq % n:
        lo, hi = seq // n * n, (seq // n + 1) * n
        raise ValueError(f"context parallelism: {what} {seq} must be divisible by 2 * cp = {n} (each cp rank holds "
                         f"a head and a tail chunk); e.g. {lo or hi} or {hi}")


@dataclass(frozen=True)
class ContextParallel:
    """One rank's place in its cp group: which chunks it holds, how it gathers K/V.

    Args:
        group: the cp process group (``mesh.group("cp")``).
        size: ranks in the group; rank: this rank's index in it.
    """

    group: Any
    size: int
    rank: int

    @staticmethod
    def of(mesh: Any) -> Optional["ContextParallel"]:
        """The mesh's context parallelism, or None without it (``cp == 1`` or no mesh)."""
        if mesh is None or mesh.cp == 1:
            return None
        return ContextParallel(mesh.group("cp"), mesh.cp, mesh.rank_in("cp"))

    def chunks(self) -> tuple[int, int]:
        """``(head, tail)``: the chunk indices this rank holds, of ``2 cp``."""
        return self.rank, 2 * self.size - 1 - self.rank

    def segments(self, seq: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((first position, length), ...)`` of this rank's two chunks of a ``seq``-token sequence."""
        check_sequence(seq, self.size)
        n = seq // (2 * self.size)
        return tuple((c * n, n) for c in self.chunks())

    def positions(self, seq: int, device: Any = None) -> torch.Tensor:
        """``[2 L]`` positions of this rank's tokens."""
        return torch.cat([torch.arange(a, a + n, device=device) for a, n in self.segments(seq)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of ``x`` (the whole sequence along ``dim``), concatenated."""
        return torch.cat([x.narrow(dim, a, n) for a, n in self.segments(x.shape[dim])], dim=dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence in order from every rank's two chunks ``x`` (``2 L`` along ``dim``):
        an all-gather over the cp group (backward: the gradients summed to their owners)."""
        n = x.shape[dim] // 2
        every = all_gather(x, self.group, dim=dim, sizes=[x.shape[dim]] * self.size)   # rank r: chunks r, 2cp-1-r
        parts = every.split(n, dim=dim)
        heads, tails = parts[0::2], parts[1::2]
        return torch.cat(list(heads) + list(reversed(tails)), dim=dim)
