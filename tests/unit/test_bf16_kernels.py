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

import fmoe
from fmoe.experts import buckets, ops as expert_ops
from fmoe.experts.buckets import bucket
from fmoe.fsdp import cast_shards
from fmoe.models import qwen3_moe

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
    pad = 20                                                  # the last group's bucket (16 rows) fits before the end
    a = torch.randn(b[-1] + pad, ka, generator=g).bfloat16()
    bb = torch.randn(b[-1] + pad, kb, generator=g).bfloat16()
    a[b[-1]:], bb[b[-1]:] = float("nan"), float("inf")       # rows of no group: never summed in
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


GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_grouped_mm", "linear", "matmul"}


class GemmDtypes(TorchDispatchMode):
    """The dtypes of the tensor operands of every GEMM run inside the block."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in GEMMS:
            self.seen.append((func.overloadpacket.__name__,
                              {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_native_bf16(monkeypatch):
    """This process sees a CPU without native bf16 (an AVX2 machine): torch's capability and
    its avx512_bf16 / AMX checks replaced."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not fmoe.precision.native_bf16()


def _bf16_step(seed=0):
    """Loss and fp32 master gradients of qwen3_moe tiny on bf16 compute copies (eager: the
    blocked expert path), and the GEMMs it ran."""
    cfg = qwen3_moe.Config.tiny()
    params = fmoe.tree.map_with_path(lambda p, t: t.requires_grad_(not p.endswith("expert_bias")),
                                     qwen3_moe.init(cfg, seed=seed))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    with GemmDtypes() as gemms:
        logits = qwen3_moe.forward(cast_shards(params, torch.bfloat16, skip=("**.expert_bias",)), tokens, cfg)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
    grads = {p: t.grad for p, t in fmoe.tree.flatten(params).items() if t.grad is not None}
    return loss.detach(), grads, gemms.seen


def test_without_native_bf16_every_gemm_of_a_bf16_step_runs_in_fp32(no_native_bf16):
    _, _, seen = _bf16_step()
    assert {name for name, _ in seen} >= {"mm"}, seen
    bf16 = [(name, d) for name, d in seen if torch.bfloat16 in d]
    assert not bf16, f"{len(bf16)} of {len(seen)} GEMMs ran on bf16 operands: {bf16[:5]}"


@pytest.mark.skipif(not fmoe.precision.native_bf16(), reason="this CPU has no native bf16 (avx512_bf16 / AMX)")
def test_with_native_bf16_the_gemms_run_in_bf16():
    _, _, seen = _bf16_step()
    assert all(d == {torch.bfloat16} for _, d in seen), [s for s in seen if s[1] != {torch.bfloat16}][:5]


def test_fp32_gemms_of_bf16_values_match_the_bf16_step(monkeypatch):
    """Emulated and native bf16 steps agree to bf16 rounding: the products are exact in fp32 in
    both, only the order of the fp32 sums and the GEMM output's rounding may differ."""
    loss, grads, _ = _bf16_step()
    with monkeypatch.context() as m:
        m.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
        m.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
        m.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        loss_e, grads_e, _ = _bf16_step()
    u = 2.0 ** -8                                  # bf16 unit roundoff
    torch.testing.assert_close(loss_e, loss, rtol=4 * u, atol=0)
    assert grads.keys() == grads_e.keys()
    for p in grads:                                # a few roundings of the largest gradient entry
        scale = grads[p].abs().max().item()
        torch.testing.assert_close(grads_e[p], grads[p], rtol=0, atol=16 * u * scale, msg=p)


def test_grouped_operators_run_fp32_gemms_without_native_bf16(no_native_bf16):
    """The compiled / transformed path's kernels (``fmoe::grouped_mm`` / ``grouped_wgrad``)."""
    b = _bounds()
    x, w = torch.randn(b[-1], 32).bfloat16(), torch.randn(len(COUNTS), 24, 32).bfloat16()
    offs = torch.tensor(b[1:], dtype=torch.int32)
    with GemmDtypes() as gemms:
        y = expert_ops._grouped_mm_kernel(x, w, offs, True, "auto")
        dw = expert_ops._grouped_wgrad_kernel(torch.randn(b[-1], 24).bfloat16(), x, offs, "auto")
    assert y.dtype == dw.dtype == torch.bfloat16 and gemms.seen
    assert all(d == {torch.float32} for _, d in gemms.seen), gemms.seen
    ref = torch.cat([x[s:t].float() @ w[e].float().t() for e, (s, t) in enumerate(zip(b[:-1], b[1:]))])
    assert torch.equal(y, ref.bfloat16())           # fp32 GEMMs of the bf16 values, rounded once
