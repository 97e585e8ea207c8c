"""Attention by blocks with an online softmax: temporaries bounded by a block, never ``[S, Sk]``.

Flash attention's algorithm written with torch ops. The queries are cut into blocks of ``bq``
rows and the keys into blocks of ``bk``; for each query block the key blocks it can see are
visited in order, keeping a running maximum ``m``, a running denominator ``l`` and an
unnormalised output (the online softmax), so a step holds ``[B, Hq, bq, bk]`` scores, not the
whole ``[B, Hq, S, Sk]`` table. Forward saves ``q, k, v``, the output and the log-sum-exp
``lse [B, Hq, S]``; backward recomputes each block's probabilities from ``lse`` (flash
attention 2), so nothing of size ``S x Sk`` is kept for backward either.

Positions are host-side data (:class:`Layout`): the queries are segments ``(first position,
length)``, increasing (one segment for a plain sequence; a context-parallel rank's head and tail
chunks are two), the keys are ``k_first + arange(Sk)``. Which block pairs are visible, and which
need no mask, is decided on the host from them, with no read of a tensor: the same code runs on
fake tensors (``fmoe memory --dry-run``) and skips the blocks a causal or sliding-window mask
hides entirely. The mask rules are those of :func:`fmoe.nn.attention.visible`: key ``j`` is
visible from query ``i`` if ``j <= i`` (causal) and ``i - j < window``; a ``key_mask`` hides
padding keys, but a query always sees its own position. Sinks (gpt-oss) join each row's
denominator with no value: their gradient is ``-sum(p_sink * rowsum(dO * O))``.

The math runs in :func:`fmoe.precision.at_least_f32` of the inputs (float64 stays float64), and
equals the plain attention to rounding. The Function serves forward and (first-order) backward;
under ``vmap``, forward-mode AD, a second derivative or ``torch.compile``
:func:`fmoe.nn.attention.attention` takes its plain path instead (:func:`fmoe.transforms.active`).

Example:
    >>> q, k = torch.randn(1, 2, 6, 4), torch.randn(1, 1, 6, 4)
    >>> lay = Layout(segments=((0, 6),), k_first=0, causal=True, window=None, scale=0.5, bq=2, bk=4)
    >>> blocked_attention(q, k, k, lay).shape
    torch.Size([1, 2, 6, 4])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from einops import rearrange

__all__ = ["Layout", "blocked_attention", "block_sizes", "SCORE_BUDGET", "KEY_BLOCK"]

#: elements of one step's score block ``[B, Hq, bq, bk]`` (fp32: 64 MiB); the query block grows
#: to fill it, so long sequences take few, large steps.
SCORE_BUDGET = 1 << 24
#: keys per block.
KEY_BLOCK = 512


def block_sizes(batch: int, heads: int, q_len: int, k_len: int) -> tuple[int, int]:
    """``(bq, bk)``: key blocks of :data:`KEY_BLOCK`, query blocks filling :data:`SCORE_BUDGET`.

    Example:
        >>> block_sizes(1, 4, 131072, 131072)
        (8192, 512)
    """
    bk = min(KEY_BLOCK, k_len)
    bq = max(1, min(q_len, SCORE_BUDGET // max(1, batch * heads * bk)))
    return bq, bk


@dataclass(frozen=True)
class Layout:
    """Where the queries and keys sit, and the mask: host data, no tensor.

    Args:
        segments: the queries' positions, ``((first, length), ...)`` increasing and disjoint.
        k_first: the position of key 0 (keys are ``k_first + arange(Sk)``).
        causal: key ``j`` visible from query ``i`` only if ``j <= i``.
        window: and only if ``i - j < window`` (None: no window).
        scale: the scores' scale.
        bq: queries per block.
        bk: keys per block.
    """

    segments: tuple
    k_first: int
    causal: bool
    window: Optional[int]
    scale: float
    bq: int
    bk: int

    def q_pos(self, i: int) -> int:
        """Position of local query ``i``."""
        for first, n in self.segments:
            if i < n:
                return first + i
            i -= n
        raise IndexError(i)

    def positions(self, device) -> torch.Tensor:
        """``[S]`` int64 query positions."""
        return torch.cat([torch.arange(f, f + n, device=device) for f, n in self.segments])

    def pairs(self, S: int, Sk: int, masked: bool) -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
        """``[(qa, qb, [(ka, kb, needs_mask), ...]), ...]``: each query block and the key blocks it
        sees (all of them when ``masked``: a key mask may hide any key)."""
        out = []
        for qa in range(0, S, self.bq):
            qb = min(S, qa + self.bq)
            lo, hi = self.q_pos(qa), self.q_pos(qb - 1)   # positions increase: block min / max
            keys = []
            for ka in range(0, Sk, self.bk):
                kb = min(Sk, ka + self.bk)
                k_lo, k_hi = self.k_first + ka, self.k_first + kb - 1
                if (self.causal and k_lo > hi) or (self.window is not None and lo - k_hi >= self.window):
                    continue                                  # hidden from every query of the block
                full = (not self.causal or k_hi <= lo) and (self.window is None or hi - k_lo < self.window)
                keys.append((ka, kb, masked or not full))   # min / max bound every query: exact with a gap too
            out.append((qa, qb, keys))
        return out


def _visible(lay: Layout, qp: torch.Tensor, ka: int, kb: int, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``[bq, bk]`` (or ``[B, 1, 1, bq, bk]`` with a key mask) visible keys of one block pair."""
    kp = torch.arange(lay.k_first + ka, lay.k_first + kb, device=qp.device)[None, :]
    q = qp[:, None]
    ok = torch.ones(q.shape[0], kp.shape[1], dtype=torch.bool, device=qp.device)
    if lay.causal:
        ok = ok & (kp <= q)
    if lay.window is not None:
        ok = ok & (q - kp < lay.window)
    if key_mask is None:
        return ok
    return rearrange((ok & key_mask[:, None, ka:kb]) | (kp == q), "b s k -> b 1 1 s k")


