"""Intra-op threads of the main job: median step time of ``fmoe train`` per ``--threads``.

Runs the job (qwen3_moe ``small``, one process by default) once per thread setting, 8 steps,
and prints the median step time of steps 3..8 from its ``log.jsonl`` (``auto``: the job's own
default, :mod:`fmoe.training.threads`), with the machine's cores and load average at start.

    PYTHONPATH=. python benchmarks/bench_threads.py --threads 1 2 auto [--nproc 1]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", nargs="+", default=["1", "2", "auto"])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    print(f"cores {len(os.sched_getaffinity(0))}, nproc {args.nproc}")
    for t in args.threads:
        with tempfile.TemporaryDirectory() as out:
            load = os.getloadavg()[0]
            flags = [] if t == "auto" else ["--threads", t]
            subprocess.run([sys.executable, "-m", "fmoe", "train", "--model", "qwen3_moe", "--preset", "small",
                            "--steps", str(args.steps), "--batch", "4", "--seq", "64", "--nproc", str(args.nproc),
                            "--ep", str(args.nproc), "--quiet", "--out", out, *flags], check=True, env=env,
                           capture_output=True)
            rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
            meta = json.load(open(os.path.join(out, f"step-{args.steps}", "meta.json")))
            step = statistics.median(r["step_time"] for r in rows[2:])
            print(f"--threads {t:>4} (ran {meta['threads']}): median step {step:.3f} s   (load average at start {load:.1f})")


if __name__ == "__main__":
    main()
