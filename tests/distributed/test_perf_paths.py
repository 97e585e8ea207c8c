"""The fast paths: fused SwiGLU experts, ids packed into the dispatch payload, the number of
collectives per layer, ``local_slice``, ``all_reduce_coalesced`` and the GPU benchmark script's CPU dry run.

The fused expert Function (routing weight folded into the hidden activation, hand-written
backward) must give the plain autograd result of ``scale * expert(x)`` for every input, on both
matmul paths, with empty experts and with no rows at all; fp32, rtol 1e-5.
"""

import os
import sys

import pytest
import torch

import fmoe
from fmoe import P
from fmoe.ep import pack_ids, unpack_ids
from fmoe.experts import expert_mlp
from helpers import on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reference(x, counts, wgu, wd, scale):
    """Expert by expert with autograd: ``scale[n] * down(silu(gate) * up)``."""
    outs = []
    for e, xe in enumerate(x.split(counts)):
        gate, up = (xe @ wgu[e].t()).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up) @ wd[e].t())
    y = torch.cat(outs)
    return y if scale is None else y * scale.unsqueeze(-1)


@pytest.mark.parametrize("matmul", ["grouped", "loop"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [9, 0, 0, 0]])
@pytest.mark.parametrize("with_scale", [True, False])
def test_fused_swiglu_experts_match_autograd(matmul, counts, with_scale):
    g = torch.Generator().manual_seed(sum(counts) + with_scale)
    N, D, I, E = sum(counts), 8, 4, len(counts)
    x, gy = torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)
    wgu, wd = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    scale = torch.rand(N, generator=g) if with_scale else None
    results = []
    for fn in (lambda *a: expert_mlp(*a[:4], matmul=matmul, scale=a[4]), reference):
        leaves = [t.clone().requires_grad_() for t in (x, wgu, wd)] + ([scale.clone().requires_grad_()] if with_scale else [])
        y = fn(leaves[0], counts, leaves[1], leaves[2], leaves[3] if with_scale else None)
        results.append((y, torch.autograd.grad(y, leaves, gy, allow_unused=True)))
    (y, grads), (y_ref, grads_ref) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, grads_ref):
        assert a is not None  # idle experts get zeros, never None
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-5, atol=1e-6)


