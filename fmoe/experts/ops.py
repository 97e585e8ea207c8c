"""Grouped expert GEMMs as torch operators that every transform understands.

The experts' matmuls multiply each group of rows (the rows routed to one expert, grouped by a
sort) by that group's weight matrix. Two PyTorch operators carry them:

=========================  =====================================  ==========================
operator                   math, for the rows of group ``g``      shapes
=========================  =====================================  ==========================
``fmoe::grouped_mm``       ``out_g = x_g @ w[g].T`` (``trans``)   ``x [N, k]`` -> ``[N, n]``
                           or ``x_g @ w[g]``
``fmoe::grouped_wgrad``    ``out[g] = a_g.T @ b_g``               ``[G, na, nb]``
=========================  =====================================  ==========================

Groups are given by ``offs [G]`` (int32, the cumulative row counts, ``offs[-1] == N``), a
tensor: no host sync is needed to call them, so ``torch.compile`` traces a layer through them
with ``fullgraph=True``. Each is a ``torch.library`` operator with

- a CPU/CUDA kernel (``CompositeExplicitAutograd``): ``torch._grouped_mm`` where it applies
  (``matmul="grouped"``, aligned shapes, bf16 on CUDA), else one ``torch.mm`` per group
  (``matmul="loop"``, and bf16 / fp16 on CPU, each group's rows padded to a bucket size,
  :mod:`fmoe.experts.buckets`: torch's CPU ``_grouped_mm`` made that step 2x slower; on a CPU
  without native bf16 fp32 GEMMs of the bf16 values, :func:`fmoe.precision.gemm_dtype`; the kernel
  reads the group sizes on the host, invisible to the compiler because the operator is opaque: the
  kernels and the autograd kernels below are marked ``torch.compiler.disable``, so Dynamo never traces
  their bodies, not even from a frame of an eager fallback, where a rank's rows would pick the path
  and aligned fp32 rows would reach ``torch._grouped_mm``'s bf16-only meta rule: issue 46);
- a fake (meta) rule for any float dtype (``torch._grouped_mm``'s own rule accepts bf16 only);
- a vmap rule that folds the batch into the groups (``B`` batches of ``G`` groups are ``B * G``
  groups over ``B * N`` rows): one call, whatever is batched (stacked models, token batches);
- a FLOP formula for ``torch.utils.flop_counter.FlopCounterMode`` (``2 N k n``);
- its own autograd kernel (``Autograd`` key): a single-level autograd Function with a backward
  made of the same two operators (so double backward and ``hessian`` work) and a ``jvp`` (the
  product rule: both are bilinear).

Because the derivative rules live *on the operator* (like an ATen operator's), every transform
and every nesting of them sees one grouped operator: ``.backward()``, ``torch.func.grad`` /
``vjp`` / ``jvp`` / ``vmap`` / ``hessian``, ``torch.compile`` of a function, and
``torch.compile`` of a ``torch.func`` transform (Dynamo puts the opaque operator in its graph
and AOTAutograd differentiates it through the autograd kernel). The compiled graph holds
``fmoe.grouped_mm`` / ``fmoe.grouped_wgrad`` calls with the grouped FLOP count, never one
matmul per group (``tests/distributed/test_compile.py`` counts them). ``torch.library``'s own
``register_autograd`` is not used: its generated Function is refused under ``torch.func``
(pytorch issue 170834); the single-level Function is the pattern functorch uses internally.

Example:
    >>> x, w = torch.randn(5, 4), torch.randn(2, 3, 4)
    >>> offs = torch.tensor([2, 5], dtype=torch.int32)
    >>> y = grouped_mm(x, w, offs)                                 # [5, 3]
    >>> torch.allclose(y[:2], x[:2] @ w[0].T) and torch.allclose(y[2:], x[2:] @ w[1].T)
    True
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from torch.autograd.function import _SingleLevelFunction
from torch.utils.flop_counter import register_flop_formula

from ..precision import gemm_dtype
from . import buckets
from .buckets import bucketed

__all__ = ["grouped_mm", "grouped_wgrad", "offsets", "expert_mlp_offs", "check_matmul", "MATMULS"]

MATMULS = ("auto", "grouped", "loop")


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """Cumulative group ends ``offs [G]`` (int32) from per-group row counts ``[G]``; no host sync.

    Example:
        >>> offsets(torch.tensor([2, 0, 3])).tolist()
        [2, 2, 5]
    """
    return counts.cumsum(-1).to(torch.int32)


def _aligned(*ts: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs 16-byte aligned strides, one dtype, and bf16 on CUDA (bf16 /
    fp16 on CPU take the bucketed loop)."""
    t0 = ts[0]
    if not hasattr(torch, "_grouped_mm") or any(t.dtype != t0.dtype for t in ts) or bucketed(t0):
        return False
    if t0.dtype not in (torch.float32, torch.bfloat16, torch.float16) or (t0.is_cuda and t0.dtype != torch.bfloat16):
        return False
    align = 16 // t0.element_size()
    return all(s % align == 0 for t in ts for s in t.shape[-2:])


