"""Per-call overhead of the warm rank pool vs fresh ranks (``fmoe.testing.Pool`` vs ``spawn``).

A trivial rank function (one all-reduce of a scalar) on ``--world`` ranks: the time of a call
is then all overhead (process start and imports for ``spawn``; a fresh process group, the task
round trip and the state reset for ``Pool.run``). Prints one JSON object with the medians.

    python benchmarks/bench_pool.py --world 4 --pool-calls 50 --spawn-calls 3
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch

from fmoe.testing import Pool, spawn


def trivial(rank: int, world: int) -> float:
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--pool-calls", type=int, default=50)
    ap.add_argument("--spawn-calls", type=int, default=3)
    args = ap.parse_args()
    want = [float(sum(range(args.world)))] * args.world
    spawn_s = []
    for _ in range(args.spawn_calls):
        t0 = time.perf_counter()
        assert spawn(trivial, args.world, timeout=600) == want
        spawn_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    with Pool(args.world) as pool:
        start_s = time.perf_counter() - t0
        pool_s = []
        for _ in range(args.pool_calls):
            t0 = time.perf_counter()
            assert pool.run(trivial, timeout=600) == want
            pool_s.append(time.perf_counter() - t0)
    print(json.dumps({
        "world": args.world, "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "spawn_call_s": {"median": statistics.median(spawn_s), "all": spawn_s},
        "pool_start_s": start_s,
        "pool_call_ms": {"median": 1e3 * statistics.median(pool_s), "min": 1e3 * min(pool_s),
                         "max": 1e3 * max(pool_s), "calls": len(pool_s)},
    }, indent=1))


if __name__ == "__main__":
    main()
