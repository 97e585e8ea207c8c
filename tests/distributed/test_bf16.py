"""bf16 compute: every expert GEMM path within bf16 error of fp32, model gradients within a bound
derived from bf16's precision, weights cast once per step on the shard (so FSDP gathers bf16), and
the oneDNN AMX kernels really run on a CPU that has them.

bf16 keeps 8 significant bits: a rounding moves a value by at most ``U = 2**-8`` of itself. The
reference of each check is the fp32 computation on the *same* bf16-rounded inputs, so the error
measured is that of the bf16 intermediates and outputs only.
"""

import os
import subprocess
import sys

import pytest
import torch

from helpers import on_ranks

import fmoe
from fmoe.experts import LocalExperts, expert_mlp, weighted_expert_sum
from fmoe.experts.ops import expert_mlp_offs, offsets

U = 2.0 ** -8                      # bf16 unit roundoff
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COUNTS = [37, 0, 300, 5, 64]       # rows per expert: an idle expert, sizes off and on the pieces
D, I, K = 64, 48, 2


def _experts(seed=0):
    """bf16-rounded inputs (as fp32 tensors): rows, routing, weights."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.5).bfloat16().float()  # noqa: E731
    a = sum(COUNTS)
    return {"x": r(a, D), "scale": torch.rand(a, generator=g).bfloat16().float(),
            "wgu": r(len(COUNTS), 2 * I, D) / D ** 0.5, "wd": r(len(COUNTS), D, I) / I ** 0.5}


def _reference(t):
    """fp32 output per sorted row and its magnitude ``sum |scale * act| |W_down|``: the first-order
    bound of a sum of terms that each carry a relative error."""
    outs, mags, start = [], [], 0
    for e, c in enumerate(COUNTS):
        x, s = t["x"][start:start + c], t["scale"][start:start + c, None]
        h = x @ t["wgu"][e].T
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:] * s
        outs.append(act @ t["wd"][e].T)
        mags.append(act.abs() @ t["wd"][e].abs().T)
        start += c
    return torch.cat(outs), torch.cat(mags)


def _run(path, t):
    """Sorted-row outputs ``[A, D]`` of one path on the tensors of ``t`` (any dtype)."""
    offs = offsets(torch.tensor(COUNTS))
    if path == "blocked":                    # each row once: row_of is the identity
        return weighted_expert_sum(t["x"], torch.arange(t["x"].shape[0]), COUNTS, t["wgu"], t["wd"], scale=t["scale"])
    if path == "traced":
        return expert_mlp_offs(t["x"], offs, t["wgu"], t["wd"], scale=t["scale"])
    return expert_mlp(t["x"], COUNTS, t["wgu"], t["wd"], matmul=path, scale=t["scale"])


@pytest.mark.parametrize("path", ["blocked", "grouped", "loop", "traced"])
def test_each_expert_path_is_within_bf16_error_of_fp32(path):
    """Per output element, the bf16 path rounds h, silu(gate), the product and the scaled
    activation (4 roundings of each term, <= 4U each, first order) and the output once (U): the
    error is at most ``5 U * sum |terms|`` (fp32 accumulation inside the GEMM adds ~1e-7).
    Independent roundings land far below that; a wrong path lands far above."""
    t = _experts()
    ref, mag = _reference(t)
    out = _run(path, {k: v.bfloat16() for k, v in t.items()})
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).abs()
    assert bool((err <= 5 * U * mag + 1e-6).all()), (path, float((err / (mag + 1e-12)).max() / U))
    rel = float(err.norm() / ref.norm())
    assert U / 64 < rel < 4 * U, (path, rel)                     # really bf16; measured 1.1 U
    fp32 = _run(path, t)                                           # the fp32 path itself: fp32 rounding
    assert torch.allclose(fp32, ref, rtol=1e-5, atol=1e-6)


def test_bf16_on_cpu_takes_the_blocked_path_at_any_size():
    """oneDNN builds an AMX kernel per GEMM shape; only the blocked path keeps to a few shapes."""
    t = _experts()
    w = {"w_gate_up": t["wgu"], "w_down": t["wd"]}
    rows = t["x"][:40]
    assert LocalExperts(w, 0, 5).path(rows, 40) != "blocked"                         # fp32, few rows
    wb = {k: v.bfloat16() for k, v in w.items()}
    assert LocalExperts(wb, 0, 5).path(rows.bfloat16(), 40) == "blocked"
    assert LocalExperts(wb, 0, 5, matmul="grouped").path(rows.bfloat16(), 40) == "grouped"


def test_blocked_bf16_gradients_within_bf16_error():
    """Backward of the blocked path in bf16 against fp32 autograd on the same rounded inputs:
    each gradient element is a sum of terms through at most ~8 roundings (the forward's 4, the
    output gradient GEMM, silu', the product, the final rounding), so its norm-wise relative
    error stays below ``8 U`` unless sums cancel; measured: 1-2 U."""
    t = _experts(1)
    row_of = torch.randint(0, 200, (sum(COUNTS),), generator=torch.Generator().manual_seed(2))
    x = t["x"][:200]
    res = {}
    for dt in (torch.float32, torch.bfloat16):
        leaves = [x.to(dt).requires_grad_(), t["scale"].to(dt).requires_grad_(), t["wgu"].to(dt).requires_grad_(),
                  t["wd"].to(dt).requires_grad_()]
        out = weighted_expert_sum(leaves[0], row_of, COUNTS, leaves[2], leaves[3], scale=leaves[1])
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).bfloat16().to(dt)
        res[dt] = torch.autograd.grad(out, leaves, dy)
    for name, a, b in zip(("x", "scale", "w_gate_up", "w_down"), res[torch.float32], res[torch.bfloat16]):
        assert b.dtype == torch.bfloat16
        rel = float((b.float() - a).norm() / a.norm())
        assert rel < 8 * U, (name, rel / U)


def test_tiny_model_gradients_bf16_vs_fp32():
    """Qwen3-MoE tiny, one process: the gradient of every leaf with bf16 compute weights
    (:func:`fmoe.training.step.compute_params`) against fp32. Each gradient is an fp32-accumulated
    sum over the 2 x 16 tokens of terms computed through S ~ 24 bf16 roundings on the longest path
    (2 layers x {attention, experts} x ~6 each, forward and back); independent roundings add in
    quadrature, ``U * sqrt(S)``, and cancellation in the token sum amplifies that by at most
    ~4 on these leaves: bound ``4 U sqrt(24) ~= 0.077``; measured 0.007-0.022."""
    from fmoe.models import qwen3_moe
    from fmoe.training.step import compute_params, forward_with_aux

    cfg = qwen3_moe.Config.tiny()
    params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(True), qwen3_moe.init(cfg, seed=0))
    tok = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    flat = fmoe.tree.flatten(params)
    out = {}
    for dtype in ("fp32", "bf16"):
        logits, _ = forward_with_aux(qwen3_moe, compute_params(params, dtype), tok[:, :-1], cfg, fmoe.Mesh())
        loss = fmoe.nn.cross_entropy(logits.float(), tok[:, 1:])
        out[dtype] = (logits.dtype, loss, torch.autograd.grad(loss, list(flat.values())))
    assert out["bf16"][0] == torch.bfloat16 and out["fp32"][0] == torch.float32
    assert abs(float(out["bf16"][1].detach() - out["fp32"][1].detach())) < 4 * U * float(out["fp32"][1].detach())
    worst = 0.0
    for path, a, b in zip(flat, out["fp32"][2], out["bf16"][2]):
        assert b.dtype == torch.float32, path                         # gradients arrive fp32
        rel = float((b - a).norm() / a.norm())
        worst = max(worst, rel)
        assert rel < 4 * U * 24 ** 0.5, (path, rel)
    assert worst > U / 8                                              # bf16 really computed
    print(f"worst relative gradient error {worst:.4f} ({worst / U:.1f} U)")


def test_step_casts_each_weight_once_and_keeps_fp32_masters():
    """One bf16 step with grad_accum=2: each master weight is read by exactly one fp32 -> bf16
    cast (not one per call or per micro-batch); masters and moments stay fp32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fmoe.models import qwen3_moe
    from fmoe.optim.adamw import init as adamw_init
    from fmoe.training.step import StepConfig, train_step

    cfg = qwen3_moe.Config.tiny()
    params = fmoe.tree.map_with_path(lambda p, t: t.requires_grad_(not p.endswith("expert_bias")),
                                     qwen3_moe.init(cfg, seed=0))
    masters = {t.untyped_storage().data_ptr(): p for p, t in fmoe.tree.flatten(params).items()}
    casts = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
                ptr = args[0].untyped_storage().data_ptr()
                if ptr in masters:
                    casts.append(masters[ptr])
            return out

    tok = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    with Casts():
        new, state, m = train_step(qwen3_moe, cfg, params, adamw_init(params), (tok[:, :-1], tok[:, 1:]),
                                   mesh=fmoe.Mesh(), step_cfg=StepConfig(dtype="bf16", grad_accum=2), lr=1e-3)
    weights = sorted(p for p in masters.values() if p.split(".")[-1].startswith(("w", "embed", "lm_head", "router")))
    assert weights and sorted(c for c in casts if c in weights) == weights      # each exactly once
    assert len(casts) == len(set(casts))
    assert {str(t.dtype) for t in fmoe.tree.leaves((new, state["m"], state["v"]))} == {"torch.float32"}
    assert m["loss"] == m["loss"] and not m["skipped"]


def _gather_bytes(rank, world, dtype):
    """Bytes and dtypes of every all-gather payload of one forward + backward on fsdp=2, and the
    gathered gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fmoe.fsdp import data_parallel_plan
    from fmoe.models import qwen3_moe
    from fmoe.training.step import compute_params, forward_with_aux

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d" and "gather" in func.name():
                ts = [a for a in fmoe.tree.leaves(list(args)) if isinstance(a, torch.Tensor)]
                seen.append((func.name(), ts[-1].dtype, ts[-1].nbytes))
            return func(*args, **(kwargs or {}))

    mesh = fmoe.Mesh(tp=1, ep=2)                                   # fsdp = 2 over the dense weights
    cfg = qwen3_moe.Config.tiny()
    # routers 8x the init's scale: top-k gaps wide enough that bf16 rounding (or, on a CPU without native
    # bf16, fp32 GEMMs summed in the mesh's order) picks the experts fp32 picks; a flipped token would
    # change its layer's gradients by ~10% and say nothing about the gathers
    full = fmoe.tree.map_with_path(lambda p, t: (t * 8 if p.endswith("router") else t).detach().requires_grad_(True),
                                   qwen3_moe.init(cfg, seed=0))
    params = fmoe.shard(full, data_parallel_plan(qwen3_moe.check_plan(cfg, None, 1), full, mesh), mesh)
    tok = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
    with Log():
        logits, _ = forward_with_aux(qwen3_moe, compute_params(params, dtype), tok[:, :-1], cfg, mesh)
    loss = fmoe.nn.cross_entropy(logits.float(), tok[:, 1:])
    flat = fmoe.tree.flatten(params)
    grads = dict(zip(flat, torch.autograd.grad(loss, list(flat.values()))))
    same = all(type(g) is type(flat[p]) and g.dtype == torch.float32 for p, g in grads.items())
    return seen, same, {k: v.detach() for k, v in fmoe.tree.flatten(fmoe.gather(grads)).items()}


def test_fsdp_gathers_bf16_weights_half_the_bytes():
    r32 = on_ranks(_gather_bytes, 2, "fp32", timeout=300)[0]
    r16 = on_ranks(_gather_bytes, 2, "bf16", timeout=300)[0]
    assert r32[0] and len(r16[0]) == len(r32[0])
    assert {d for _, d, _ in r16[0]} == {torch.bfloat16} and {d for _, d, _ in r32[0]} == {torch.float32}
    assert sum(b for *_, b in r16[0]) * 2 == sum(b for *_, b in r32[0])
    assert r16[1] and r32[1]                                       # fp32 gradients, DTensors like the masters
    for k, a in r32[2].items():
        assert float((r16[2][k] - a).norm() / a.norm()) < 4 * U * 24 ** 0.5, k   # as in one process


def _cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _cpu_has_amx_bf16(), reason="this CPU has no AMX bf16 tiles")
def test_bf16_expert_gemms_run_onednn_amx_kernels():
    """With ``ONEDNN_VERBOSE=1`` oneDNN names each primitive it runs: the bf16 blocked experts,
    forward and backward, run ``brg_matmul`` with an AMX implementation (seen on this machine:
    ``brg_matmul:avx10_1_512_amx``), and never a reference or non-AMX bf16 GEMM."""
    code = ("import torch; from fmoe.experts import weighted_expert_sum as f\n"
            "x = torch.randn(300, 64, dtype=torch.bfloat16, requires_grad=True)\n"
            "w1 = torch.randn(2, 96, 64, dtype=torch.bfloat16, requires_grad=True)\n"
            "w2 = torch.randn(2, 64, 48, dtype=torch.bfloat16, requires_grad=True)\n"
            "f(x, torch.arange(300), [100, 200], w1, w2).sum().backward()\n")
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = [line for line in out.stdout.splitlines() if ",exec," in line and ",matmul," in line]
    impls = {line.split(",")[6] for line in runs}
    assert runs and all("amx" in i for i in impls), impls
    assert len(runs) >= 6                                          # 2 experts x (2 forward + 4 backward) GEMMs, at least
