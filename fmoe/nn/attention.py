"""Scaled dot-product attention over this rank's heads: GQA, causal, sliding window, sinks.

Attention is independent per head, so tensor parallelism needs no collective here: a plan that
splits the q/k/v projections colwise gives each rank ``Hq / tp`` query heads and ``Hkv / tp``
KV heads, and the function infers everything from the shapes it receives
(q ``[B, S, Hq_local, hd]``, k/v ``[B, Sk, Hkv_local, hd]``). The output projection (rowwise)
then sums the heads' contributions.

A key at position ``j`` is visible from a query at position ``i`` when ``j <= i`` (causal) and,
with a sliding ``window``, when ``i - j < window`` (transformers' convention: the window counts
the query itself). With ``Sk > S`` the queries are the last ``S`` positions (decoding with a
cache, :mod:`fmoe.nn.cache`). A ``key_mask [B, Sk]`` hides padding slots from every query (a
query always sees its own slot, so a padding row stays finite; its output is never used).
Positions here are cache *slots*, as in transformers' masks: with left padding a sliding window
counts the padding slots too.

Values may have their own head size (DeepSeek's MLA: ``v_head_dim != qk_head_dim``).

Attention *sinks* (gpt-oss) are one learned logit per query head that joins the softmax
denominator but has no value: ``p = softmax([scores, sink])[:-1]``. The sink parameter is placed
like the heads (style ``local``, ``P("tp")``), so each rank uses its own slice.

The math is plain matmul + fp32 softmax in the same order as transformers' eager attention, so
fp32 results match to rounding. Four paths, chosen by data: torch's fused SDPA where no mask
table is needed (plain causal or full attention: its CPU kernel works by blocks); causal query
segments over longer keys (a context-parallel rank's chunks, a long prefill after a cache) by
the fused kernel per segment (:mod:`fmoe.nn.segment_attention`, CPU); by blocks with
an online softmax (:mod:`fmoe.nn.blocked_attention`) when a mask, sinks or a key mask meet a
sequence whose ``[B, Hq, S, Sk]`` scores exceed one block's budget (:func:`blocked_path`), so
temporaries stay bounded instead of growing with ``S x Sk``; the plain scores otherwise, and
under the transforms the blocked Function does not serve (``vmap``, forward mode, second
derivatives, ``torch.compile``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from ..collectives import all_gather, grad_sum
from ..precision import at_least_f32, gemm
from ..fsdp import unshard
from ..sharding import placement_of, sequence_parallel
from ..transforms import compiling, higher_order, vmapping
from ._tp import check_tensor, tp_size_rank
from .blocked_attention import SCORE_BUDGET, Layout, blocked_attention, block_sizes
from .context_parallel import ContextParallel
from .segment_attention import segment_attention, segments_apply

__all__ = ["attention", "visible", "shared_by_heads", "blocked_path"]


def visible(q_len: int, k_len: int, causal: bool = True, window: Optional[int] = None,
            device: Optional[torch.device] = None) -> torch.Tensor:
    """Boolean ``[q_len, k_len]`` table: which keys each query may attend to.

    Args:
        q_len: number of queries (the last ``q_len`` of the ``k_len`` positions).
        k_len: number of keys.
        causal: key ``j`` visible from query ``i`` only if ``j <= i``.
        window: and only if ``i - j < window`` (None: no window).
        device: device of the table.
    Returns:
        bool tensor ``[q_len, k_len]``.

    Example:
        >>> visible(3, 3, window=2).int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    ok = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        ok = ok & (k_pos <= q_pos)
    if window is not None:
        ok = ok & (q_pos - k_pos < window)
    return ok


def _mask(S: int, Sk: int, causal: bool, window: Optional[int], key_mask: Optional[torch.Tensor],
          device, segments: Optional[tuple] = None) -> torch.Tensor:
    """``[S, Sk]`` (or ``[B, 1, S, Sk]`` with a key mask) table of visible keys; the queries at
    ``segments`` (a context-parallel rank's chunks) instead of the last ``S`` positions."""
    if segments is None:
        ok = visible(S, Sk, causal, window, device=device)
    else:
        q = torch.cat([torch.arange(a, a + n, device=device) for a, n in segments])[:, None]
        k = torch.arange(Sk, device=device)[None, :]
        ok = (k <= q if causal else torch.ones_like(k <= q)) & ((q - k < window) if window is not None else True)
    if key_mask is None:
        return ok
    own = visible(S, Sk, causal=True, window=1, device=device)          # each query's own slot
    return rearrange((ok & key_mask[:, None, :]) | own, "b s k -> b 1 s k")