def _bounds(offs: torch.Tensor) -> list[int]:
    return [0] + [int(o) for o in offs.tolist()]


torch.library.define("fmoe::grouped_mm", "(Tensor x, Tensor w, Tensor offs, bool trans, str matmul) -> Tensor")
torch.library.define("fmoe::grouped_wgrad", "(Tensor a, Tensor b, Tensor offs, str matmul) -> Tensor")


@torch.compiler.disable
def _grouped_mm_kernel(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, trans: bool, matmul: str) -> torch.Tensor:
    if gemm_dtype(x) != x.dtype:                  # bf16 on a CPU without native bf16: fp32 GEMMs, same values
        return _grouped_mm_kernel(x.to(gemm_dtype(x)), w.to(gemm_dtype(x)), offs, trans, matmul).to(x.dtype)
    wt = w.transpose(1, 2) if trans else w                                      # [G, k, n]
    if matmul != "loop" and x.shape[0] and _aligned(x, wt):   # row- or column-major operands (an expanded
        # grad has strides 0; so has an empty one, which torch._grouped_mm refuses: no rows take the loop)
        wt = w.contiguous().transpose(1, 2) if trans else w.contiguous()
        return torch._grouped_mm(x.contiguous(), wt, offs=offs)
    b = _bounds(offs)
    if bucketed(x):                                                             # bf16 on CPU: bucket-padded rows
        return buckets.grouped_mm(x, wt, b)
    out = x.new_empty((x.shape[0], wt.shape[2]))                               # every group's rows written below
    for g in range(w.shape[0]):
        if b[g + 1] > b[g]:
            torch.mm(x[b[g]:b[g + 1]], wt[g], out=out[b[g]:b[g + 1]])
    out[b[-1]:].zero_()                                                         # rows after the last group
    return out


torch.library.impl("fmoe::grouped_mm", "CompositeExplicitAutograd")(_grouped_mm_kernel)


@torch.library.register_fake("fmoe::grouped_mm")
def _(x, w, offs, trans, matmul):
    return x.new_empty((x.shape[0], w.shape[1] if trans else w.shape[2]))


@torch.compiler.disable
def _grouped_wgrad_kernel(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, matmul: str) -> torch.Tensor:
    if gemm_dtype(a) != a.dtype:                  # bf16 on a CPU without native bf16: fp32 GEMMs, same values
        return _grouped_wgrad_kernel(a.to(gemm_dtype(a)), b.to(gemm_dtype(a)), offs, matmul).to(a.dtype)
    if matmul != "loop" and a.shape[0] and _aligned(a, b):                      # row-major operands (an
        return torch._grouped_mm(a.contiguous().t(), b.contiguous(), offs=offs)  # expanded grad has strides 0)
    e = _bounds(offs)
    if bucketed(a):                                                             # bf16 on CPU: bucket-padded rows
        return buckets.grouped_wgrad(a, b, e)
    out = a.new_zeros((offs.shape[0], a.shape[1], b.shape[1]))
    for g in range(offs.shape[0]):
        if e[g + 1] > e[g]:
            torch.mm(a[e[g]:e[g + 1]].t(), b[e[g]:e[g + 1]], out=out[g])
    return out