def _scores(lay, q, k, qp, ka, kb, key_mask, needs_mask):
    """``[B, G, R, bq, bk]`` scaled scores of a block pair, hidden keys ``-inf``."""
    s = torch.matmul(q, rearrange(k[:, :, ka:kb], "b g k d -> b g 1 d k")) * lay.scale
    if needs_mask:
        s = s.masked_fill(~_visible(lay, qp, ka, kb, key_mask), float("-inf"))
    return s


def _forward(q, k, v, sinks, key_mask, lay):
    """``(out [B, G, R, S, dv], lse [B, G, R, S])`` by blocks."""
    B, G, R, S, _ = q.shape
    qpos = lay.positions(q.device)
    out = q.new_empty(B, G, R, S, v.shape[-1])
    lse = q.new_empty(B, G, R, S)
    for qa, qb, keys in lay.pairs(S, k.shape[2], key_mask is not None):
        qi, qp = q[:, :, :, qa:qb], qpos[qa:qb]
        m = q.new_full(qi.shape[:-1], float("-inf"))
        l = q.new_zeros(qi.shape[:-1])
        acc = q.new_zeros(*qi.shape[:-1], v.shape[-1])
        for ka, kb, needs_mask in keys:
            s = _scores(lay, qi, k, qp, ka, kb, key_mask, needs_mask)
            m_new = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isinf(m_new), 0.0, m_new)          # rows with no visible key yet
            p = torch.exp(s - safe[..., None])
            alpha = torch.exp(m - safe)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, rearrange(v[:, :, ka:kb], "b g k d -> b g 1 k d"))
            m = m_new
        if sinks is not None:
            sk = rearrange(sinks, "g r -> 1 g r 1").to(q.dtype)
            m_new = torch.maximum(m, sk)
            alpha = torch.exp(m - m_new)
            l = l * alpha + torch.exp(sk - m_new)
            acc, m = acc * alpha[..., None], m_new
        out[:, :, :, qa:qb] = acc / l[..., None]
        lse[:, :, :, qa:qb] = m + torch.log(l)
    return out, lse