def shared_by_heads(x: torch.Tensor, heads_weight: torch.Tensor) -> torch.Tensor:
    """Mark ``x [B, S, d]``, replicated over tp, as used by this rank's heads only (identity in value).

    A per-token tensor shared by all heads (DeepSeek's rope key ``k_rot [B, S, r]``) meets
    only the local heads of a layer whose ``heads_weight`` is split over tp, so each rank's
    gradient of ``x`` is partial; this sums it over tp in backward (``grad_sum``), like a
    colwise linear does for its input. Under sequence parallelism (``heads_weight`` placed on a
    ``sp`` mesh) ``x`` is this rank's piece of the sequence: it is gathered along ``S``
    (``all_gather``: backward sums over tp and keeps the piece), as a colwise layer's input is.

    Example:
        >>> shared_by_heads(torch.ones(2), torch.ones(4, 2)).tolist()
        [1.0, 1.0]
    """
    group, n, _ = tp_size_rank(heads_weight)
    if n == 1 or placement_of(heads_weight).dim_of("tp") is None:
        return x
    if sequence_parallel(heads_weight):
        return all_gather(x, group, dim=-2, sizes=[x.shape[-2]] * n)      # [B, S / tp, d] -> [B, S, d]
    return grad_sum(x, group)


def blocked_path(batch: int, heads: int, q_len: int, k_len: int) -> bool:
    """Whether :func:`attention` computes by blocks when it needs a mask or sinks: the whole
    ``[batch, heads, q_len, k_len]`` score table is larger than one block's budget
    (:data:`fmoe.nn.blocked_attention.SCORE_BUDGET`) and no transform the blocked Function does
    not serve is active.

    Example:
        >>> blocked_path(1, 4, 128, 128), blocked_path(1, 4, 32768, 32768)
        (False, True)
    """
    if batch * heads * q_len * k_len <= SCORE_BUDGET:
        return False
    return not (vmapping() or higher_order() or compiling())


def _check(q, k, v, window, sinks, num_kv_groups, key_mask) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor("attention", name, t, 4)
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or q.shape[1] > k.shape[1]:
        raise ValueError(f"attention: expected q [B, S, Hq, hd], k [B, Sk >= S, Hkv, hd], v [B, Sk, Hkv, hd_v]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_mask is not None and (not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool
                                 or tuple(key_mask.shape) != (k.shape[0], k.shape[1])):
        raise ValueError(f"attention: key_mask must be a bool [B={k.shape[0]}, Sk={k.shape[1]}] tensor, got "
                         f"{getattr(key_mask, 'dtype', type(key_mask).__name__)} "
                         f"{tuple(getattr(key_mask, 'shape', ()))}")
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"attention: q has {hq} heads, not a multiple of the {hkv} k/v heads")
    if num_kv_groups is not None and hq != hkv * num_kv_groups:
        raise ValueError(f"attention: q has {hq} heads and k/v {hkv}, but num_kv_groups={num_kv_groups} "
                         "query heads share a KV head; the plan must shard q and k/v alike")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attention: window must be None or an int >= 1, got {window!r}")
    if sinks is not None:
        check_tensor("attention", "sinks", sinks, 1)