torch.library.impl("fmoe::grouped_wgrad", "CompositeExplicitAutograd")(_grouped_wgrad_kernel)


@torch.library.register_fake("fmoe::grouped_wgrad")
def _(a, b, offs, matmul):
    return a.new_empty((offs.shape[0], a.shape[1], b.shape[1]))


def _batched(t: torch.Tensor, d: Optional[int], n: int) -> torch.Tensor:
    """``t`` with its batch dim first (expanded to ``n`` when it has none)."""
    return t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand(n, *t.shape)


def _folded_offs(offs: torch.Tensor, d: Optional[int], n: int, rows: int) -> torch.Tensor:
    """Offsets of ``n`` batches of groups over ``n * rows`` rows: batch b's groups shifted by ``b * rows``."""
    o = _batched(offs, d, n)                                                    # [B, G]
    shift = torch.arange(n, device=o.device, dtype=o.dtype).unsqueeze(1) * rows
    return (o + shift).reshape(-1)


@torch.library.register_vmap("fmoe::grouped_mm")
def _(info, in_dims, x, w, offs, trans, matmul):
    n = info.batch_size
    xb, wb = _batched(x, in_dims[0], n), _batched(w, in_dims[1], n)            # [B, N, k], [B, G, ., .]
    out = torch.ops.fmoe.grouped_mm(xb.reshape(-1, xb.shape[-1]), wb.reshape(-1, *wb.shape[2:]),
                                    _folded_offs(offs, in_dims[2], n, xb.shape[1]), trans, matmul)
    return out.reshape(n, xb.shape[1], -1), 0


@torch.library.register_vmap("fmoe::grouped_wgrad")
def _(info, in_dims, a, b, offs, matmul):
    n = info.batch_size
    ab, bb = _batched(a, in_dims[0], n), _batched(b, in_dims[1], n)            # [B, N, na], [B, N, nb]
    out = torch.ops.fmoe.grouped_wgrad(ab.reshape(-1, ab.shape[-1]), bb.reshape(-1, bb.shape[-1]),
                                       _folded_offs(offs, in_dims[2], n, ab.shape[1]), matmul)
    return out.reshape(n, -1, *out.shape[1:]), 0


@register_flop_formula(torch.ops.fmoe.grouped_mm)
def _(x_shape, w_shape, *args, **kwargs) -> int:
    """FLOPs of one grouped GEMM: every row meets one ``[k, n]`` matrix (``2 N k n``)."""
    return 2 * x_shape[0] * w_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.fmoe.grouped_wgrad)