def test_fused_experts_under_torch_func_grad():
    g = torch.Generator().manual_seed(0)
    x, wgu, wd = torch.randn(6, 8, generator=g), torch.randn(2, 8, 8, generator=g), torch.randn(2, 8, 4, generator=g)
    f = lambda w: expert_mlp(x, [4, 2], w, wd).square().sum()  # noqa: E731
    r = lambda w: reference(x, [4, 2], w, wd, None).square().sum()  # noqa: E731
    torch.testing.assert_close(torch.func.grad(f)(wgu), torch.func.grad(r)(wgu), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("matmul", ["grouped", "loop"])
def test_fused_experts_double_backward(matmul):
    """A gradient penalty differentiates the hand-written backward once more: it must see the
    projection as a function of x and the weights (not the saved constant)."""
    g = torch.Generator().manual_seed(1)
    counts = [3, 0, 2]
    leaves0 = [torch.randn(5, 8, generator=g), torch.randn(3, 8, 8, generator=g) / 3, torch.randn(3, 8, 4, generator=g) / 3,
               torch.rand(5, generator=g)]          # O(1) activations: second derivatives stay O(1)
    outs = []
    for fn in (lambda x, wgu, wd, s: expert_mlp(x, counts, wgu, wd, matmul=matmul, scale=s),
               lambda x, wgu, wd, s: reference(x, counts, wgu, wd, s)):
        leaves = [t.clone().requires_grad_() for t in leaves0]
        grads = torch.autograd.grad(fn(*leaves).sin().sum(), leaves, create_graph=True)
        outs.append(torch.autograd.grad(sum(t.square().sum() for t in grads), leaves))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_expert_mlp_rejects_bad_scale():
    with pytest.raises(ValueError, match=r"scale must have shape \(5,\)"):
        expert_mlp(torch.randn(5, 8), [5], torch.randn(1, 8, 8), torch.randn(1, 8, 4), scale=torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_ids_survive_the_payload_bit_cast(dtype):
    ids = torch.tensor([[0, -1, 5], [127, 255, 32767], [-1, -1, 1]])
    bits = pack_ids(ids, dtype)
    assert bits.dtype == dtype
    payload = torch.cat([torch.randn(3, 4).to(dtype), bits], dim=1)   # travels as one tensor
    assert torch.equal(unpack_ids(payload[:, 4:]), ids)


def _c10d_log(calls: list):
    """A dispatch mode that appends the name of every c10d op issued while it is active to ``calls``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                calls.append(func.name())
            return func(*args, **(kwargs or {}))

    return Log()


def _count_collectives(rank, world):
    """Collectives one MoE layer issues, forward and backward, with token dispatch."""
    calls = []
    mesh = fmoe.Mesh(tp=1, ep=world)
    g = torch.Generator().manual_seed(0)
    p = {"router": torch.randn(8, 16, generator=g), "w_gate_up": torch.randn(8, 8, 16, generator=g),
         "w_down": torch.randn(8, 16, 4, generator=g)}
    p = fmoe.shard({k: v.requires_grad_() for k, v in p.items()},
                   fmoe.Plan({"router": "replicate", "w_*": "expert"}), mesh)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1 + rank)).requires_grad_()
    router = fmoe.routing.topk(3)
    y, aux = fmoe.moe(p, x, router=router, mesh=mesh, impl="all_to_all")  # warm (no counting)
    with _c10d_log(calls):
        y, aux = fmoe.moe(p, x, router=router, mesh=mesh, impl="all_to_all")
        fwd = list(calls)
        y.square().sum().backward()
    ids = router(x.detach() @ p["router"].to_local().detach().t()).expert_ids
    remote = {(t, int(e) // (8 // world)) for t in range(12) for e in ids[t]} - {(t, rank) for t in range(12)}
    return fwd, calls[len(fwd):], int(aux["dispatch_rows"]), len(remote), _split_to_checks(rank) + [_coalesced_ok(rank)]


def _coalesced_ok(rank):
    """all_reduce_coalesced == one all_reduce per tensor (mixed shapes and dtypes)."""
    import torch.distributed as dist

    from fmoe.collectives import all_reduce_coalesced

    ts = [torch.arange(6.0).view(2, 3) + rank, torch.tensor([rank], dtype=torch.int64), torch.ones(4, dtype=torch.float64)]
    want = [t.clone() for t in ts]
    for w in want:
        dist.all_reduce(w)
    got = all_reduce_coalesced(ts, dist.group.WORLD)
    unchanged = torch.equal(ts[0], torch.arange(6.0).view(2, 3) + rank)
    return unchanged and all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))


def _split_to_checks(rank):
    """local_slice: own slice forward; backward = the sum over ranks of each slice's gradient."""
    import torch.distributed as dist

    from fmoe.collectives import local_slice

    ok = []
    for sizes, dim in (([2, 1], 0), ([0, 3], 0), ([1, 2], 1)):
        x = torch.arange(3.0 * 4).view(3, 4)
        x = (x if dim == 0 else x.t().contiguous()).requires_grad_()
        y = local_slice(x, dist.group.WORLD, sizes, dim=dim)
        coef = torch.arange(y.numel(), dtype=torch.float32).view_as(y) + 10 * rank
        (y * coef).sum().backward()
        want = torch.zeros_like(x)            # what an all-reduce of the zero-padded gradients gives
        for r in range(2):
            start = sum(sizes[:r])
            c = torch.arange(x.narrow(dim, start, sizes[r]).numel(), dtype=torch.float32) + 10 * r
            want.narrow(dim, start, sizes[r]).copy_(c.view_as(x.narrow(dim, start, sizes[r])))
        ok.append(torch.equal(y, x.detach().narrow(dim, sum(sizes[:rank]), sizes[rank])) and torch.equal(x.grad, want))
    return ok


def test_token_dispatch_uses_three_collectives_forward_two_backward_and_split_to():
    """tp=1, ep=world: the expert group is the fsdp group, so the layer's statistics need no all-reduce."""
    for fwd, bwd, rows, want_rows, split_ok in on_ranks(_count_collectives, 2):
        assert fwd.count("c10d::alltoall_base_") == 3, fwd     # split sizes, payload (rows+weights+ids), combine
        assert fwd.count("c10d::allreduce_") == 0, fwd          # routing statistics ride in the split exchange
        assert bwd.count("c10d::alltoall_base_") == 2, bwd     # the two data exchanges in reverse
        assert rows == want_rows                                # distinct (token, remote rank) pairs
        assert split_ok == [True, True, True, True]            # local_slice cases, all_reduce_coalesced


def _bench_gpu(capsys, *args):
    """``benchmarks/bench_gpu.py *args``, its ``main`` in this process (its main job still starts
    ``fmoe train`` / ``fmoe memory`` as processes): ``returncode``, ``stdout``, ``stderr``."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "benchmarks", "bench_gpu.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = bench                # its dataclasses look their module up
    spec.loader.exec_module(bench)
    capsys.readouterr()
    code = bench.main(list(args))
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_bench_gpu_dry_run_and_clear_error_without_cuda(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    r = _bench_gpu(capsys, "--dry-run", "--reps", "2", "--warmup", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "fmoe.moe layer" in r.stdout and out.exists()
    if not torch.cuda.is_available():
        r = _bench_gpu(capsys, "--reps", "1")
        assert r.returncode == 2 and "CUDA is not available" in r.stderr and "--dry-run" in r.stderr


def test_split_to_validates_sizes():
    from fmoe.collectives import local_slice

    with pytest.raises(ValueError, match=r"sizes \[3\] sum to 3"):
        local_slice(torch.ones(4, 2), None, [3])


def _prefetch_checks(rank, world):
    """One layer-like function over FSDP-split weights, with and without fmoe.fsdp.unshard_layer (and
    regather_in_backward): same outputs and gradients; collectives counted per path."""
    from fmoe.fsdp import regather_in_backward

    calls = []
    mesh = fmoe.Mesh(tp=1)
    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(8, 6, generator=g), "b": torch.randn(6, 8, generator=g), "n": torch.rand(6, generator=g),
            "h": torch.randn(4, 6, generator=g).double(), "unused": torch.randn(4, 2, generator=g)}
    plan = fmoe.Plan({"a": P("fsdp", None), "b": P(None, "fsdp"), "n": P("fsdp"), "h": P("fsdp", None),
                      "unused": P("fsdp", None)})
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1 + rank))

    def layer(p):
        y = fmoe.nn.linear(fmoe.nn.rms_norm(x, p["n"]), p["a"])                       # [3, 8]
        y = fmoe.nn.linear(torch.nn.functional.silu(y), p["b"])                        # [3, 6]
        return y.sum() + fmoe.nn.linear(x.double(), p["h"]).square().sum()

    out = {}
    for mode in ("per_leaf", "prefetch"):
        params = fmoe.shard({k: v.clone().requires_grad_() for k, v in full.items()}, plan, mesh)
        leaves = [params[k] for k in ("a", "b", "n", "h")]
        del calls[:]
        with _c10d_log(calls), regather_in_backward():
            loss = layer(fmoe.fsdp.unshard_layer(params) if mode == "prefetch" else params)
            fwd = list(calls)
            grads = torch.autograd.grad(loss, leaves)
        out[mode] = (float(loss), [gr.to_local() for gr in grads], fwd, calls[len(fwd):])
    (l1, g1, f1, b1), (l2, g2, f2, b2) = out["per_leaf"], out["prefetch"]
    # the gathered weights are laid out differently (one buffer vs per-weight views), so the
    # matmuls may round differently: fp32 tolerance, not bitwise
    same = abs(l1 - l2) <= 1e-6 * abs(l1) and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(g1, g2))
    gathers = lambda c: sum("allgather" in n for n in c)  # noqa: E731
    scatters = lambda c: sum("reduce_scatter" in n for n in c)  # noqa: E731
    return same, (gathers(f1), gathers(b1), scatters(b1)), (gathers(f2), gathers(b2), scatters(b2))


def test_prefetch_gathers_a_layer_in_one_collective_per_group_and_dtype():
    """Forward: one all-gather per dtype instead of one per weight; backward: one reduce-scatter
    per dtype, one re-gather for all the saved fp32 weights (the fp64 one is not saved)."""
    for same, per_leaf, prefetched in on_ranks(_prefetch_checks, 2):
        assert same                                   # losses and gradients equal
        assert per_leaf == (4, 2, 4), per_leaf        # per weight (the two saved ones re-gathered)
        assert prefetched == (2, 1, 2), prefetched    # per dtype (fp32 a, b, n, unused; fp64 h)


def _fold_and_prefetch_on_four(rank, world):
    """tp=2, ep=4 (fsdp=2): the statistics still need no all-reduce. A tiny Qwen3-MoE on an
    FSDP plan (dense over fsdp, experts over efsdp with ep=2) gives the single-process logits
    under no_grad, with one all-gather per layer and weight group instead of one per weight."""
    from fmoe.models import qwen3_moe
    from fmoe.fsdp import data_parallel_plan

    calls = []
    mesh = fmoe.Mesh(tp=2, ep=4)
    g = torch.Generator().manual_seed(0)
    p = {"router": torch.randn(8, 16, generator=g), "w_gate_up": torch.randn(8, 8, 16, generator=g),
         "w_down": torch.randn(8, 16, 4, generator=g)}
    p = fmoe.shard({k: v.requires_grad_() for k, v in p.items()},
                   fmoe.Plan({"router": "replicate", "w_*": "expert"}), mesh)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(mesh.batch_index)).requires_grad_()
    with _c10d_log(calls):
        fmoe.moe(p, x, router=fmoe.routing.topk(2), mesh=mesh, impl="all_to_all")
    stats_reduces = calls.count("c10d::allreduce_")

    cfg = qwen3_moe.Config.tiny()
    full = qwen3_moe.init(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    want = qwen3_moe.forward(full, tokens, cfg)
    mesh2 = fmoe.Mesh(tp=1, ep=2)                                       # fsdp=4, efsdp=2
    sharded = fmoe.shard(full, data_parallel_plan(qwen3_moe.plan(cfg), full, mesh2), mesh2)
    del calls[:]
    with torch.no_grad(), _c10d_log(calls):
        got = qwen3_moe.forward(sharded, tokens, cfg, mesh2)
    gathers = sum("allgather" in c for c in calls)
    leaves = len(fmoe.tree.leaves(full))
    return stats_reduces, bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5)), gathers, leaves, cfg.num_hidden_layers


def test_stats_fold_with_tp_and_prefetch_on_a_model():
    for stats_reduces, same, gathers, leaves, layers in on_ranks(_fold_and_prefetch_on_four, 4, timeout=300):
        assert stats_reduces == 0
        assert same
        # per layer: one dense group (fsdp) and one expert group (efsdp); 3 top-level leaves
        assert gathers <= 2 * layers + 3 < leaves, (gathers, layers, leaves)
