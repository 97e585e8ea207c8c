"""Sharded checkpoint loading: bytes read and peak memory per rank, slice reads vs full reads.

Builds a random fp32 toy MoE checkpoint (>= 200 MB by default, per-expert keys as
``save_pretrained`` writes them, split into ~100 MB files with an index) in a temporary
directory, then on ``--world`` gloo ranks measures per rank, each mode in fresh processes:

- ``sharded``: ``fmoe.checkpoint.load_hf(model, ckpt, mesh)``: each rank reads only its blocks;
- ``full``: ``load_hf(model, ckpt)`` (every tensor whole) then ``fmoe.shard(full, plan, mesh)``,
  the load-everything-then-slice baseline.

Reported per rank: bytes of tensor data read (``Checkpoint.bytes_read``), peak RSS increase over
the load and wall time. The peak is the kernel's RSS high-water mark (``VmHWM``), reset just
before the load by writing ``5`` to ``/proc/self/clear_refs``, minus the RSS at that moment; it
includes the pages of the memory-mapped files that the reads touched. (``ru_maxrss`` cannot be
reset, and the import of torch already set a higher mark than a sharded load reaches.) Where
``clear_refs`` is not writable the ``ru_maxrss`` delta is reported instead (``rss_method``). Both modes end with identical
parameters (checked by a per-rank checksum).

Usage::

    python benchmarks/bench_load.py                  # 4 ranks, Mesh(tp=2, ep=4), ~243 MB
    python benchmarks/bench_load.py --experts 8 --layers 1    # smaller
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time

import torch

import fmoe
from fmoe import P, Plan
from fmoe.checkpoint import Cat, Checkpoint, Key, Stack, load_hf, save_hf
from fmoe.testing import spawn


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 8192
    dim: int = 512
    inter: int = 1024
    experts: int = 16
    layers: int = 2

    @classmethod
    def from_hf(cls, d):
        return cls(d["vocab_size"], d["hidden_size"], d["moe_intermediate_size"], d["num_experts"],
                   d["num_hidden_layers"])

    def to_hf(self):
        return {"model_type": "bench_moe", "architectures": ["BenchMoeForCausalLM"], "vocab_size": self.vocab,
                "hidden_size": self.dim, "moe_intermediate_size": self.inter, "num_experts": self.experts,
                "num_hidden_layers": self.layers}


def hf_specs(cfg, keys=None):
    """fmoe paths -> specs: dense attention, router, fused per-layer expert weights."""
    V, D, I, E = cfg.vocab, cfg.dim, cfg.inter, cfg.experts
    specs = {"embed": Key("model.embed_tokens.weight", (V, D)), "norm": Key("model.norm.weight", (D,)),
             "lm_head": Key("lm_head.weight", (V, D))}
    for i in range(cfg.layers):
        L = f"model.layers.{i}"
        for n in "qkvo":
            specs[f"layers.{i}.attn.w{n}"] = Key(f"{L}.self_attn.{n}_proj.weight", (D, D))
        specs[f"layers.{i}.moe.router"] = Key(f"{L}.mlp.gate.weight", (E, D))
        ex = lambda n, s: Stack([Key(f"{L}.mlp.experts.{e}.{n}.weight", s) for e in range(E)])  # noqa: E731
        specs[f"layers.{i}.moe.w_gate_up"] = Cat([ex("gate_proj", (I, D)), ex("up_proj", (I, D))], dim=1)
        specs[f"layers.{i}.moe.w_down"] = ex("down_proj", (D, I))
    return specs


def plan(cfg):
    return Plan({"embed": "vocab", "lm_head": P(("fsdp", "tp"), None), "layers.*.attn.w[qkv]": "colwise",
                 "layers.*.attn.wo": "rowwise", "layers.*.moe.w_*": P("ep", None, None), "**": P()})


model = sys.modules[__name__]


def init(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return fmoe.tree.unflatten({p: torch.randn(s.shape, generator=g) * 0.02 for p, s in hf_specs(cfg).items()})


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e6                    # kB (KiB) -> MB
    raise KeyError(field)


def _reset_peak() -> tuple[str, float]:
    """Start a peak-RSS measurement: (method, baseline MB)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                                    # reset VmHWM to VmRSS
        return "VmHWM", _status_mb("VmRSS")
    except OSError:
        return "ru_maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def _peak_mb(method: str) -> float:
    if method == "VmHWM":
        return _status_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def _measure(rank, world, path, mode, tp, ep):
    import gc

    import bench_load as bench

    mesh = fmoe.Mesh(tp=tp, ep=ep)
    gc.collect()
    method, rss0 = _reset_peak()
    file0 = _status_mb("RssFile")
    t0 = time.perf_counter()
    with Checkpoint(path) as ck:
        if mode == "sharded":
            params, cfg = load_hf(bench, ck, mesh)
        else:
            full, cfg = load_hf(bench, ck)
            params = fmoe.shard(full, bench.plan(cfg), mesh)
            del full
        read = ck.bytes_read
        mapped = _status_mb("RssFile") - file0          # file pages the reads touched, still mapped
    seconds = time.perf_counter() - t0
    local = [fmoe.to_local(t) for t in fmoe.tree.leaves(params)]
    return {"rank": rank, "mode": mode, "bytes_read": read, "peak_rss_delta_mb": _peak_mb(method) - rss0,
            "rss_method": method, "mapped_file_mb": mapped,
            "seconds": seconds, "local_param_bytes": sum(t.numel() * t.element_size() for t in local),
            "checksum": float(sum(t.double().abs().sum() for t in local))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--shard-size", default="100MB", help="max safetensors file size of the checkpoint")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "bench_load.json"))
    args = ap.parse_args(argv)
    cfg = Config(args.vocab, args.dim, args.inter, args.experts, args.layers)
    root = tempfile.mkdtemp(prefix="fmoe-bench-load-")
    try:
        path = os.path.join(root, "ckpt")
        t0 = time.perf_counter()
        save_hf(model, init(cfg), cfg, path, max_shard_size=args.shard_size)
        save_s = time.perf_counter() - t0
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        total = sum(os.path.getsize(os.path.join(path, f)) for f in files)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # ranks import this module by name
        rows = []
        for mode in ("full", "sharded"):
            rows += spawn(_measure, args.world, path, mode, args.tp, args.ep, timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in range(args.world):
        a, b = rows[r], rows[args.world + r]
        if abs(a["checksum"] - b["checksum"]) > 0 or a["local_param_bytes"] != b["local_param_bytes"]:
            raise RuntimeError(f"rank {r}: full and sharded loads disagree: {a} vs {b}")
    print(f"checkpoint: {total / 1e6:.1f} MB in {len(files)} files (written by save_hf in {save_s:.1f} s); "
          f"{args.world} gloo ranks, Mesh(tp={args.tp}, ep={args.ep})")
    print(f"{'mode':8} {'rank':>4} {'read MB':>9} {'of ckpt':>8} {'held MB':>8} {'peak RSS +MB':>13} "
          f"{'mapped MB':>10} {'time s':>7}")
    for r in rows:
        print(f"{r['mode']:8} {r['rank']:>4} {r['bytes_read'] / 1e6:>9.1f} {r['bytes_read'] / total:>8.1%} "
              f"{r['local_param_bytes'] / 1e6:>8.1f} {r['peak_rss_delta_mb']:>13.1f} {r['mapped_file_mb']:>10.1f} "
              f"{r['seconds']:>7.2f}")
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} vCPU, {platform.system()} {platform.release()}",
              "command": "python benchmarks/bench_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "torch": torch.__version__, "config": dataclasses.asdict(cfg), "world": args.world,
              "mesh": {"tp": args.tp, "ep": args.ep}, "checkpoint_bytes": total, "files": len(files),
              "rows": rows}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
