"""Train-step time of fmoe against transformers' own expert parallelism, side by side.

One tiny random Qwen3-MoE checkpoint is written with transformers' ``save_pretrained``. On the
same gloo ranks it is loaded twice: by transformers (``from_pretrained(...,
distributed_config=DistributedConfig(tp_size, fsdp_size, ep_size))``: FSDP2 for the dense
weights, token dispatch over ``ep`` for the experts) and by fmoe (``qwen3_moe.load_hf`` with the
model plan plus :func:`fmoe.fsdp.data_parallel_plan`, i.e. the same FSDP split of the
dense weights). A *step* is forward + backward of the same next-token cross-entropy on the same
tokens, ending with gradients reduced over the data-parallel ranks (FSDP2's reduce-scatter in
transformers' backward; ``fmoe.training.grads.reduce_grads`` in fmoe). No optimizer update.

The two libraries are **alternated** step by step in one run (order swapped every step), each
step between two barriers, so background load hits both alike; the report gives the median
step time (slowest rank) of each, the median of the per-step ratios fmoe / transformers, and
asserts that both compute the same loss (rtol 1e-5) on every rank.

Layouts (``--layouts``):

- ``single``: one process (all cores), the union of the ranks' batches;
- ``ep4``: 4 ranks, ``tp=1, fsdp=4, ep=4`` (each rank its own batch);
- ``tp2ep4``: 4 ranks, ``tp=2, fsdp=2, ep=4`` (TP pairs share a batch).

Experiments (``--runners fmoe_sdpa fmoe_exp``, clearly not the library as shipped): fmoe with
``fmoe.nn.attention`` computed by ``scaled_dot_product_attention``, and additionally with the
gradient all-reduce coalesced into one collective per mesh axis; they measure what two changes
outside the MoE code would buy.

Distributed efficiency = tokens/s of the 4-rank run / tokens/s of the single process, per
library, from the same script invocation (same cores, same tokens per step).

``fmoe_compiled``: fmoe compiled as the job's ``--compile`` compiles it (``StepConfig(compile=True)``,
:func:`fmoe.training.step.forward_loss` through the step's own ``_compiled``): on one process
forward + loss as one Inductor graph, on a mesh regional compilation (each decoder layer compiled
once and reused by every layer, the MoE block and its exchange inside the layer's graph);
backward by AOTAutograd either way. The loss is the same next-token cross-entropy (the step's
``forward_loss`` of ``tokens[:, :-1]`` against ``tokens[:, 1:]``: the same logits, causal attention).
Compilation happens in the warmup steps (use ``--warmup 3``).

``gemm_floor`` (not a library): each rank runs exactly the matrix products of its fmoe step
(:func:`step_gemms`: attention projections, router, its local experts' SwiGLU on an even share
of the routed slots, lm_head; forward, input and weight gradients, fp32) and nothing else,
between the same barriers as the runners: the step time no implementation of this step on this
machine goes below, measured in the same run (``--runners fmoe fmoe_compiled gemm_floor ...``).
Model FLOP/s (:func:`model_flops_per_token` x tokens/s) is reported as a fraction of the
measured ``torch.mm`` rate of the machine (all cores, fp32, 1024^3).

``--dtype fp32 bf16`` runs every runner in each dtype, all alternated in one loop (a bf16 runner is
named ``NAME@bf16``): transformers loads the checkpoint with ``dtype=torch.bfloat16`` (bf16
weights), fmoe keeps its fp32 weights as masters and casts them once per step
(:func:`fmoe.training.step.compute_params`, the trainer's policy), gradients arriving in fp32. bf16
loss parity with transformers is 4 bf16 roundings (``4 * 2**-8`` relative); the report adds the
median per-step ratio bf16 / fp32 of each library, and bf16 FLOP/s as a fraction of the bf16
``torch.mm`` rate.

    python benchmarks/bench_train_step.py [--k 8 4] [--steps 12] [--warmup 2] [--layouts single ep4 tp2ep4] [--dtype fp32 bf16]

Prints a table and writes benchmarks/out/train_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

import fmoe
from fmoe.precision import DTYPES

V, D, I, E, LAYERS, B, S = 512, 256, 256, 32, 2, 4, 256
SINGLE_BATCHES = 4  # the single process runs the union of the 4 ranks' batches (ep4 layout)
LAYOUTS = {"single": dict(world=1, tp=1, ep=1), "ep4": dict(world=4, tp=1, ep=4),
           "tp2ep4": dict(world=4, tp=2, ep=4)}


def build_checkpoint(path: str, k: int, seed: int = 0) -> None:
    """A random transformers Qwen3-MoE (D=256, E=32, top-``k``, 2 layers, vocab 512) saved to ``path``."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=D, intermediate_size=768, moe_intermediate_size=I, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=E, num_experts_per_tok=k,
        norm_topk_prob=True, max_position_embeddings=1024)
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)


