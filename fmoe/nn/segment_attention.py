"""Causal attention of query segments over a long key sequence with torch's fused kernel.

A segment of ``n`` queries at positions ``[a, a + n)`` sees the keys ``[0, a + n)``: a
*prefix* ``[0, a)`` it sees whole (no mask) and a *diagonal* ``[a, a + n)`` it sees causally.
Each part is one call of the CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``,
which works by tiles and returns the rows' log-sum-exp), and the two parts merge by their
log-sum-exps: ``o = (o1 e^{l1} + o2 e^{l2}) / (e^{l1} + e^{l2})``. Backward calls the kernel's
backward on each part with the *merged* output and log-sum-exp, which is exactly each part's share
of the whole softmax's gradient (flash attention 2's ``D = rowsum(dO * O)``, ``P = e^{S - lse}``).
So a context-parallel rank's head and tail chunks (two segments) cost four kernel calls per layer
and direction, whatever the sequence length, and nothing of size ``n x Sk`` is materialised.

Values of another head size (MLA) are zero-padded to it. Grouped KV heads: the prefix folds a KV head's ``R`` query heads into its rows (no mask, so rows
are independent: K/V are never repeated); the diagonal, only ``n`` keys long, repeats K/V per
query head. It serves causal attention without window, sinks or key mask, on CPU tensors
(fake ones included: the dry run); :mod:`fmoe.nn.blocked_attention` serves the rest.

Example:
    >>> q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 8, 8)
    >>> segment_attention(q, k, k, ((0, 2), (6, 2)), scale=0.35).shape
    torch.Size([1, 2, 4, 8])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

__all__ = ["segment_attention", "segments_apply"]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def segments_apply(device: torch.device, dtype: torch.dtype, causal: bool, window, sinks, key_mask) -> bool:
    """Whether :func:`segment_attention` serves a call computing in ``dtype`` on ``device``
    (causal only, no window / sinks / key mask, CPU, fp32 or bf16).

    Example:
        >>> segments_apply(torch.device("cpu"), torch.float32, True, None, None, None)
        True
    """
    return (causal and window is None and sinks is None and key_mask is None and device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16))


def _parts(a: int, n: int):
    """``(key slice, causal)`` of a segment at ``a`` of ``n`` queries."""
    return [(slice(a, a + n), True)] + ([(slice(0, a), False)] if a > 0 else [])


def _call(q, k, v, causal, scale, rep):
    """One part: ``(o [B, Hq, n, dv], lse [B, Hq, n])``."""
    if causal:
        k, v = (repeat(t, "b g s d -> b (g r) s d", r=rep) for t in (k, v))
        return _FWD(q, k, v, 0.0, True, scale=scale)
    n = q.shape[2]
    o, lse = _FWD(rearrange(q, "b (g r) n d -> b g (r n) d", r=rep), k, v, 0.0, False, scale=scale)
    return rearrange(o, "b g (r n) d -> b (g r) n d", n=n), rearrange(lse, "b g (r n) -> b (g r) n", n=n)


def _forward(q, k, v, segments, scale):
    rep = q.shape[1] // k.shape[1]
    outs, lses, r = [], [], 0
    for a, n in segments:
        qs = q[:, :, r:r + n]
        o = lse = None
        for keys, causal in _parts(a, n):
            o2, l2 = _call(qs, k[:, :, keys], v[:, :, keys], causal, scale, rep)
            if o is None:
                o, lse = o2.float(), l2
                continue
            m = torch.maximum(lse, l2)
            w1, w2 = torch.exp(lse - m), torch.exp(l2 - m)
            o = (o * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
            lse = m + torch.log(w1 + w2)
        outs.append(o.to(q.dtype))
        lses.append(lse)
        r += n
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _backward(dout, q, k, v, out, lse, segments, scale):
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    r = 0
    for a, n in segments:
        qs, dos, os_, ls = (t[:, :, r:r + n] for t in (q, dout, out, lse))
        for keys, causal in _parts(a, n):
            kk, vv = k[:, :, keys], v[:, :, keys]
            if causal:
                kk, vv = (repeat(t, "b g s d -> b (g r) s d", r=rep) for t in (kk, vv))
                gq, gk, gv = _BWD(dos.contiguous(), qs.contiguous(), kk, vv, os_.contiguous(), ls.contiguous(),
                                  0.0, True, scale=scale)
                gk, gv = (rearrange(t, "b (g r) s d -> b g r s d", r=rep).sum(2) for t in (gk, gv))
            else:
                fold = lambda t: rearrange(t, "b (g r) n d -> b g (r n) d", r=rep).contiguous()  # noqa: E731
                gq, gk, gv = _BWD(fold(dos), fold(qs), kk.contiguous(), vv.contiguous(), fold(os_),
                                  rearrange(ls, "b (g r) n -> b g (r n)", r=rep).contiguous(), 0.0, False, scale=scale)
                gq = rearrange(gq, "b g (r n) d -> b (g r) n d", n=n)
            dq[:, :, r:r + n] += gq
            dk[:, :, keys] += gk
            dv[:, :, keys] += gv
        r += n
    return dq, dk, dv


class _Segments(torch.autograd.Function):
    """Segments' causal attention by the fused kernel; backward by its backward on the merged output."""

    @staticmethod
    def forward(q, k, v, segments, scale):
        return _forward(q, k, v, segments, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, segments, scale = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.segments, ctx.scale = segments, scale
        ctx.save_for_backward(q, k, v, out, lse)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(dout.contiguous(), q, k, v, out, lse, ctx.segments, ctx.scale), None, None)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: tuple, scale: float) -> torch.Tensor:
    """Causal attention of query segments over keys at positions ``0..Sk-1``.

    Args:
        q: ``[B, Hq, S, hd]`` queries, ``S`` the segments' lengths summed.
        k: ``[B, Hkv, Sk, hd]``; v: ``[B, Hkv, Sk, hd_v]``.
        segments: ``((first position, length), ...)`` of the queries, in order.
        scale: the scores' scale.
    Returns:
        ``[B, Hq, S, hd_v]``.
    """
    hd, dv = q.shape[-1], v.shape[-1]        # the kernel takes one head size: zero columns change nothing
    if dv < hd:
        v = F.pad(v, (0, hd - dv))
    elif dv > hd:
        q, k = F.pad(q, (0, dv - hd)), F.pad(k, (0, dv - hd))
    return _Segments.apply(q, k, v, tuple(segments), scale)[0][..., :dv]