def _local_sinks(sinks: torch.Tensor, heads: int) -> torch.Tensor:
    """This rank's ``[Hq_local]`` sink logits (gathered over the data axes, kept over tp)."""
    sl = unshard(sinks, keep=("tp",))
    if sl.shape[0] != heads:
        raise ValueError(f"attention: sinks has {sl.shape[0]} local entries but q has {heads} "
                         "heads; place sinks like the query heads (style 'local')")
    return sl


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              window: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
              scale: Optional[float] = None, num_kv_groups: Optional[int] = None,
              key_mask: Optional[torch.Tensor] = None, cp: Optional[ContextParallel] = None) -> torch.Tensor:
    """Multi-head attention with grouped KV heads.

    Args:
        q: ``[B, S, Hq, hd]`` (this rank's query heads, rotary already applied).
        k: ``[B, Sk, Hkv, hd]``; ``Hq`` must be a multiple of ``Hkv``.
        v: ``[B, Sk, Hkv, hd_v]``.
        causal: mask future keys.
        window: sliding window length (``i - j < window``), or None.
        sinks: per-query-head sink logits ``[Hq]`` (plain, or a DTensor placed ``P("tp")``).
        scale: score scale; default ``hd ** -0.5``.
        num_kv_groups: the model's ``Hq_total / Hkv_total``, if given it is checked against the
            shapes, catching a plan that shards q and k/v differently.
        key_mask: ``[B, Sk]`` bool, False for padding slots (None: every key is real).
        cp: context parallelism (:class:`fmoe.nn.context_parallel.ContextParallel`, a model's
            ``Context.cp``): q, k, v are this rank's two chunks of the sequence; K/V are gathered
            over the cp group and the queries attend at their positions.
    Returns:
        ``[B, S, Hq, hd_v]``.

    Example:
        >>> attention(torch.ones(1, 4, 2, 8), torch.ones(1, 4, 1, 8), torch.ones(1, 4, 1, 8)).shape
        torch.Size([1, 4, 2, 8])
    """
    _check(q, k, v, window, sinks, num_kv_groups, key_mask)
    segments = None
    if cp is not None:
        if key_mask is not None or q.shape[1] != k.shape[1]:
            raise ValueError("attention: context parallelism splits whole sequences; it takes no key_mask or KV "
                             "cache (decode without cp)")
        segments = cp.segments(q.shape[1] * cp.size)
        k, v = cp.gather(k), cp.gather(v)                       # [B, S, Hkv, hd]: the whole sequence
    hd = q.shape[-1]
    scale = hd ** -0.5 if scale is None else scale
    rep = q.shape[2] // k.shape[2]
    qh = rearrange(q, "b s h d -> b h s d")
    S, Sk = q.shape[1], k.shape[1]
    plain_causal = causal and window is None and S == Sk and key_mask is None
    no_table = segments is None and (plain_causal or (not causal and window is None and key_mask is None))
    long = blocked_path(q.shape[0], q.shape[2], S, Sk)
    # On CPU the fused kernels' bf16 backward runs ~3x slower than their fp32 one (no AMX path;
    # benchmarks/RESULTS.md), so the core computes in fp32 there; the projections stay bf16.
    core = at_least_f32(q.dtype) if q.device.type == "cpu" else q.dtype
    fused = not (vmapping() or higher_order() or compiling())     # the kernels' Functions serve plain autograd
    if (segments is not None or (long and S < Sk)) and fused and segments_apply(q.device, core, causal, window,
                                                                                sinks, key_mask):
        kt, vt = rearrange(k, "b s g d -> b g s d"), rearrange(v, "b s g d -> b g s d")   # queries' segments by the kernel
        out = segment_attention(qh.to(core), kt.to(core), vt.to(core), segments or ((Sk - S, S),), scale)
        return rearrange(out.to(q.dtype), "b h s d -> b s h d")
    if not (sinks is None and no_table) and long:
        lay = Layout(segments or ((Sk - S, S),), 0, causal, window, scale, *block_sizes(q.shape[0], q.shape[2], S, Sk))
        sl = None if sinks is None else _local_sinks(sinks, q.shape[2])
        out = blocked_attention(qh, rearrange(k, "b s g d -> b g s d"), rearrange(v, "b s g d -> b g s d"), lay,
                                sinks=sl, key_mask=key_mask)
        return rearrange(out, "b h s d -> b s h d")
    if sinks is None and not higher_order():  # fused kernel (no forward AD / double backward on CPU): no [S, Sk] probabilities kept
        kt, vt = rearrange(k, "b s g d -> b g s d"), rearrange(v, "b s g d -> b g s d")
        mask = None if no_table else _mask(S, Sk, causal, window, key_mask, q.device, segments)
        out = F.scaled_dot_product_attention(qh.to(core), kt.to(core), vt.to(core), attn_mask=mask,
                                             is_causal=plain_causal, scale=scale, enable_gqa=rep > 1)
        return rearrange(out.to(q.dtype), "b h s d -> b s h d")
    kh = repeat(k, "b s g d -> b (g r) s d", r=rep)  # query head h uses KV head h // rep
    vh = repeat(v, "b s g d -> b (g r) s d", r=rep)
    scores = gemm(torch.matmul, qh, kh.transpose(2, 3)) * scale  # [B, Hq, S, Sk]; fmoe.precision.gemm
    ok = _mask(S, Sk, causal, window, key_mask, q.device, segments)
    scores = scores.masked_fill(~ok, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=at_least_f32(scores.dtype)).to(q.dtype)
    else:
        sl = _local_sinks(sinks, q.shape[2])
        sink = repeat(sl, "h -> b h s 1", b=q.shape[0], s=q.shape[1]).to(scores.dtype)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(v.dtype)
    out = gemm(torch.matmul, probs, vh)  # [B, Hq, S, hd]
    return rearrange(out, "b h s d -> b s h d")