def all_batches(num: int, seed: int = 1) -> torch.Tensor:
    """``num`` batches of ``[B, S]`` token ids: ``[num, B, S]``."""
    return torch.randint(0, V, (num, B, S), generator=torch.Generator().manual_seed(seed))


def _hf_model(path: str, layout: dict, attn: str, dtype: str = "fp32"):
    import transformers
    from transformers.distributed import DistributedConfig

    kw = dict(dtype=DTYPES[dtype], attn_implementation=attn)
    if layout["world"] > 1:
        tp, ep, world = layout["tp"], layout["ep"], layout["world"]
        kw["distributed_config"] = DistributedConfig(tp_size=tp, fsdp_size=world // tp, ep_size=ep)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).train()


def _fmoe_params(path: str, mesh, fsdp: bool = False):
    from fmoe.models import qwen3_moe
    from fmoe.fsdp import data_parallel_plan

    with open(os.path.join(path, "config.json")) as f:
        cfg = qwen3_moe.Config.from_hf(json.load(f))
    if mesh is None:
        params, cfg = qwen3_moe.load_hf(path)
    elif not fsdp:
        params, cfg = qwen3_moe.load_hf(path, mesh=mesh)
    else:
        shapes = fmoe.tree.unflatten({k: torch.empty(s.shape, device="meta")
                                      for k, s in qwen3_moe.hf_specs(cfg).items()})
        plan = data_parallel_plan(qwen3_moe.plan(cfg), shapes, mesh)
        params, cfg = qwen3_moe.load_hf(path, mesh=mesh, plan=plan)
    params = fmoe.tree.map_with_path(lambda _, t: t.detach().requires_grad_(True), params)
    return params, cfg


def hf_step(model, tokens: torch.Tensor) -> float:
    """Forward + backward of the next-token loss (FSDP2 reduces the gradients in backward)."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    return float(loss.detach())


def _fmoe_loss(params, cfg, mesh, tokens: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    from fmoe.models import qwen3_moe
    from fmoe.nn import cross_entropy

    logits = qwen3_moe.forward(params, tokens, cfg, mesh, impl=impl)
    return cross_entropy(logits[:, :-1], tokens[:, 1:])


def fmoe_step(params, cfg, mesh, tokens: torch.Tensor, impl: str = "auto", coalesced: bool = False,
              loss_fn=_fmoe_loss, dtype: str = "fp32") -> float:
    """Forward + backward of the same loss; gradients reduced over the data-parallel ranks
    (``fmoe.training.grads.reduce_grads``, or the ``coalesced`` experiment). ``loss_fn``: the
    forward (``torch.compile(_fmoe_loss)`` for the compiled runner; its backward is compiled
    with it). ``dtype="bf16"``: the step's weights are bf16 copies of the fp32 masters, cast once
    (:func:`fmoe.training.step.compute_params`); the gradients are the masters'."""
    from fmoe.fsdp import regather_in_backward
    from fmoe.training.grads import reduce_grads
    from fmoe.training.step import compute_params

    leaves = fmoe.tree.leaves(params)
    with regather_in_backward():
        loss = loss_fn(compute_params(params, dtype), cfg, mesh, tokens, impl=impl)
        grads = torch.autograd.grad(loss, leaves)
    if mesh is not None and coalesced:
        _reduce_grads_coalesced(grads, mesh)
    elif mesh is not None:
        reduce_grads(fmoe.tree.unflatten(dict(zip(fmoe.tree.paths(params), grads)), like=params), params, mesh,
                     inplace=True)
    return float(loss.detach())


def fmoe_compiled_step(params, cfg, mesh, tokens: torch.Tensor, dtype: str = "fp32") -> float:
    """:func:`fmoe_step` compiled as the job compiles it: ``StepConfig(compile=True)``'s forward +
    loss and compile region (``fmoe.training.step._compiled``, the one place that decides how a
    mesh compiles), the same gradient reduction."""
    from fmoe.fsdp import regather_in_backward
    from fmoe.models import qwen3_moe
    from fmoe.training.grads import reduce_grads
    from fmoe.training.step import StepConfig, _compiled, compute_params

    step_cfg = StepConfig(compile=True, dtype=dtype)
    run_mesh = mesh if mesh is not None else fmoe.Mesh()
    fwd_loss, region = _compiled(step_cfg, run_mesh)
    leaves = fmoe.tree.leaves(params)
    with regather_in_backward(), region:
        loss, _ = fwd_loss(qwen3_moe, compute_params(params, dtype), tokens[:, :-1], tokens[:, 1:], cfg, run_mesh,
                           step_cfg)
        grads = torch.autograd.grad(loss, leaves)
    if mesh is not None:
        reduce_grads(fmoe.tree.unflatten(dict(zip(fmoe.tree.paths(params), grads)), like=params), params, mesh,
                     inplace=True)
    return float(loss.detach())


def _reduce_grads_coalesced(grads, mesh) -> list:
    """EXPERIMENT ONLY (runner ``fmoe_exp``): what ``reduce_grads`` does (sum over the data axes
    a leaf is replicated on, and over Partial axes; divide by the number of batches) with one
    ``all_reduce_coalesced`` per mesh axis instead of one all-reduce per leaf. Returns local
    tensors (no DTensor re-wrapping)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from fmoe.collectives import all_reduce_coalesced
    from fmoe.training.grads import DATA_AXES

    local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    for axis in ("tp", "ep", "fsdp", "efsdp", "dp_replicate"):     # the same order on every rank
        todo = []
        for i, g in enumerate(grads):
            if not isinstance(g, DTensor) or axis not in g.device_mesh.mesh_dim_names:
                continue
            d = g.device_mesh.mesh_dim_names.index(axis)
            pl = g.placements[d]
            if g.device_mesh.mesh.shape[d] > 1 and (isinstance(pl, Partial) or
                                                    (isinstance(pl, Replicate) and axis in DATA_AXES)):
                todo.append((i, g.device_mesh.get_group(axis)))
        for group in {id(gr): gr for _, gr in todo}.values():
            idx = [i for i, gr in todo if gr is group]
            for i, t in zip(idx, all_reduce_coalesced([local[i] for i in idx], group)):
                local[i] = t
    return [t / mesh.num_batches for t in local]


def step_gemms(k: int, layout: dict) -> list[tuple[int, int, int]]:
    """``(m, k, n)`` of every matrix product one rank's fmoe train step runs (forward, input
    gradient, weight gradient of each): q/k/v/o projections and the router per layer, the local
    experts' gate_up and down GEMMs on an even share of the routed slots (``T * k`` slots per rank,
    as many per local expert), the lm_head; dense weights replicated (``tp == 1`` layouts)."""
    if layout["tp"] != 1:
        raise ValueError(f"gemm_floor: layouts with tp == 1 only (single, ep4), got tp={layout['tp']}")
    H, G, hd = 8, 4, 32
    T = B * S if layout["world"] > 1 else B * S * SINGLE_BATCHES        # tokens per rank
    local = E // layout["ep"]
    rows = T * k // local                  # slots per local expert: T * k received per rank (even routing)
    prods = []
    fwd_bwd = lambda m, kk, n: [(m, kk, n), (m, n, kk), (kk, m, n)]  # noqa: E731  y, dX, dW
    for _ in range(LAYERS):
        for n_out in (H * hd, G * hd, G * hd, E):
            prods += fwd_bwd(T, D, n_out)
        prods += fwd_bwd(T, H * hd, D)
        for _ in range(local):
            prods += fwd_bwd(rows, D, 2 * I) + fwd_bwd(rows, I, D)
    return prods + fwd_bwd(T, D, V)


def gemm_floor_step(mats: list) -> float:
    """The step's matrix products alone (``gemm_floor``); returns 0.0 (no loss)."""
    for a, b in mats:
        torch.mm(a, b)
    return 0.0