def _backward(dout, q, k, v, out, lse, sinks, key_mask, lay):
    """Gradients of ``q, k, v`` (and sinks) from the saved ``lse``: each block recomputed."""
    qpos = lay.positions(q.device)
    D = (dout * out).sum(-1)                                               # [B, G, R, S]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qa, qb, keys in lay.pairs(q.shape[3], k.shape[2], key_mask is not None):
        qi, qp, doi = q[:, :, :, qa:qb], qpos[qa:qb], dout[:, :, :, qa:qb]
        li, Di = lse[:, :, :, qa:qb, None], D[:, :, :, qa:qb, None]
        for ka, kb, needs_mask in keys:
            p = torch.exp(_scores(lay, qi, k, qp, ka, kb, key_mask, needs_mask) - li)   # [B, G, R, bq, bk]
            vk = rearrange(v[:, :, ka:kb], "b g k d -> b g 1 d k")
            ds = p * (torch.matmul(doi, vk) - Di) * lay.scale
            dv[:, :, ka:kb] += torch.einsum("bgrqk,bgrqd->bgkd", p, doi)
            dq[:, :, :, qa:qb] += torch.matmul(ds, rearrange(k[:, :, ka:kb], "b g k d -> b g 1 k d"))
            dk[:, :, ka:kb] += torch.einsum("bgrqk,bgrqd->bgkd", ds, qi)
    dsinks = None
    if sinks is not None:
        p_sink = torch.exp(rearrange(sinks, "g r -> 1 g r 1").to(q.dtype) - lse)
        dsinks = -(p_sink * D).sum(dim=(0, 3)).to(sinks.dtype)
    return dq, dk, dv, dsinks


class _Blocked(torch.autograd.Function):
    """Blocked attention: forward by blocks, backward recomputing each block from ``lse``
    (returned as a second, non-differentiable output)."""

    @staticmethod
    def forward(q, k, v, sinks, key_mask, lay):
        return _forward(q, k, v, sinks, key_mask, lay)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, sinks, key_mask, lay = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.lay, ctx.has_sinks = lay, sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, sinks, key_mask)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks, key_mask = ctx.saved_tensors
        dq, dk, dv, dsinks = _backward(dout, q, k, v, out, lse, sinks, key_mask, ctx.lay)
        return dq, dk, dv, dsinks, None, None


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout,
                      sinks: Optional[torch.Tensor] = None, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Grouped-query attention by blocks (no ``[S, Sk]`` tensor, forward or backward).

    Args:
        q: ``[B, Hq, S, hd]`` queries (head-major), ``Hq`` a multiple of ``Hkv``.
        k: ``[B, Hkv, Sk, hd]``.
        v: ``[B, Hkv, Sk, hd_v]``.
        lay: positions, mask and block sizes (:class:`Layout`).
        sinks: ``[Hq]`` sink logits (local heads), or None.
        key_mask: ``[B, Sk]`` bool, False for padding keys, or None.
    Returns:
        ``[B, Hq, S, hd_v]`` in ``q``'s dtype, computed in ``at_least_f32``.
    """
    core = torch.promote_types(q.dtype, torch.float32)
    G = k.shape[1]
    qg = rearrange(q.to(core), "b (g r) s d -> b g r s d", g=G)   # query head h uses KV head h // R
    sg = None if sinks is None else rearrange(sinks.to(core), "(g r) -> g r", g=G)
    out, _ = _Blocked.apply(qg, k.to(core), v.to(core), sg, key_mask, lay)
    return rearrange(out, "b g r s d -> b (g r) s d").to(q.dtype)
