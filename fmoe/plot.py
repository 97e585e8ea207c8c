"""``python -m fmoe.plot OUT [OUT ...] --out runs.png``: training curves of one or several runs.

Reads each run directory's ``log.jsonl`` (one JSON object per step, written by the main job) and
the ``meta.json`` of its latest checkpoint, and draws four panels against the step: training
loss, held-out loss (``eval_loss``, where logged), load imbalance (max / mean expert load,
averaged over MoE layers) and tokens per second. Each run is labelled by its ``meta.json``:
model, router and mesh. Drawn with matplotlib's non-interactive Agg backend (no display needed).

Example:
    >>> # fig = plot_runs(["runs/a", "runs/b"], "runs.png")
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Optional, Sequence

__all__ = ["load_run", "label", "plot_runs", "main", "PANELS"]

#: (metric key in log.jsonl, panel title)
PANELS = (("loss", "training loss"), ("eval_loss", "held-out loss"), ("load_imbalance", "load imbalance (max/mean)"),
          ("tokens_per_s", "tokens / s"))


def load_run(out: str) -> dict:
    """``{"steps": {metric: ([step...], [value...])}, "meta": dict}`` of a run directory.

    Raises:
        ValueError: ``out`` has no ``log.jsonl`` or a line is not JSON.
    """
    path = os.path.join(out, "log.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"fmoe.plot: {out!r} has no log.jsonl (not a run directory of python -m fmoe.train)")
    series: dict[str, tuple[list, list]] = {k: ([], []) for k, _ in PANELS}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"fmoe.plot: {path} line {n} is not JSON ({e.msg})") from None
            for key, _ in PANELS:
                v = row.get(key)
                if isinstance(v, list):                        # per MoE layer: the layers' mean
                    v = sum(v) / len(v) if v else None
                if isinstance(v, (int, float)) and "step" in row:
                    series[key][0].append(row["step"])
                    series[key][1].append(float(v))
    meta = {}
    steps = sorted(glob.glob(os.path.join(out, "step-*", "meta.json")),
                   key=lambda p: int(re.findall(r"step-(\d+)", p)[-1]))
    if steps:
        with open(steps[-1]) as f:
            meta = json.load(f)
    return {"steps": series, "meta": meta, "out": out}


def label(run: dict) -> str:
    """``model, router, mesh`` from a run's meta.json (the directory name when there is none)."""
    meta = run["meta"]
    if not meta:
        return os.path.basename(os.path.normpath(run["out"]))
    mesh = meta.get("mesh", {})
    axes = " ".join(f"{k}={mesh[k]}" for k in ("tp", "ep", "fsdp", "dp_replicate") if k in mesh)
    return f"{meta.get('model', '?')}, router {meta.get('router') or 'default'}, {axes}"


def plot_runs(outs: Sequence[str], path: str, title: Optional[str] = None):
    """Draw the runs' curves into ``path`` (PNG); returns the matplotlib Figure.

    Args:
        outs: run directories (``--out`` of the main job).
        path: image file to write.
        title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(o) for o in outs]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (key, name) in zip(axes.flat, PANELS):
        for run in runs:
            xs, ys = run["steps"][key]
            if xs:
                ax.plot(xs, ys, marker="o" if key == "eval_loss" else None, markersize=3, label=label(run))
        ax.set_title(name)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=1, fontsize=8)
    fig.suptitle(title or "fmoe training runs")
    fig.tight_layout(rect=(0, 0.04 + 0.03 * len(runs), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fmoe.plot", description="Plot training runs of python -m fmoe.train.")
    ap.add_argument("outs", nargs="+", metavar="OUT", help="run directories (each with log.jsonl)")
    ap.add_argument("--out", default="runs.png", help="image to write")
    ap.add_argument("--title", default=None)
    ap.add_argument("--metric", default=None, help="draw this log.jsonl key alone (e.g. maxvio, eval_maxvio; "
                    "fmoe.plot_metric) instead of the four panels")
    ap.add_argument("--log", action="store_true", help="with --metric: logarithmic y axis")
    ap.add_argument("--smooth", type=int, default=1, metavar="N", help="with --metric: trailing mean over N points")
    ap.add_argument("--per-layer", action="store_true", help="with --metric: one line per MoE layer")
    args = ap.parse_args(argv)
    try:
        if args.metric:
            from .plot_metric import plot_metric

            plot_metric(args.outs, args.out, args.metric, log=args.log, smoothing=args.smooth,
                        per_layer=args.per_layer, title=args.title)
        else:
            plot_runs(args.outs, args.out, args.title)
    except ValueError as e:
        print(f"fmoe.plot: error: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