def _profile(fn, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        fn()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


def _sdpa_attention(q, k, v, *, causal=True, window=None, sinks=None, scale=None, num_kv_groups=None):
    """EXPERIMENT ONLY (``--runners fmoe_sdpa``): ``fmoe.nn.attention`` computed by
    ``F.scaled_dot_product_attention`` (Qwen3 here has no window and no sinks)."""
    from einops import rearrange

    assert window is None and sinks is None
    heads = lambda t: rearrange(t, "b s h d -> b h s d")  # noqa: E731
    o = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=causal,
                                                         scale=scale, enable_gqa=True)
    return rearrange(o, "b h s d -> b s h d")


def _with_sdpa(fn):
    import fmoe.nn as nn

    def run():
        orig, nn.attention = nn.attention, _sdpa_attention
        try:
            return fn()
        finally:
            nn.attention = orig

    return run


def run_layout(rank: int, world: int, path: str, layout: dict, names: list, steps: int, warmup: int,
               attn: str, profile_dir: str, dtypes: tuple = ("fp32",)) -> dict:
    """On each rank: load every runner's model, then alternate timed steps (order rotated every
    step). Returns per-step wall and CPU times and losses per runner."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    distributed = world > 1
    mesh = fmoe.Mesh(tp=layout["tp"], ep=layout["ep"]) if distributed else None
    batches = all_batches(world // layout["tp"] if distributed else SINGLE_BATCHES)
    tokens = batches[mesh.batch_index] if distributed else batches.reshape(-1, S)   # [B, S] / [4B, S]
    runners = {}
    for dt, name in [(dt, name) for dt in dtypes for name in names]:
        label = name if dt == "fp32" else f"{name}@{dt}"
        if name == "transformers":
            model = _hf_model(path, layout, attn, dt)
            runners[label] = (lambda m: lambda: hf_step(m, tokens))(model)
        elif name == "fmoe_fsdp" and not distributed:
            continue
        elif name == "gemm_floor":            # the step's matrix products alone
            if dt != "fp32":
                continue
            with open(os.path.join(path, "config.json")) as f:
                k = json.load(f)["num_experts_per_tok"]
            mats = [(torch.randn(m, kk), torch.randn(kk, n)) for m, kk, n in step_gemms(k, layout)]
            runners[label] = (lambda ms: lambda: gemm_floor_step(ms))(mats)
        elif name == "fmoe_compiled":        # the job's --compile: StepConfig(compile=True)
            params, cfg = _fmoe_params(path, mesh)
            runners[label] = (lambda p, c, d: lambda: fmoe_compiled_step(p, c, mesh, tokens, dtype=d))(params, cfg, dt)
        else:
            params, cfg = _fmoe_params(path, mesh, fsdp=name == "fmoe_fsdp")
            step = (lambda p, c, n, d: lambda: fmoe_step(p, c, mesh, tokens, coalesced=n == "fmoe_exp", dtype=d))(
                params, cfg, name, dt)
            runners[label] = _with_sdpa(step) if name in ("fmoe_sdpa", "fmoe_exp") else step
    barrier = dist.barrier if distributed else (lambda: None)
    times = {name: [] for name in runners}
    cpu = {name: [] for name in runners}
    losses = {name: [] for name in runners}
    order = list(runners)
    for i in range(warmup + steps):
        for name in order[i % len(order):] + order[:i % len(order)]:
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = runners[name]()
            c1 = time.process_time()
            barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
            losses[name].append(loss)
    if profile_dir:
        for name, fn in runners.items():
            if rank == 0:
                _profile(fn, os.path.join(profile_dir, f"profile_{name}_{_tag(layout)}.txt"))
            else:
                fn()
    return dict(times=times, cpu=cpu, losses=losses, tokens_per_step=int(tokens.numel()) * (world // layout["tp"])
                if distributed else int(tokens.numel()), threads=torch.get_num_threads())


def model_flops_per_token(k: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 2 per multiply-add of every
    matmul a token goes through (q/k/v/o, router, its ``k`` experts' SwiGLU, lm_head) plus causal
    attention scores and values (on average ``S / 2`` keys per query)."""
    H, G, hd = 8, 4, 32
    per_layer = D * (2 * H * hd + 2 * G * hd) + D * E + k * 3 * D * I
    attention = 2 * (S / 2) * H * hd                       # q.k and p.v per query
    forward = 2 * (LAYERS * per_layer + V * D) + 2 * LAYERS * attention
    return 3 * forward


