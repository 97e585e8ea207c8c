"""One CUDA GPU, no distribution: fmoe's expert GEMMs and MoE layer at Qwen3-30B-A3B layer shapes.

bf16, ``D=2048, I=768, E=128, K=8``, 16k tokens (``T * K = 131,072`` routed rows). Measured in
one run, with CUDA events after warm-up, median of the repetitions:

1. **plain matmul**: ``torch.mm`` with the FLOPs of the experts' fwd + bwd as three GEMMs
   (``[A, D] x [D, 3I]``, its input gradient and its weight gradient): the machine's rate;
2. **grouped GEMMs**: the two expert projections as ``torch._grouped_mm`` over sorted rows,
   forward, and forward + backward (input and weight gradients), no activation;
3. **expert MLP**: ``fmoe.experts.expert_mlp`` (grouped GEMMs + SwiGLU + routing weight),
   forward + backward; its TFLOP/s over the same GEMM FLOPs and as a fraction of (1);
4. **MoE layer**: ``fmoe.moe`` (router, top-k, sort, experts, combine) against transformers'
   ``Qwen3MoeSparseMoeBlock`` with its ``grouped_mm`` experts on the same weights and tokens,
   forward + backward (gradients of x, router and experts), alternated; outputs compared.

    python benchmarks/bench_gpu.py            # needs CUDA; about a minute on an H100/H200
    python benchmarks/bench_gpu.py --dry-run  # tiny fp32 shapes on CPU: checks the script logic

5. **main job** (also): a 20-step ``fmoe train --device cuda --dtype bf16`` on the
   small preset (``--dry-run``: 3 CPU steps, fp32), its final metrics next to the memory plan's
   prediction for it (``--no-main-job`` skips it).

Prints a table and writes benchmarks/out/gpu.json (``gpu_dry_run.json`` for a dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

import fmoe
from fmoe.experts import expert_mlp


@dataclass(frozen=True)
class Shapes:
    D: int = 2048
    I: int = 768
    E: int = 128
    K: int = 8
    T: int = 16384


DRY = Shapes(D=64, I=32, E=8, K=2, T=256)


def timer(device: str, warmup: int, reps: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of ``fn()``: CUDA events on a GPU, ``perf_counter`` on CPU."""

    def run(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    return run


def make_inputs(s: Shapes, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = {"router": torch.randn(s.E, s.D, generator=g) * 0.02,
         "w_gate_up": torch.randn(s.E, 2 * s.I, s.D, generator=g) * 0.02,
         "w_down": torch.randn(s.E, s.D, s.I, generator=g) * 0.02}
    w = {k: v.to(device, dtype) for k, v in w.items()}
    x = torch.randn(s.T, s.D, generator=g).to(device, dtype)
    gy = torch.randn(s.T, s.D, generator=g).to(device, dtype)
    return dict(w=w, x=x, gy=gy)


def routed_rows(s: Shapes, inp: dict) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The ``[A, D]`` rows sorted by expert, the counts, the routing weights (as ``fmoe.moe`` routes)."""
    probs = torch.softmax((inp["x"] @ inp["w"]["router"].t()).float(), dim=-1)
    w, ids = torch.topk(probs, s.K, dim=-1)
    order = torch.argsort(ids.reshape(-1), stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=s.E).tolist()
    rows = inp["x"].index_select(0, torch.div(order, s.K, rounding_mode="floor"))
    return rows, counts, (w / w.sum(-1, keepdim=True)).reshape(-1)[order].to(inp["x"].dtype)


def hf_block(s: Shapes, inp: dict, device: str, dtype: torch.dtype):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=s.D, moe_intermediate_size=s.I, num_experts=s.E,
                                      num_experts_per_tok=s.K, norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(cfg).to(device, dtype)
    with torch.no_grad():
        block.gate.weight.copy_(inp["w"]["router"])
        block.experts.gate_up_proj.copy_(inp["w"]["w_gate_up"])
        block.experts.down_proj.copy_(inp["w"]["w_down"])
    return block


def run(s: Shapes, device: str, dtype: torch.dtype, warmup: int, reps: int) -> dict:
    inp = make_inputs(s, device, dtype)
    tm = timer(device, warmup, reps)
    A = s.T * s.K
    gemm_fwd = 2 * A * 3 * s.I * s.D                     # both projections, forward
    out = dict(shapes=asdict(s), rows=A, gemm_tflop_fwd=gemm_fwd / 1e12, gemm_tflop_fwd_bwd=3 * gemm_fwd / 1e12)

    # 1. plain matmul with the same FLOPs
    a, b = torch.randn(A, s.D, device=device, dtype=dtype), torch.randn(s.D, 3 * s.I, device=device, dtype=dtype)
    gm = torch.randn(A, 3 * s.I, device=device, dtype=dtype)
    out["mm_fwd_ms"] = tm(lambda: a @ b)
    out["mm_fwd_bwd_ms"] = tm(lambda: (a @ b, gm @ b.t(), a.t() @ gm))
    del a, b, gm

    # 2. grouped GEMMs alone, 3. expert MLP
    rows, counts, scale = routed_rows(s, inp)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    wgu, wd = (inp["w"][k].clone().requires_grad_() for k in ("w_gate_up", "w_down"))
    grouped = fmoe.experts.use_grouped(rows, wgu, wd)
    gyr = torch.randn(A, s.D, device=device, dtype=dtype)

    def gmm_fwd():
        h = torch._grouped_mm(rows, wgu.detach().transpose(1, 2), offs=offs)
        return torch._grouped_mm(h[:, :s.I], wd.detach().transpose(1, 2), offs=offs)

    def gmm_fwd_bwd():
        r = rows.clone().requires_grad_()
        h = torch._grouped_mm(r, wgu.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(h[:, :s.I].contiguous(), wd.transpose(1, 2), offs=offs)
        torch.autograd.grad(y, [r, wgu, wd], gyr)

    def mlp_fwd_bwd():
        r = rows.clone().requires_grad_()
        sc = scale.clone().requires_grad_()
        torch.autograd.grad(expert_mlp(r, counts, wgu, wd, scale=sc), [r, sc, wgu, wd], gyr)

    if grouped:
        out["grouped_fwd_ms"] = tm(gmm_fwd)
        out["grouped_fwd_bwd_ms"] = tm(gmm_fwd_bwd)
    out["expert_mlp_fwd_ms"] = tm(lambda: expert_mlp(rows, counts, wgu.detach(), wd.detach(), scale=scale))
    out["expert_mlp_fwd_bwd_ms"] = tm(mlp_fwd_bwd)
    out["expert_mlp_path"] = "grouped_mm" if grouped else "loop"
    del rows, gyr

    # 4. MoE layer: fmoe vs transformers, alternated
    params = {k: v.clone().requires_grad_() for k, v in inp["w"].items()}
    router = fmoe.routing.topk(s.K, normalize=True)
    block = hf_block(s, inp, device, dtype)
    hf_leaves = [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]

    def fmoe_layer():
        x = inp["x"].clone().requires_grad_()
        y, _ = fmoe.moe(params, x, router=router)
        return y, torch.autograd.grad(y, [x, params["router"], params["w_gate_up"], params["w_down"]], inp["gy"])

    def hf_layer():
        x = inp["x"].clone().requires_grad_()
        y = block(x[None])[0]
        return y, torch.autograd.grad(y, [x] + hf_leaves, inp["gy"])

    (yf, gf), (yh, gh) = fmoe_layer(), hf_layer()
    out["layer_max_rel_diff"] = {n: float((a.detach().float() - b.detach().float()).abs().max()
                                          / b.detach().float().abs().max())
                                 for n, a, b in zip(["y", "dx", "d_router", "d_w_gate_up", "d_w_down"],
                                                    (yf,) + gf, (yh,) + gh)}
    t = {"fmoe": [], "transformers": []}
    one = timer(device, 0, 1)
    for _ in range(warmup):
        fmoe_layer(), hf_layer()
    for i in range(reps):
        for name, fn in ((("fmoe", fmoe_layer), ("transformers", hf_layer)) if i % 2 == 0
                         else (("transformers", hf_layer), ("fmoe", fmoe_layer))):
            t[name].append(one(fn))
    out["layer_fmoe_ms"], out["layer_hf_ms"] = statistics.median(t["fmoe"]), statistics.median(t["transformers"])
    out["layer_ratio_median_of_pairs"] = statistics.median([f / h for f, h in zip(t["fmoe"], t["transformers"])])

    tf = lambda flops, ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    out["tflops"] = {"mm_fwd": tf(gemm_fwd, out["mm_fwd_ms"]), "mm_fwd_bwd": tf(3 * gemm_fwd, out["mm_fwd_bwd_ms"]),
                     "expert_mlp_fwd": tf(gemm_fwd, out["expert_mlp_fwd_ms"]),
                     "expert_mlp_fwd_bwd": tf(3 * gemm_fwd, out["expert_mlp_fwd_bwd_ms"]),
                     "layer_fmoe": tf(3 * gemm_fwd, out["layer_fmoe_ms"]),
                     "layer_transformers": tf(3 * gemm_fwd, out["layer_hf_ms"])}
    if grouped:
        out["tflops"]["grouped_fwd"] = tf(gemm_fwd, out["grouped_fwd_ms"])
        out["tflops"]["grouped_fwd_bwd"] = tf(3 * gemm_fwd, out["grouped_fwd_bwd_ms"])
    out["expert_mlp_fraction_of_mm"] = out["tflops"]["expert_mlp_fwd_bwd"] / out["tflops"]["mm_fwd_bwd"]
    return out


def report(r: dict) -> None:
    t = r["tflops"]
    print(f"shapes {r['shapes']}  routed rows {r['rows']:,}  GEMM FLOPs fwd {r['gemm_tflop_fwd']:.3f} TFLOP")
    lines = [("plain mm, fwd", r["mm_fwd_ms"], t["mm_fwd"]), ("plain mm, fwd+bwd (3 GEMMs)", r["mm_fwd_bwd_ms"], t["mm_fwd_bwd"])]
    if "grouped_fwd_ms" in r:
        lines += [("torch._grouped_mm experts, fwd", r["grouped_fwd_ms"], t["grouped_fwd"]),
                  ("torch._grouped_mm experts, fwd+bwd", r["grouped_fwd_bwd_ms"], t["grouped_fwd_bwd"])]
    lines += [(f"fmoe expert_mlp ({r['expert_mlp_path']}), fwd", r["expert_mlp_fwd_ms"], t["expert_mlp_fwd"]),
              (f"fmoe expert_mlp ({r['expert_mlp_path']}), fwd+bwd", r["expert_mlp_fwd_bwd_ms"], t["expert_mlp_fwd_bwd"]),
              ("fmoe.moe layer, fwd+bwd", r["layer_fmoe_ms"], t["layer_fmoe"]),
              ("transformers Qwen3MoeSparseMoeBlock, fwd+bwd", r["layer_hf_ms"], t["layer_transformers"])]
    for name, ms, tfl in lines:
        print(f"  {name:<48} {ms:9.3f} ms  {tfl:8.1f} TFLOP/s")
    print(f"  expert MLP fwd+bwd = {r['expert_mlp_fraction_of_mm']:.2f} of the plain matmul rate; "
          f"MoE layer fmoe / transformers = {r['layer_ratio_median_of_pairs']:.3f} (median of alternated pairs)")
    print("  layer max relative differences fmoe vs transformers: "
          + ", ".join(f"{k} {v:.1e}" for k, v in r["layer_max_rel_diff"].items()))


def main_job(device: str, dry_run: bool) -> dict:
    """Run the main job for 20 steps (3 on a dry run) on ``device``; its final metrics and plan."""
    import subprocess
    import tempfile

    shape = ["--model", "qwen3_moe", "--preset", "small", "--batch", "8", "--seq", "256", "--dtype", "bf16"]
    run_flags = ["--steps", "20", "--device", "cuda"]
    if dry_run:
        shape = ["--model", "qwen3_moe", "--preset", "tiny", "--batch", "2", "--seq", "32", "--dtype", "fp32"]
        run_flags = ["--steps", "3", "--device", "cpu"]
    flags = shape + run_flags
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "fmoe", "train", *flags, "--out", os.path.join(out, "run"), "--quiet"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise RuntimeError(f"main job failed: {done.stderr[-2000:]}")
        plan = subprocess.run([sys.executable, "-m", "fmoe", "memory", "--json", *shape], capture_output=True, text=True,
                              timeout=300)
    final = json.loads(done.stdout.strip().splitlines()[-1])["final"]
    return {"command": " ".join(["python", "-m", "fmoe", "train", *flags]), "final": final,
            "plan": json.loads(plan.stdout)["ranks"][0] if plan.returncode == 0 else plan.stderr[-500:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny fp32 shapes on CPU (no GPU needed)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=None, help="override T (default 16384)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-main-job", action="store_true", help="skip the 20-step main job")
    args = ap.parse_args(argv)
    if args.dry_run:
        shapes, device, dtype = DRY, "cpu", torch.float32
    else:
        if not torch.cuda.is_available():
            print("bench_gpu: CUDA is not available (torch " + torch.__version__ + "); this benchmark needs one "
                  "CUDA GPU. Use --dry-run to check the script on CPU with tiny shapes.", file=sys.stderr)
            return 2
        shapes, device, dtype = Shapes(), "cuda", torch.bfloat16
    if args.tokens:
        shapes = Shapes(**{**asdict(shapes), "T": args.tokens})
    torch.manual_seed(0)
    r = run(shapes, device, dtype, args.warmup, args.reps)
    r["meta"] = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=torch.cuda.get_device_name() if device == "cuda"
                     else f"cpu ({os.cpu_count()} cores)", dtype=str(dtype), torch=torch.__version__,
                     transformers=__import__("transformers").__version__, machine=platform.platform(),
                     warmup=args.warmup, reps=args.reps, command=" ".join(["python"] + sys.argv))
    report(r)
    if not args.no_main_job:
        r["main_job"] = main_job(device, args.dry_run)
        print(json.dumps(r["main_job"]["final"]))
    path = args.out or f"benchmarks/out/gpu{'_dry_run' if args.dry_run else ''}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