def _(a_shape, b_shape, *args, **kwargs) -> int:
    """FLOPs of the grouped weight gradient: ``2 N na nb``."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


@contextlib.contextmanager
def _below_autograd():
    """Run an operator's kernel below the autograd key, with grad mode (both directions) back
    on: the single-level Function turns it off, but an outer ``torch.func`` level (``hessian``,
    ``grad(grad(f))``, ``jacfwd(jacrev(f))``) still records the call (as an ATen kernel would)."""
    with torch.enable_grad(), _set_fwd_grad_enabled(True), torch._C._AutoDispatchBelowAutograd():
        yield


class _GroupedMM(_SingleLevelFunction):
    """Autograd of ``fmoe::grouped_mm``: backward and jvp by the product rule, in the operators."""

    @staticmethod
    def forward(x, w, offs, trans, matmul):
        with _below_autograd():
            return torch.ops.fmoe.grouped_mm(x, w, offs, trans, matmul)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, offs, ctx.trans, ctx.matmul = inputs
        ctx.save_for_backward(x, w, offs)
        ctx.save_for_forward(x, w, offs)

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:            # x w^T -> g w ; x w -> g w^T
            gx = torch.ops.fmoe.grouped_mm(g, w, offs, not ctx.trans, ctx.matmul)
        if ctx.needs_input_grad[1]:            # [G, n, k] = g_g^T x_g ; [G, k, n] = x_g^T g_g
            gw = torch.ops.fmoe.grouped_wgrad(*((g, x) if ctx.trans else (x, g)), offs, ctx.matmul)
        return gx, gw, None, None, None

    @staticmethod
    def jvp(ctx, dx, dw, _doffs, _dtrans, _dmatmul):
        x, w, offs = ctx.saved_tensors
        terms = [torch.ops.fmoe.grouped_mm(*xw, offs, ctx.trans, ctx.matmul)
                 for xw, d in (((dx, w), dx), ((x, dw), dw)) if d is not None]
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]


class _GroupedWGrad(_SingleLevelFunction):
    """Autograd of ``fmoe::grouped_wgrad`` (``out[g] = a_g^T b_g``): backward and jvp by the product rule."""

    @staticmethod
    def forward(a, b, offs, matmul):
        with _below_autograd():
            return torch.ops.fmoe.grouped_wgrad(a, b, offs, matmul)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, offs, ctx.matmul = inputs
        ctx.save_for_backward(a, b, offs)
        ctx.save_for_forward(a, b, offs)

    @staticmethod
    def backward(ctx, g):                      # g [G, na, nb]
        a, b, offs = ctx.saved_tensors
        ga = torch.ops.fmoe.grouped_mm(b, g, offs, True, ctx.matmul) if ctx.needs_input_grad[0] else None   # b_g g^T
        gb = torch.ops.fmoe.grouped_mm(a, g, offs, False, ctx.matmul) if ctx.needs_input_grad[1] else None  # a_g g
        return ga, gb, None, None

    @staticmethod
    def jvp(ctx, da, db, _doffs, _dmatmul):
        a, b, offs = ctx.saved_tensors
        terms = [torch.ops.fmoe.grouped_wgrad(*ab, offs, ctx.matmul)
                 for ab, d in (((da, b), da), ((a, db), db)) if d is not None]
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]


@torch.library.impl("fmoe::grouped_mm", "Autograd")
@torch.compiler.disable
def _(x, w, offs, trans, matmul):
    with enable_single_level_autograd_function():
        return _GroupedMM.apply(x, w, offs, trans, matmul)


@torch.library.impl("fmoe::grouped_wgrad", "Autograd")
@torch.compiler.disable
def _(a, b, offs, matmul):
    with enable_single_level_autograd_function():
        return _GroupedWGrad.apply(a, b, offs, matmul)


def check_matmul(fn: str, name: str, value: object) -> None:
    """ValueError naming ``fn``'s argument ``name`` unless ``value`` is an expert matmul path."""
    if value not in MATMULS:
        raise ValueError(f"{fn}: {name} must be 'auto', 'grouped' or 'loop', got {value!r}")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, trans: bool = True,
               matmul: str = "auto") -> torch.Tensor:
    """Rows of group ``g`` times ``w[g].T`` (``trans``) or ``w[g]``; differentiable under every
    transform (``fmoe::grouped_mm``).

    Args:
        x: ``[N, k]`` rows sorted by group.
        w: ``[G, n, k]`` (``trans``) or ``[G, k, n]``.
        offs: ``[G]`` int32 cumulative row counts (:func:`offsets`), ``offs[-1] == N``.
        trans: multiply by the transposed group matrices (the layout of expert weights).
        matmul: ``"grouped"``/``"auto"`` (``torch._grouped_mm`` where it applies) or ``"loop"``.
    Returns:
        ``[N, n]``.
    """
    check_matmul("grouped_mm", "matmul", matmul)
    return torch.ops.fmoe.grouped_mm(x, w, offs, trans, matmul)


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, matmul: str = "auto") -> torch.Tensor:
    """Per-group ``a_g^T @ b_g`` (a weight gradient), ``[G, na, nb]``; zeros for an empty group
    (``fmoe::grouped_wgrad``).

    Args:
        a: ``[N, na]``; b: ``[N, nb]``; rows sorted by group.
        offs: ``[G]`` int32 cumulative row counts.
        matmul: as in :func:`grouped_mm`.
    Returns:
        ``[G, na, nb]``.

    Example:
        >>> grouped_wgrad(torch.ones(3, 2), torch.ones(3, 4), torch.tensor([1, 3], dtype=torch.int32))[1]
        tensor([[2., 2., 2., 2.],
                [2., 2., 2., 2.]])
    """
    check_matmul("grouped_wgrad", "matmul", matmul)
    return torch.ops.fmoe.grouped_wgrad(a, b, offs, matmul)