def mm_rate(threads: int, n: int = 1024, repeat: int = 20, dtype: torch.dtype = torch.float32) -> float:
    """Measured ``torch.mm`` FLOP/s of an ``n x n`` product in ``dtype`` with ``threads`` threads
    (the matmul ceiling the FLOP fraction is reported against; best of ``repeat``)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)                                   # oneDNN builds its bf16 kernel on the first call
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(old)
    return 2 * n ** 3 / best


def _tag(layout: dict) -> str:
    return "single" if layout["world"] == 1 else f"tp{layout['tp']}ep{layout['ep']}"


def summarize(per_rank: list[dict], layout_name: str, k: int) -> dict:
    """Step time = slowest rank per step; medians, per-step ratios, loss parity."""
    names = list(per_rank[0]["times"])
    step = {n: [max(r["times"][n][i] for r in per_rank) for i in range(len(per_rank[0]["times"][n]))]
            for n in names}
    out = dict(layout=layout_name, k=k, world=len(per_rank), tokens_per_step=per_rank[0]["tokens_per_step"],
               threads_per_rank=per_rank[0]["threads"], step_s={n: step[n] for n in names},
               median_s={n: statistics.median(step[n]) for n in names},
               cpu_s_all_ranks={n: statistics.median([sum(r["cpu"][n][i] for r in per_rank)
                                                      for i in range(len(step[n]))]) for n in names})
    out["tokens_per_s"] = {n: out["tokens_per_step"] / out["median_s"][n] for n in names}
    out["model_flop_per_s"] = {n: out["tokens_per_s"][n] * model_flops_per_token(k) for n in names}
    hf_of = lambda n: "transformers" + (n[n.index("@"):] if "@" in n else "")  # noqa: E731
    fm = [n for n in names if n.startswith("fmoe") and hf_of(n) in names]
    if fm:
        out["ratio_median_of_steps"] = {n: statistics.median([f / h for f, h in zip(step[n], step[hf_of(n)])])
                                        for n in fm}
        out["ratio_of_medians"] = {n: out["median_s"][n] / out["median_s"][hf_of(n)] for n in fm}
        diffs = []
        for r in per_rank:
            for n in fm:
                lh, lf = r["losses"][hf_of(n)][0], r["losses"][n][0]
                diffs.append(abs(lf - lh) / abs(lh))
                rtol = 4 * 2.0 ** -8 if "@bf16" in n else 1e-5
                if abs(lf - lh) > rtol * abs(lh):
                    raise AssertionError(f"{layout_name} K={k}: loss parity failed: {n} {lf!r} vs {hf_of(n)} {lh!r}")
        out["loss_rel_diff_max"] = max(diffs)
        out["loss"] = [r["losses"][hf_of(fm[0])][0] for r in per_rank]
    if "fmoe" in names:                     # each runner against fmoe eager, step by step
        out["x_fmoe_median_of_steps"] = {n: statistics.median([a / b for a, b in zip(step[n], step["fmoe"])])
                                         for n in names if n != "fmoe"}
    out["bf16_over_fp32"] = {n: statistics.median([b / a for a, b in zip(step[n.split("@")[0]], step[n])])
                             for n in names if n.endswith("@bf16") and n.split("@")[0] in names}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[8, 4], help="top-k values (one checkpoint each)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--steps", type=int, default=12, help="timed steps per library")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", help="transformers attn_implementation (its default: sdpa)")
    ap.add_argument("--runners", nargs="+", default=["fmoe", "fmoe_fsdp", "transformers"],
                    choices=["fmoe", "fmoe_fsdp", "fmoe_compiled", "fmoe_sdpa", "fmoe_exp", "transformers",
                             "gemm_floor"],
                    help="fmoe: load_hf default plan (dense replicated, grads all-reduced); fmoe_fsdp: dense "
                         "FSDP like transformers; EXPERIMENTS (patched in the benchmark, not the library): "
                         "fmoe_sdpa = fmoe with SDPA attention, fmoe_exp = SDPA attention + coalesced "
                         "gradient all-reduce; fmoe_compiled: the job's --compile (StepConfig(compile=True)), "
                         "backward compiled with it (dense replicated, like fmoe); gemm_floor: the step's matrix "
                         "products alone (a floor, not a library)")
    ap.add_argument("--dtype", nargs="+", default=["fp32"], choices=list(DTYPES),
                    help="compute dtypes; several: every runner in each, alternated in one loop")
    ap.add_argument("--profile", action="store_true", help="write torch.profiler tables of one step per library")
    ap.add_argument("--out", default="benchmarks/out/train_step.json")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    profile_dir = os.path.dirname(args.out) if args.profile else ""
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.k:
            path = os.path.join(tmp, f"qwen3moe_k{k}")
            build_checkpoint(path, k)
            for name in args.layouts:
                layout = LAYOUTS[name]
                per_rank = fmoe.testing.spawn(run_layout, layout["world"], path, layout, args.runners, args.steps,
                                              args.warmup, args.attn, profile_dir, tuple(args.dtype), timeout=1800)
                rows.append(summarize(per_rank, name, k))
                _print_row(rows[-1])
                sys.stdout.flush()
    eff = _efficiency(rows)
    rates = {dt: mm_rate(os.cpu_count() or 1, dtype=DTYPES[dt]) for dt in args.dtype}
    for r in rows:
        r["fraction_of_mm_rate"] = {n: f / rates[n.split("@")[1] if "@" in n else "fp32"]
                                    for n, f in r["model_flop_per_s"].items()}
        print(f"{r['layout']} K={r['k']} model FLOP/s as a fraction of torch.mm in its dtype ("
              + ", ".join(f"{dt} {v / 1e9:.1f} GFLOP/s" for dt, v in rates.items()) + "): "
              + ", ".join(f"{n} {v:.3f}" for n, v in r["fraction_of_mm_rate"].items()))
        for n, v in r["bf16_over_fp32"].items():
            print(f"{r['layout']} K={r['k']} {n} / fp32: {v:.3f} (median of per-step ratios)")
    rate = rates.get("fp32", next(iter(rates.values())))
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.platform(), cpus=os.cpu_count(),
                torch=torch.__version__, transformers=__import__("transformers").__version__,
                model=dict(V=V, D=D, I=I, E=E, layers=LAYERS, batch_per_rank=[B, S]), attn=args.attn,
                steps=args.steps, warmup=args.warmup, loadavg_before=load_before, loadavg_after=os.getloadavg(),
                mm_flop_per_s=rate, mm_flop_per_s_by_dtype=rates, dtypes=args.dtype,
                command=" ".join(["python"] + sys.argv))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows, efficiency=eff), f, indent=2)
    print(f"\nload average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    for e in eff:
        print(f"distributed efficiency {e['library']:>12} K={e['k']} {e['layout']}: {e['efficiency']:.3f}")


def _print_row(r: dict) -> None:
    print(f"{r['layout']} K={r['k']} world={r['world']} tokens/step={r['tokens_per_step']}"
          + (f" loss rel diff {r['loss_rel_diff_max']:.1e}" if "loss_rel_diff_max" in r else ""))
    for n, t in r["median_s"].items():
        ratio = r.get("ratio_median_of_steps", {}).get(n)
        of_eager = r.get("x_fmoe_median_of_steps", {}).get(n)
        print(f"    {n:>12} {t:7.3f} s/step {r['tokens_per_s'][n]:8,.0f} tok/s  cpu {r['cpu_s_all_ranks'][n]:6.2f} s"
              + (f"  x{ratio:.3f} of transformers (median of per-step ratios)" if ratio else "")
              + (f"  x{of_eager:.3f} of fmoe eager" if of_eager else ""))


def _efficiency(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["world"] == 1:
            continue
        single = next((s for s in rows if s["world"] == 1 and s["k"] == r["k"]), None)
        if single is None:
            continue
        for lib in r["tokens_per_s"]:
            if lib in single["tokens_per_s"]:
                out.append(dict(library=lib, k=r["k"], layout=r["layout"],
                                efficiency=r["tokens_per_s"][lib] / single["tokens_per_s"][lib]))
    return out


if __name__ == "__main__":
    main()
