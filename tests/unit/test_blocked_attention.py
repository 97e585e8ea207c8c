"""Attention by blocks (``fmoe.nn.blocked_attention``) against the plain attention: values and
gradients of q, k, v and sinks, causal / windowed / full, GQA, MLA head sizes, key masks, queries
in two chunks (a context-parallel rank's); the path ``fmoe.nn.attention`` takes on a long
sequence, its temporaries (no ``[S, Sk]`` tensor) and its fallback under transforms."""

from __future__ import annotations

import importlib

import pytest
import torch
from einops import rearrange
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fmoe.nn.attention import attention
from fmoe.nn.blocked_attention import Layout, blocked_attention
from fmoe.nn.segment_attention import segment_attention

from helpers import close

attn_mod = importlib.import_module("fmoe.nn.attention")    # the module (fmoe.nn.attention is also the function)

CASES = {  # name: (S, Hq, G, d, dv, causal, window, sinks, key_mask)
    "causal_gqa": (37, 4, 2, 8, 8, True, None, False, False),
    "window_mla": (37, 4, 2, 8, 6, True, 7, False, False),
    "sinks_window": (29, 4, 1, 8, 8, True, 4, True, False),
    "full": (21, 2, 2, 8, 8, False, None, False, False),
    "key_mask_window": (33, 2, 1, 8, 8, True, 9, False, True),
}


def _heads(t):
    return rearrange(t, "b s h d -> b h s d")


def _inputs(S, Hq, G, d, dv, sinks, key_mask, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, S, Hq, d, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, S, G, d, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, S, G, dv, generator=g, dtype=dtype, requires_grad=True)
    sk = torch.randn(Hq, generator=g, dtype=dtype, requires_grad=True) if sinks else None
    km = torch.rand(2, S, generator=g) > 0.3 if key_mask else None
    return q, k, v, sk, km


@pytest.mark.parametrize("case", list(CASES))
def test_blocked_equals_plain_values_and_gradients(case):
    """Blocks of 8 queries x 5 keys (many partial, skipped and masked blocks), fp32."""
    S, Hq, G, d, dv, causal, window, sinks, key_mask = CASES[case]
    q, k, v, sk, km = _inputs(S, Hq, G, d, dv, sinks, key_mask, torch.float32)
    ref = attention(q, k, v, causal=causal, window=window, sinks=sk, key_mask=km)
    lay = Layout(((0, S),), 0, causal, window, d ** -0.5, bq=8, bk=5)
    out = rearrange(blocked_attention(_heads(q), _heads(k), _heads(v), lay, sinks=sk, key_mask=km), "b h s d -> b s h d")
    ins = [t for t in (q, k, v, sk) if t is not None]
    dout = torch.randn_like(ref)
    close(out, ref)
    for a, b in zip(torch.autograd.grad(out, ins, dout), torch.autograd.grad(ref, ins, dout)):
        close(a, b)


def test_queries_in_two_chunks_see_the_whole_sequence():
    """A context-parallel rank's queries: chunks 1 and 6 of 8 (window crossing chunk boundaries),
    keys the whole sequence: the rows of the full attention at those positions, and gradients."""
    S, L = 40, 5
    q, k, v, sk, _ = _inputs(S, 4, 2, 8, 8, True, False, torch.float64)
    ref = attention(q, k, v, window=7, sinks=sk)
    rows = torch.cat([torch.arange(L, 2 * L), torch.arange(6 * L, 7 * L)])
    lay = Layout(((L, L), (6 * L, L)), 0, True, 7, 8 ** -0.5, bq=4, bk=6)
    out = blocked_attention(_heads(q[:, rows]), _heads(k), _heads(v), lay, sinks=sk)
    close(rearrange(out, "b h s d -> b s h d"), ref[:, rows])
    dout = torch.randn_like(ref[:, rows])
    g_ref = torch.autograd.grad(ref[:, rows], (q, k, v, sk), dout)
    g = torch.autograd.grad(rearrange(out, "b h s d -> b s h d"), (q, k, v, sk), dout)
    for a, b in zip(g, g_ref):
        close(a, b)


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_long_windowed_attention_takes_blocks_without_a_score_table(monkeypatch):
    """``attention`` on a windowed sequence whose scores exceed the budget takes the blocked path:
    forward and backward on fake tensors create nothing of ``S x Sk`` (the plain path does)."""
    S = 1024
    for budget, blocked in ((1 << 15, True), (1 << 40, False)):
        monkeypatch.setattr(attn_mod, "SCORE_BUDGET", budget)
        monkeypatch.setattr("fmoe.nn.blocked_attention.SCORE_BUDGET", budget)
        assert attn_mod.blocked_path(1, 2, S, S) == blocked and not attn_mod.blocked_path(1, 2, 64, 64)
        with FakeTensorMode():
            q, k = torch.empty(1, S, 2, 16, requires_grad=True), torch.empty(1, S, 1, 16, requires_grad=True)
            with _Largest() as seen:
                attention(q, k, k, window=128).sum().backward()
        assert (seen.largest < S * S) == blocked, (blocked, seen.largest)


def test_blocked_path_serves_grad_and_falls_back_under_vmap_and_jvp(monkeypatch):
    """``torch.func.grad`` runs the blocked Function; ``jvp`` and ``vmap`` take the plain path:
    each equals the plain attention."""
    q, k, v, sk, _ = _inputs(24, 2, 1, 8, 8, True, False, torch.float64)
    f = lambda q: attention(q, k, v, window=5, sinks=sk).square().sum()  # noqa: E731
    monkeypatch.setattr(attn_mod, "SCORE_BUDGET", 1 << 40)
    g_plain, plain = torch.func.grad(f)(q), attention(q, k, v, window=5, sinks=sk)
    monkeypatch.setattr(attn_mod, "SCORE_BUDGET", 64)
    assert attn_mod.blocked_path(2, 2, 24, 24)
    close(torch.func.grad(f)(q), g_plain)
    t = torch.randn_like(q)
    close(torch.func.jvp(f, (q,), (t,))[1], (g_plain * t).sum())
    per = torch.func.vmap(lambda qi, ki, vi: attention(qi[None], ki[None], vi[None], window=5, sinks=sk)[0])(q, k, v)
    close(per, plain)


@pytest.mark.parametrize("dv", [8, 6])
def test_segments_by_the_fused_kernel_equal_plain(dv):
    """``segment_attention`` (the fused CPU kernel per chunk: prefix + diagonal merged by their
    log-sum-exps) on chunks 1 and 6 of 8, GQA, MLA value size: the plain attention's rows, values
    and gradients, fp32."""
    S, L = 40, 5
    q, k, v, _, _ = _inputs(S, 4, 2, 8, dv, False, False, torch.float32)
    ref = attention(q, k, v)
    rows = torch.cat([torch.arange(L, 2 * L), torch.arange(6 * L, 7 * L)])
    out = rearrange(segment_attention(_heads(q[:, rows]), _heads(k), _heads(v), ((L, L), (6 * L, L)), 8 ** -0.5),
                    "b h s d -> b s h d")
    close(out, ref[:, rows])
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref[:, rows], (q, k, v), dout)):
        close(a, b)
