"""``fmoe plot OUT [OUT ...] --out runs.png``: training curves of one or several runs.

Reads each run directory's ``log.jsonl`` (one JSON object per step, written by the main job) and
the ``meta.json`` of its latest checkpoint, and draws panels against the step: training loss,
held-out loss (``eval_loss``, where logged), load imbalance (max / mean expert load) and tokens
per second, then the routing panels of :data:`OPTIONAL` for the keys some run logged: drop rate
(capacity routers), MaxVio after dropping and before it (``maxvio_routed``), and each rank's step
time (``rank_step_time``). A value per MoE layer or per rank is drawn as a band from the best to
the worst layer (rank) and their mean as the line, so a dead layer beside a healthy one shows
(a drop rate of 1.0 and 0.0: the band spans 0..1 around the mean 0.5). Each run has one colour in
every panel and one legend entry, beside the panels: its directory, then model, router, mesh and
balancing from its ``meta.json``. A run without a panel's key has
no line there, and a note on stderr says so. Drawn with
matplotlib's non-interactive Agg backend (no display needed). The image is written to a
temporary file beside it and renamed into place (never through a link); the default
``runs.png`` is never overwritten silently (pass ``--out``). ``--table`` prints a study's summary
table instead (:mod:`fmoe.cli.plot_table`: one row per arm, mean ± sd over its seeds).

Example:
    >>> import json, tempfile
    >>> out = tempfile.mkdtemp()                        # a run directory with two logged steps
    >>> with open(os.path.join(out, "log.jsonl"), "w") as f:
    ...     for step, loss in [(1, 2.5), (2, 2.0)]:
    ...         print(json.dumps({"step": step, "loss": loss}), file=f)
    >>> fig = plot_runs([out], os.path.join(out, "runs.png"))      # panels without data: a note on stderr
    >>> type(fig).__name__, os.path.isfile(os.path.join(out, "runs.png"))
    ('Figure', True)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .plot_metric import latest_meta, log_rows, plot_metric, pyplot, save_png, settings_label
from .plot_table import study_table

__all__ = ["load_run", "label", "plot_runs", "main", "PANELS", "OPTIONAL", "PER_RANK", "DEFAULT_OUT"]

DEFAULT_OUT = "runs.png"

#: (metric key in log.jsonl, panel title)
PANELS = (("loss", "training loss"), ("eval_loss", "held-out loss"), ("load_imbalance", "load imbalance (max/mean)"),
          ("tokens_per_s", "tokens / s"))
#: panels drawn only when some run logged the key (routing studies; per-layer keys: a band over the layers)
OPTIONAL = (("drop_rate", "drop rate (tokens no expert takes)"), ("maxvio", "MaxVio after dropping"),
            ("maxvio_routed", "MaxVio before dropping (routed)"))
#: optional panels of one value per rank (fmoe.training.observe): a min-max band over the ranks and their mean
PER_RANK = (("rank_step_time", "step time per rank, s (min-max band, mean)"),)


def load_run(out: str) -> dict:
    """``{"steps": {metric: ([step...], [value...])}, "meta": dict}`` of a run directory (a
    per-layer or :data:`PER_RANK` metric's value: the list of the layers' or ranks' values).

    Raises:
        ValueError: ``out`` has no ``log.jsonl`` or a line is not JSON.
    """
    series: dict[str, tuple[list, list]] = {k: ([], []) for k, _ in PANELS + OPTIONAL + PER_RANK}
    for row in log_rows(out):
        for key, _ in PER_RANK:                            # [value per rank], kept whole
            v = row.get(key)
            if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v) and "step" in row:
                series[key][0].append(row["step"])
                series[key][1].append([float(x) for x in v])
        for key, _ in PANELS + OPTIONAL:
            v = row.get(key)
            if isinstance(v, list):                        # per MoE layer: kept whole (a band)
                v = [float(x) for x in v] if v and all(isinstance(x, (int, float)) for x in v) else None
            if isinstance(v, (int, float, list)) and "step" in row:
                series[key][0].append(row["step"])
                series[key][1].append(v if isinstance(v, list) else float(v))
    return {"steps": series, "meta": latest_meta(out), "out": out}


def label(run: dict) -> str:
    """``OUT: model, router, mesh, balance`` from a run's directory and meta.json (the directory
    alone when there is none; :func:`fmoe.cli.plot_metric.settings_label`)."""
    name = os.path.normpath(run["out"])
    return f"{name}: {settings_label(run)}" if run["meta"] else name


def plot_runs(outs: Sequence[str], path: str, title: Optional[str] = None):
    """Draw the runs' curves into ``path`` (PNG); returns the matplotlib Figure.

    Args:
        outs: run directories (``--out`` of the main job).
        path: image file to write.
        title: figure title.
    """
    plt = pyplot()

    from matplotlib.lines import Line2D

    _check_out(path)
    runs = [load_run(o) for o in outs]
    colors = [f"C{i % 10}" for i in range(len(runs))]           # one colour per run, in every panel
    panels = PANELS + tuple(p for p in OPTIONAL + PER_RANK if any(r["steps"][p[0]][0] for r in runs))
    for key, _ in panels[len(PANELS):]:
        for run in runs:
            if not run["steps"][key][0]:
                print(f"fmoe plot: note: {run['out']} logged no {key!r}; no line in that panel", file=sys.stderr)
    rows = -(-len(panels) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(16, 3.5 * rows), sharex=True, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (key, name) in zip(axes.flat, panels):
        for run, color in zip(runs, colors):
            xs, ys = run["steps"][key]
            if xs and any(isinstance(v, list) for v in ys):   # layers' (ranks') spread, and their mean
                ys = [v if isinstance(v, list) else [v] for v in ys]
                ax.fill_between(xs, [min(v) for v in ys], [max(v) for v in ys], color=color, alpha=0.25,
                                linewidth=0)
                ax.plot(xs, [sum(v) / len(v) for v in ys], label=label(run), color=color)
            elif xs:
                ax.plot(xs, ys, marker="o" if key == "eval_loss" else None, markersize=3, label=label(run),
                        color=color)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    handles = [Line2D([], [], color=c) for c in colors]           # every run, whatever it logged
    fig.suptitle(title or "fmoe training runs")
    fig.tight_layout(rect=(0, 0, 0.68, 1))                       # the legend beside the panels
    fig.legend(handles, [label(r) for r in runs], loc="center left", bbox_to_anchor=(0.685, 0.5), fontsize=7)
    save_png(fig, path)
    plt.close(fig)
    return fig


def _check_out(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--out {path!r}: the directory {folder!r} does not exist")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``fmoe plot``; returns the exit code (2: a bad run or --out)."""
    ap = argparse.ArgumentParser(prog="fmoe plot", description="Plot training runs of fmoe train.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("outs", nargs="+", metavar="OUT", help="run directories (each with log.jsonl)")
    ap.add_argument("--out", default=None, help=f"image to write (default: {DEFAULT_OUT}, never overwritten: "
                                                "an existing one needs --out)")
    ap.add_argument("--title", default=None, help="figure title (default: fmoe training runs)")
    ap.add_argument("--metric", default=None, help="draw this log.jsonl key alone (e.g. maxvio, eval_maxvio; "
                    "fmoe.cli.plot_metric) instead of the four panels")
    ap.add_argument("--log", action="store_true", help="with --metric: logarithmic y axis")
    ap.add_argument("--smooth", type=int, default=1, metavar="N", help="with --metric: trailing mean over N points")
    ap.add_argument("--per-layer", action="store_true", help="with --metric: one line per MoE layer")
    ap.add_argument("--table", action="store_true", help="print the study table instead of drawing: one row per arm "
                    "(runs of the same settings), held-out loss, training loss, drop rate, MaxVio, mean +- sd over "
                    "the runs (fmoe.cli.plot_table)")
    args = ap.parse_args(argv)
    path = args.out or DEFAULT_OUT
    if args.table:
        try:
            print(study_table(args.outs))
        except ValueError as e:
            print(f"fmoe plot: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        if args.out is None and os.path.lexists(DEFAULT_OUT):
            raise ValueError(f"{DEFAULT_OUT} exists; pass --out {DEFAULT_OUT} to replace it, or another --out")
        if args.metric:
            _check_out(path)
            plot_metric(args.outs, path, args.metric, log=args.log, smoothing=args.smooth,
                        per_layer=args.per_layer, title=args.title)
        else:
            plot_runs(args.outs, path, args.title)
    except ValueError as e:
        print(f"fmoe plot: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:                          # matplotlib missing: the plot extra
        print(f"fmoe plot: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"fmoe plot: error: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", file=sys.stderr)
        return 1
    print(path)
    return 0

