"""The MoE layer alone, forward + backward, across ranks and top-k: fmoe against transformers'
expert-parallel implementations on the same weights and tokens, with the bytes and rows each
one moves and fmoe's expert compute as a fraction of the machine's matmul rate.

Per rank: ``T`` tokens of width ``D`` (each rank its own batch, like FSDP data parallelism),
``E`` SwiGLU experts of hidden size ``I``, top-``K`` softmax routing (renormalised). The layer is

- **fmoe**: ``fmoe.moe(params, x, router=fmoe.routing.topk(K), mesh=mesh, impl=...)``;
- **transformers**: its ``Qwen3MoeTopKRouter`` then, on ranks, its ``AllToAllEP`` /
  ``AllReduceEP`` (``transformers.distributed.expert_parallel``) around a ``Qwen3MoeExperts``
  holding this rank's experts (``grouped_mm`` experts implementation), exactly what
  ``from_pretrained(..., distributed_config=DistributedConfig(ep_size=...))`` installs; in one
  process its ``Qwen3MoeSparseMoeBlock``.

Timing: the implementations alternate step by step (order rotated), each step between barriers;
``ms`` is the median step time (slowest rank), ``x hf`` the median of the per-step ratios to
transformers' same implementation, ``cpu ms`` the median CPU time summed over ranks.

Layouts: ``single`` (1 process), ``ep`` (``tp=1, ep=world``: every rank its own batch; token
dispatch) and ``shared`` (``tp=ep=world``: the group shares one batch, where ``all_reduce``
applies; token dispatch slices the rows over tp). Every row is checked for parity first: fmoe's
output and the gradients of x, the router and the local experts equal transformers' (rtol 1e-5).

Bytes are counted by a ``TorchDispatchMode`` that sees every collective either library issues,
forward and backward: all-to-all bytes and rows sent to *other* ranks, ring-algorithm bytes for
all-reduce (``2 (n-1)/n`` of the tensor), all-gather and reduce-scatter (``(n-1)/n``).

Expert compute: what the layer runs on this rank's received assignments, fwd + bwd, alone
(``fmoe.experts.LocalExperts.weighted_sum``: gather, GEMMs, SwiGLU, routing weight, scatter-add; on
CPU the blocked path from 256 rows per expert on, the whole-tensor grouped path below), timed in the same run as ``torch.mm`` doing the
same FLOPs as one GEMM (``[A, D] x [D, 3I]`` three times, the fwd + bwd count): the ratio is the
fraction of the machine's matmul rate that the expert work reaches.

``--dtype bf16``: weights, tokens and output gradients in bf16 for both libraries (GEMMs in bf16
with fp32 accumulation); parity is then norm-wise within ``8 * 2**-8`` (bf16 rounding in two
different op orders), and the expert-compute ceiling is ``torch.mm`` in bf16 too.

    python benchmarks/bench_dispatch.py [--worlds 1 2 4] [--k 2 4 8] [--tokens 1024] [--steps 8] [--dtype bf16]

Prints a table and writes benchmarks/out/dispatch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import fmoe
from fmoe.precision import DTYPES

D, I, E = 256, 256, 32


# ----------------------------------------------------------------------------- counting
def _collective_bytes(func, args) -> tuple[int, int]:
    """(bytes this rank sends to other ranks, rows sent) for one collective op call."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = func.name()
    def unbox(a):
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a)
        return a

    args = [unbox(a) for a in args]
    if name == "c10d::alltoall_base_":
        out, inp, pg, out_s, in_s = args[:5]
        me, n = pg.rank(), pg.size()
    elif name == "_c10d_functional::all_to_all_single":
        inp, out_s, in_s, group_name = args[:4]
        pg = _resolve_process_group(group_name)
        me, n = dist.get_rank(pg), dist.get_world_size(pg)
    else:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        pgs = [a for a in args if hasattr(a, "size") and hasattr(a, "rank") and not isinstance(a, torch.Tensor)]
        names = [a for a in args if isinstance(a, str)]
        n = pgs[0].size() if pgs else dist.get_world_size(_resolve_process_group(names[0])) if names else 1
        sizes = [t.nbytes for t in tensors]
        if "allreduce" in name or "all_reduce" in name:
            return int(2 * (n - 1) / n * max(sizes)), 0
        if "allgather" in name or "all_gather" in name:       # input = this rank's piece
            return int((n - 1) * min(sizes)), 0
        if "reduce_scatter" in name:                          # input = the full tensor
            return int((n - 1) / n * max(sizes)), 0
        return 0, 0
    rows_total = inp.shape[0]
    in_s = list(in_s) or [rows_total // n] * n
    row_bytes = inp.nbytes // max(rows_total, 1)
    rows = sum(s for r, s in enumerate(in_s) if r != me)
    return rows * row_bytes, rows


def count_comm(fn) -> dict:
    """Run ``fn()`` once and count the collectives it issues (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    totals = dict(bytes=0, a2a_rows=0, calls=0)

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ns = func.namespace
            if ns in ("c10d", "_c10d_functional") and not func.name().endswith(("wait_tensor", "_wrap_tensor_autograd")):
                b, rows = _collective_bytes(func, args)
                totals["bytes"] += b
                totals["a2a_rows"] += rows
                totals["calls"] += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return totals


# ----------------------------------------------------------------------------- layers


def weights(K: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = {"router": torch.randn(E, D, generator=g) * 0.1, "w_gate_up": torch.randn(E, 2 * I, D, generator=g) * 0.05,
         "w_down": torch.randn(E, D, I, generator=g) * 0.05}
    return {k: v.to(dtype) for k, v in w.items()}


def check_parity(a: torch.Tensor, b: torch.Tensor, msg) -> None:
    """fp32: elementwise rtol 1e-5; bf16: norm-wise within 8 bf16 roundings."""
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=msg)
    else:
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert rel <= 8 * 2.0 ** -8, msg(f"relative error {rel:.3g} > 8 bf16 roundings")


def hf_layer(w: dict, K: int, mesh, impl: str):
    """transformers' router + EP implementation (or its whole block in one process)."""
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                      norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    gate, experts = m.Qwen3MoeTopKRouter(cfg), m.Qwen3MoeExperts(cfg)
    rng = range(E) if mesh is None else mesh.expert_range(E)
    gate.weight = torch.nn.Parameter(w["router"].clone())
    experts.gate_up_proj = torch.nn.Parameter(w["w_gate_up"][rng.start:rng.stop].clone())
    experts.down_proj = torch.nn.Parameter(w["w_down"][rng.start:rng.stop].clone())
    if mesh is None:
        run = experts
    else:
        from transformers.distributed import expert_parallel as ep

        experts.num_experts, experts._is_expert_parallel = len(rng), True
        cls = {"all_to_all": ep.AllToAllEP, "all_reduce": ep.AllReduceEP}[impl]
        run = cls(experts, mesh.device_mesh("ep")["ep"], mesh.device_mesh("tp")["tp"])

    def layer(x):
        _, top_w, top_i = gate(x)
        return run(x, top_i, top_w).to(x.dtype)

    return layer, [gate.weight, experts.gate_up_proj, experts.down_proj]


def fmoe_layer(w: dict, K: int, mesh, impl: str):
    """``fmoe.moe`` on weights placed by ``fmoe.shard`` (experts split over ep, router replicated)."""
    p = {k: v.clone().requires_grad_() for k, v in w.items()}
    if mesh is not None:
        p = fmoe.shard(p, fmoe.Plan({"router": "replicate", "w_*": "expert"}), mesh)
    router = fmoe.routing.topk(K, normalize=True)
    return (lambda x: fmoe.moe(p, x, router=router, mesh=mesh, impl=impl)[0]), [p["router"], p["w_gate_up"], p["w_down"]]


def fwd_bwd(layer, leaves, x, gy):
    xx = x.clone().requires_grad_()
    y = layer(xx)
    grads = torch.autograd.grad(y, [xx] + leaves, gy)
    return y.detach(), tuple(fmoe.to_local(g) for g in grads)


# ----------------------------------------------------------------------------- per rank
def expert_fraction(x: torch.Tensor, ids: torch.Tensor, w: dict, mesh, steps: int) -> dict:
    """This rank's expert MLP on the rows it receives, vs torch.mm of the same FLOPs."""
    from fmoe.ep import LocalExperts

    rng = range(E) if mesh is None else mesh.expert_range(E)
    mine = ids[(ids >= rng.start) & (ids < rng.stop)] - rng.start
    if mesh is not None:   # the assignments every batch of the EP group sends to this rank
        import torch.distributed as dist
        all_ids = [torch.empty_like(ids) for _ in range(mesh.ep)]
        dist.all_gather(all_ids, ids.contiguous(), group=mesh.group("ep"))
        flat = torch.cat(all_ids[:: mesh.tp])      # one copy of each distinct batch
        mine = flat[(flat >= rng.start) & (flat < rng.stop)] - rng.start
    A = int(mine.numel())
    counts = torch.bincount(mine, minlength=len(rng)).tolist()
    dt = x.dtype
    rows, row_of, scale = torch.randn(A, D, dtype=dt), torch.randperm(A), torch.rand(A, dtype=dt, requires_grad=True)
    wgu, wd = w["w_gate_up"][rng.start:rng.stop].clone().requires_grad_(), w["w_down"][rng.start:rng.stop].clone().requires_grad_()
    a, b = torch.randn(A, D, dtype=dt), torch.randn(D, 3 * I, dtype=dt)
    gy, gm = torch.randn(A, D, dtype=dt), torch.randn(A, 3 * I, dtype=dt)

    def experts():
        r = rows.clone().requires_grad_()
        experts = LocalExperts({"w_gate_up": wgu, "w_down": wd}, 0, len(rng))
        torch.autograd.grad(experts.weighted_sum(r, row_of, counts, scale), [r, scale, wgu, wd], gy)

    def mm():  # the same 3 x 2 x A x D x 3I FLOPs: forward, dA, dB
        a @ b, gm @ b.t(), a.t() @ gm

    t = {"experts": [], "mm": []}
    for i in range(steps + 1):
        for name, f in (("experts", experts), ("mm", mm)):
            t0 = time.perf_counter()
            f()
            if i:
                t[name].append(time.perf_counter() - t0)
    flops = 3 * 2 * A * D * 3 * I
    te, tm = statistics.median(t["experts"]), statistics.median(t["mm"])
    return dict(rows=A, flops=flops, expert_gflops=flops / te / 1e9, mm_gflops=flops / tm / 1e9, fraction=tm / te)


def run_rank(rank: int, world: int, layouts: list, ks: list, T: int, steps: int, warmup: int,
             dtype: str = "fp32") -> list:
    import torch.distributed as dist

    out = []
    for layout in layouts:
        mesh = None if layout == "single" else fmoe.Mesh(tp=world if layout == "shared" else 1, ep=world)
        impls = ["local"] if mesh is None else ["all_to_all"] + (["all_reduce"] if layout == "shared" else [])
        batch = 0 if mesh is None else mesh.batch_index
        g = torch.Generator().manual_seed(100 + batch)
        x, gy = torch.randn(T, D, generator=g).to(DTYPES[dtype]), torch.randn(T, D, generator=g).to(DTYPES[dtype])
        barrier = dist.barrier if mesh is not None else (lambda: None)
        for K in ks:
            w = weights(K, dtype=DTYPES[dtype])
            runs = {}
            for impl in impls:
                runs[f"fmoe {impl}"] = fmoe_layer(w, K, mesh, impl)
                runs[f"transformers {impl}"] = hf_layer(w, K, mesh, impl)
            # parity: fmoe vs transformers, same impl
            res = {name: fwd_bwd(*lay, x, gy) for name, lay in runs.items()}
            for impl in impls:
                (yf, gf), (yh, gh) = res[f"fmoe {impl}"], res[f"transformers {impl}"]
                for what, a, b in zip(["y", "dx", "d router", "d w_gate_up", "d w_down"], (yf,) + gf, (yh,) + gh):
                    check_parity(a, b, msg=lambda m: f"{layout} K={K} {impl} {what}: {m}")
            comm = {name: count_comm(lambda: fwd_bwd(*lay, x, gy)) for name, lay in runs.items()}
            times = {name: [] for name in runs}
            cpu = {name: [] for name in runs}
            names = list(runs)
            for i in range(warmup + steps):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    fwd_bwd(*runs[name], x, gy)
                    c1 = time.process_time()
                    barrier()
                    if i >= warmup:
                        times[name].append(time.perf_counter() - t0)
                        cpu[name].append(c1 - c0)
            ids = torch.topk(x @ w["router"].t(), K).indices
            out.append(dict(layout=layout, world=world, K=K, dtype=dtype, times=times, cpu=cpu, comm=comm,
                            experts=expert_fraction(x, ids, w, mesh, max(3, steps // 2))))
    return out


def summarize(per_rank: list) -> list:
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        steps = {name: [max(r[i]["times"][name][j] for r in per_rank) for j in range(len(ts))]
                 for name, ts in r0["times"].items()}
        for name, step in steps.items():
            hf = steps["transformers " + name.split()[1]]
            rows.append(dict(layout=r0["layout"], world=r0["world"], K=r0["K"], dtype=r0["dtype"], impl=name,
                             median_ms=1e3 * statistics.median(step),
                             vs_transformers=statistics.median([a / b for a, b in zip(step, hf)]),
                             cpu_ms_all_ranks=1e3 * statistics.median(
                                 [sum(r[i]["cpu"][name][j] for r in per_rank) for j in range(len(step))]),
                             sent_MB_per_rank=statistics.mean(r[i]["comm"][name]["bytes"] for r in per_rank) / 1e6,
                             a2a_rows_per_rank=statistics.mean(r[i]["comm"][name]["a2a_rows"] for r in per_rank),
                             collective_calls=r0["comm"][name]["calls"],
                             expert_fraction_of_mm=min(r[i]["experts"]["fraction"] for r in per_rank),
                             expert_gflops=statistics.mean(r[i]["experts"]["expert_gflops"] for r in per_rank),
                             mm_gflops=statistics.mean(r[i]["experts"]["mm_gflops"] for r in per_rank)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="weights, tokens and GEMMs in this dtype")
    ap.add_argument("--out", default="benchmarks/out/dispatch.json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = []
    print(f"{'layout':>7} {'ranks':>5} {'K':>2} {'implementation':>24} | {'ms':>7} {'x hf':>5} {'cpu ms':>7} | "
          f"{'MB sent':>7} {'a2a rows':>8} {'calls':>5} | experts: {'GF/s':>5} of mm {'GF/s':>5} = frac")
    for world in args.worlds:
        layouts = ["single"] if world == 1 else ["ep", "shared"]
        per_rank = fmoe.testing.spawn(run_rank, world, layouts, args.k, args.tokens, args.steps, args.warmup,
                                      args.dtype, timeout=3600)
        for r in summarize(per_rank):
            rows.append(r)
            print(f"{r['layout']:>7} {r['world']:>5} {r['K']:>2} {r['impl']:>24} | {r['median_ms']:7.1f} "
                  f"{r['vs_transformers']:5.2f} {r['cpu_ms_all_ranks']:7.0f} | {r['sent_MB_per_rank']:7.2f} "
                  f"{r['a2a_rows_per_rank']:8.0f} "
                  f"{r['collective_calls']:5d} | {r['expert_gflops']:5.0f} of {r['mm_gflops']:5.0f} = "
                  f"{r['expert_fraction_of_mm']:.2f}")
            sys.stdout.flush()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.platform(), cpus=os.cpu_count(),
                torch=torch.__version__, transformers=__import__("transformers").__version__,
                shapes=dict(D=D, I=I, E=E, tokens_per_rank=args.tokens), dtype=args.dtype, steps=args.steps, warmup=args.warmup,
                loadavg_before=load_before, loadavg_after=os.getloadavg(), command=" ".join(["python"] + sys.argv))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
