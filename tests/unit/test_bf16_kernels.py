"""The bf16 fast path on CPU, checked by its results and by what it runs (op counts, never times).

- The grouped operators' bf16 kernels (:mod:`fmoe.experts.buckets`) pad each group to a bucket
  size by reading the rows after it instead of copying it: the same numbers as a GEMM on a
  zero-padded copy of each group (bitwise: the GEMM has the same shape), and no per-group copy.
- On a CPU without native bf16 (forced here by replacing torch's capability checks) every GEMM of
  bf16 operands runs as an fp32 GEMM of the same bf16 values (:func:`fmoe.precision.native_bf16`).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fmoe.experts import buckets
from fmoe.experts.buckets import bucket

COUNTS = [37, 0, 300, 5, 64, 0, 3]     # an idle expert, sizes on and off the buckets, a small last group
PAD_ROWS = 7                            # rows after the last group (unused slots)


class Ops(TorchDispatchMode):
    """Counts the ATen operators run inside the block, by name (``mm``, ``copy_``, ...)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _bounds():
    b = [0]
    for c in COUNTS:
        b.append(b[-1] + c)
    return b


def _zero_padded(t):
    rows = bucket(t.shape[0])
    return torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])])


def test_grouped_mm_bf16_equals_gemms_on_zero_padded_groups():
    g = torch.Generator().manual_seed(0)
    b = _bounds()
    x = torch.randn(b[-1] + PAD_ROWS, 32, generator=g).bfloat16()
    x[b[-1]:] = float("nan")                       # unused rows: never read into a used row's result
    wt = torch.randn(len(COUNTS), 32, 24, generator=g).bfloat16()
    out = buckets.grouped_mm(x, wt, b)
    for e, (s, t) in enumerate(zip(b[:-1], b[1:])):
        if t > s:
            assert torch.equal(out[s:t], (_zero_padded(x[s:t]) @ wt[e])[:t - s]), e
    assert out.shape == (x.shape[0], 24) and torch.equal(out[b[-1]:], torch.zeros(PAD_ROWS, 24, dtype=out.dtype))


@pytest.mark.parametrize("narrow", ["a", "b"])
def test_grouped_wgrad_bf16_equals_gemms_on_zero_padded_groups(narrow):
    g = torch.Generator().manual_seed(1)
    b = _bounds()
    ka, kb = (16, 40) if narrow == "a" else (40, 16)
    a = torch.randn(b[-1] + PAD_ROWS, ka, generator=g).bfloat16()
    bb = torch.randn(b[-1] + PAD_ROWS, kb, generator=g).bfloat16()
    out = buckets.grouped_wgrad(a, bb, b)
    assert out.shape == (len(COUNTS), ka, kb)
    for e, (s, t) in enumerate(zip(b[:-1], b[1:])):
        ref = _zero_padded(a[s:t]).t() @ _zero_padded(bb[s:t]) if t > s else torch.zeros(ka, kb, dtype=a.dtype)
        assert torch.equal(out[e], ref), e


def test_grouped_kernels_copy_no_group_but_the_last():
    """What the kernels run: one GEMM per non-empty group; ``grouped_mm`` copies only the last
    group (its bucket runs past the rows), ``grouped_wgrad`` one operand's rows once (into one
    reused buffer) plus that last group; no index gather, no per-group zero-filled allocation."""
    b = _bounds()
    used = sum(1 for c in COUNTS if c)
    x = torch.randn(b[-1], 32).bfloat16()
    wt = torch.randn(len(COUNTS), 32, 24).bfloat16()
    with Ops() as ops:
        buckets.grouped_mm(x, wt, b)
    assert ops.counts.get("mm") == used
    assert ops.counts.get("copy_", 0) == ops.counts.get("new_zeros", 0) == 1, ops.counts   # the last group's padded copy
    assert not {"index_select", "index_copy_", "zeros", "cat"} & set(ops.counts), ops.counts
    with Ops() as ops:
        buckets.grouped_wgrad(torch.randn(b[-1], 16).bfloat16(), x, b)
    assert ops.counts.get("mm") == used
    assert ops.counts.get("copy_", 0) == used + 1, ops.counts     # each group's narrow rows once + the last group
    assert ops.counts.get("new_zeros", 0) == 1, ops.counts         # the last group's padded copy
    assert not {"index_select", "index_copy_", "zeros", "cat"} & set(ops.counts), ops.counts
