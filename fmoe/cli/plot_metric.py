"""``fmoe plot OUT... --metric maxvio --log --smooth N [--per-layer]``: one logged
metric of several runs against the step, for routing studies.

Any key of ``log.jsonl`` works (``maxvio``, ``eval_maxvio``, ``load_imbalance``, ``loss``,
``expert_bias_absmax``, ...). A per-layer metric (a list per row) is drawn as the mean over its
layers, or one line per layer with ``--per-layer``; ``--smooth N`` is a trailing mean over the
last ``N`` logged points (the first points average what exists), ``--log`` a logarithmic y axis
(non-positive values are not drawn there). Each run is labelled by its recorded settings: model, router and
mesh (as :func:`fmoe.cli.plot.label`) plus the balancing of its ``meta.json``
(``balance bias u=0.01 sign``, ``balance aux w=0.01``). A run that never logged the metric
(``drop_rate`` of a top-k run) is skipped with a note on stderr; none logging it is an error.

Example:
    >>> smooth([1.0, 3.0, 5.0], 2)
    [1.0, 2.0, 4.0]
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Optional, Sequence

from ..checkpoint.steps import step_of

__all__ = ["log_rows", "series", "smooth", "latest_meta", "settings_label", "plot_metric", "pyplot", "save_png"]


def log_rows(out: str) -> Iterator[dict]:
    """The rows of ``OUT/log.jsonl`` (blank lines skipped), in order.

    Args:
        out: a run directory of ``fmoe train``.
    Returns:
        an iterator of dicts.
    Raises:
        ValueError: ``out`` has no ``log.jsonl`` or a line is not JSON.

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> with open(os.path.join(out, "log.jsonl"), "w") as f:
        ...     for step, loss in [(1, 2.5), (2, 2.0)]:
        ...         print(json.dumps({"step": step, "loss": loss}), file=f)
        >>> [(row["step"], row["loss"]) for row in log_rows(out)]
        [(1, 2.5), (2, 2.0)]
    """
    path = os.path.join(out, "log.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"fmoe plot: {out!r} has no log.jsonl (not a run directory of fmoe train)")
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"fmoe plot: {path} line {n} is not JSON ({e.msg})") from None


def series(out: str, metric: str) -> tuple[list, list]:
    """``(steps, values)`` of ``metric`` in ``OUT/log.jsonl``; a value is a float or a per-layer list.

    Raises:
        ValueError: no ``log.jsonl`` or a line that is not JSON.
        LookupError: no row with the metric.
    """
    steps, values = [], []
    for row in log_rows(out):
        v = row.get(metric)
        if "step" in row and (isinstance(v, (int, float)) and not isinstance(v, bool) or
                              isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)):
            steps.append(row["step"])
            values.append(v)
    if not steps:
        raise LookupError(f"fmoe plot: {os.path.join(out, 'log.jsonl')} has no row with {metric!r}")
    return steps, values


def smooth(values: Sequence[float], n: int) -> list[float]:
    """Trailing mean over the last ``n`` values (``n = 1``: unchanged)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fmoe plot: --smooth must be an int >= 1, got {n!r}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def latest_meta(out: str) -> dict:
    """The ``meta.json`` of a run directory's latest ``step-N`` checkpoint ({} when none, or
    when it holds no JSON object).

    Raises:
        ValueError: the file is not readable JSON.
    """
    found = [(s, os.path.join(out, d, "meta.json")) for d in os.listdir(out)
             if (s := step_of(d)) is not None and os.path.isfile(os.path.join(out, d, "meta.json"))]
    if not found:
        return {}
    path = max(found)[1]
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    return meta if isinstance(meta, dict) else {}


def settings_label(run: dict) -> str:
    """Model, router, mesh (as :func:`fmoe.cli.plot.label`) plus the balancing settings of a run's
    ``meta.json`` (``run = {"out": dir, "meta": dict}``).

    Example:
        >>> settings_label({"out": "a", "meta": {"model": "qwen3_moe", "balance": "bias", "bias_rate": 0.01,
        ...                                      "bias_update": "sign", "mesh": {"tp": 1}}})
        'qwen3_moe, router default, tp=1, balance bias u=0.01 sign'
    """
    meta = run["meta"]
    if not meta:
        return os.path.basename(os.path.normpath(run["out"]))
    mesh = meta.get("mesh", {})
    axes = " ".join(f"{k}={mesh[k]}" for k in ("tp", "ep", "fsdp", "dp_replicate") if k in mesh)
    text = f"{meta.get('model', '?')}, router {meta.get('router') or 'default'}, {axes}"
    if meta.get("balance"):
        parts = [f"balance {meta['balance']}"]
        for key, short in (("aux_weight", "w"), ("z_weight", "z"), ("bias_rate", "u")):
            if meta.get(key) is not None:
                parts.append(f"{short}={meta[key]:g}")
        if meta.get("bias_update"):
            parts.append(meta["bias_update"])
        text += ", " + " ".join(parts)
    return text


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend; matplotlib is the ``plot`` extra.

    Raises:
        ImportError: matplotlib is not installed, saying how to install it.
    """
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ImportError("fmoe plot draws with matplotlib, which is not installed: "
                          "pip install 'fmoe[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_metric(outs: Sequence[str], path: str, metric: str, *, log: bool = False, smoothing: int = 1,
                per_layer: bool = False, title: Optional[str] = None):
    """Draw ``metric`` of the runs into ``path`` (PNG); returns the matplotlib Figure.

    Args:
        outs: run directories.
        path: image to write.
        metric: a ``log.jsonl`` key.
        log: logarithmic y axis.
        smoothing: trailing-mean window (points).
        per_layer: one line per layer for per-layer metrics (else their mean).
        title: figure title.
    """
    plt = pyplot()

    import sys

    smooth([0.0], smoothing)                                # checks the window before any work
    runs, missing = [], []
    for o in outs:
        try:
            runs.append(({"out": o, "meta": latest_meta(o)}, series(o, metric)))
        except LookupError:                                 # the run never logged it: skipped, said so
            missing.append(o)
    if not runs:
        raise ValueError(f"fmoe plot: no run logged {metric!r} ({', '.join(outs)})")
    for o in missing:
        print(f"fmoe plot: note: {o} logged no {metric!r}; skipped", file=sys.stderr)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (run, (steps, values)) in enumerate(runs):
        name, color = settings_label(run), f"C{i % 10}"
        if per_layer and isinstance(values[0], list):
            for layer in range(len(values[0])):
                ys = smooth([v[layer] for v in values], smoothing)
                ax.plot(steps, ys, color=color, alpha=0.35 + 0.65 * (layer + 1) / len(values[0]),
                        label=f"{name}, layer {layer}")
        else:
            ys = smooth([sum(v) / len(v) if isinstance(v, list) else float(v) for v in values], smoothing)
            ax.plot(steps, ys, color=color, label=name)
    if log:
        ax.set_yscale("log")
    what = "per layer" if per_layer else "mean over layers" if isinstance(runs[0][1][1][0], list) else ""
    ax.set(xlabel="step", ylabel=metric, title=title or f"{metric}" + (f" ({what})" if what else "")
           + (f", {smoothing}-point mean" if smoothing > 1 else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return fig


def save_png(fig, path: str) -> None:
    """PNG into a temporary file beside ``path``, then one rename (a link at ``path`` is replaced,
    never written through). The one way ``fmoe plot`` writes an image."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, dpi=100, format="png")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
