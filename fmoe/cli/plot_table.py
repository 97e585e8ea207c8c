"""``fmoe plot --table RUN...``: a study's summary table, one row per arm, mean ± sd over seeds.

Runs are grouped into arms by their settings (:func:`fmoe.cli.plot_metric.settings_label`: model,
router, mesh, balancing; not the seed), and each run contributes its last values:

- **held-out loss**: the last ``eval_loss``;
- **training loss**: the mean of the last 20 logged steps' ``loss``;
- **drop rate**, **MaxVio** (after dropping) and **MaxVio routed** (before): the last held-out
  value (``eval_drop_rate``, ``eval_maxvio``, ``eval_maxvio_routed``) where logged, else the last
  training row's, each the mean over the MoE layers;
- **uses future tokens**: marked ``*`` when the router's held-out loss routed with later tokens
  (expert choice: ``eval_uses_future_tokens``).

Each cell is the mean ± the sample standard deviation over the arm's runs (the mean alone for one
run, ``—`` where no run logged it). The table is Markdown, printed on stdout: the one in
``docs/routing-research.md`` and notebook 06's are made this way.

Example:
    >>> print(format_table([{"arm": "a", "n": 2, "cells": {"held-out loss": [2.0, 2.2]}}], ["held-out loss"]))
    | arm | runs | held-out loss |
    |---|---|---|
    | a | 2 | 2.100 ± 0.141 |
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

from .plot_metric import latest_meta, log_rows, settings_label

__all__ = ["COLUMNS", "run_summary", "study_rows", "format_table", "study_table"]

#: column -> (held-out key, training key), read as the mean over the layers of the last row with it
COLUMNS = {"held-out loss": ("eval_loss", None), "training loss": (None, "loss"),
           "drop rate": ("eval_drop_rate", "drop_rate"), "MaxVio": ("eval_maxvio", "maxvio"),
           "MaxVio routed": ("eval_maxvio_routed", "maxvio_routed")}


def _mean(v) -> Optional[float]:
    if isinstance(v, list):
        v = [x for x in v if isinstance(x, (int, float))]
        return sum(v) / len(v) if v else None
    return float(v) if isinstance(v, (int, float)) else None


def _last(rows: list, key: Optional[str]) -> Optional[float]:
    for row in reversed(rows):
        if key is not None and _mean(row.get(key)) is not None:
            return _mean(row[key])
    return None


def run_summary(out: str) -> dict:
    """``{"arm": label, "cells": {column: value or None}, "future": bool}`` of one run directory."""
    rows = list(log_rows(out))
    cells = {}
    for col, (held, train) in COLUMNS.items():
        if col == "training loss":
            tail = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))][-20:]
            cells[col] = sum(tail) / len(tail) if tail else None
        else:
            cells[col] = _last(rows, held) if _last(rows, held) is not None else _last(rows, train)
    future = bool(_last(rows, "eval_uses_future_tokens"))
    return {"arm": settings_label({"out": out, "meta": latest_meta(out)}), "cells": cells, "future": future}


def study_rows(outs: Sequence[str]) -> list[dict]:
    """One ``{"arm", "n", "cells": {column: [values]}}`` per arm, in the order arms first appear."""
    arms: dict[str, dict] = {}
    for out in outs:
        s = run_summary(out)
        name = s["arm"] + (" *" if s["future"] else "")
        arm = arms.setdefault(name, {"arm": name, "n": 0, "cells": {c: [] for c in COLUMNS}})
        arm["n"] += 1
        for col, v in s["cells"].items():
            if v is not None:
                arm["cells"][col].append(v)
    return list(arms.values())


def _cell(values: list) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def format_table(rows: list[dict], columns: Sequence[str]) -> str:
    """The Markdown table of :func:`study_rows` (only ``columns``)."""
    lines = ["| arm | runs | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['n']} | " + " | ".join(_cell(r["cells"].get(c, [])) for c in columns) + " |")
    return "\n".join(lines)


def study_table(outs: Sequence[str]) -> str:
    """The study table of run directories: the columns some run logged (module docstring)."""
    rows = study_rows(outs)
    columns = [c for c in COLUMNS if any(r["cells"][c] for r in rows)]
    note = "\n\n`*`: held-out loss routed with later tokens (expert choice): optimistic against causal arms." \
        if any(r["arm"].endswith(" *") for r in rows) else ""
    return format_table(rows, columns) + note