def expert_mlp_offs(x: torch.Tensor, offs: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    b_gate_up: Optional[torch.Tensor] = None, b_down: Optional[torch.Tensor] = None,
                    act=None, scale: Optional[torch.Tensor] = None, matmul: str = "auto",
                    valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each expert's MLP on its group of rows, groups given by ``offs`` (no host sync): the
    expert path fmoe takes under ``torch.func`` transforms and ``torch.compile``.

    Args:
        x: ``[N, D]`` rows sorted by expert; offs: ``[E]`` int32 group ends (:func:`offsets`).
        w_gate_up: ``[E, 2I, D]`` (gate rows first); w_down: ``[E, D, I]``.
        b_gate_up, b_down: optional ``[E, 2I]``, ``[E, D]`` biases.
        act: ``act(gate, up)``; None: SwiGLU.
        scale: optional ``[N]`` row weights, applied to the hidden activation.
        matmul: as in :func:`grouped_mm`.
        valid: optional ``[N]`` bool, False for the rows after the last group (``offs[-1] < N``):
            the operators compute nothing there and leave those rows unwritten, so they are
            masked to zero going in and coming out (and their gradients with them).
    Returns:
        ``[N, D]``.

    Example:
        >>> x, wgu, wd = torch.randn(3, 4), torch.randn(2, 6, 4), torch.randn(2, 4, 3)
        >>> expert_mlp_offs(x, torch.tensor([1, 3], dtype=torch.int32), wgu, wd).shape
        torch.Size([3, 4])
    """
    keep = None if valid is None else valid.unsqueeze(-1)                          # [N, 1]
    if keep is not None:
        x = torch.where(keep, x, 0)
    h = grouped_mm(x, w_gate_up, offs, matmul=matmul)                              # [N, 2I]
    if b_gate_up is not None or b_down is not None:                                # rows after the last group: masked
        group = torch.searchsorted(offs, torch.arange(x.shape[0], device=x.device, dtype=offs.dtype),
                                   right=True).clamp(max=offs.shape[0] - 1)
    if b_gate_up is not None:
        h = h + b_gate_up.index_select(0, group)
    if keep is not None:
        h = torch.where(keep, h, 0)
    gate, up = h.chunk(2, dim=-1)                                               # [N, I] each
    a = torch.nn.functional.silu(gate) * up if act is None else act(gate, up)
    if scale is not None:
        a = a * scale.unsqueeze(-1)
    out = grouped_mm(a, w_down, offs, matmul=matmul)                                # [N, D]
    if b_down is not None:
        out = out + (b_down.index_select(0, group) if scale is None else
                     b_down.index_select(0, group) * scale.unsqueeze(-1))
    return out if keep is None else torch.where(keep, out, 0)
