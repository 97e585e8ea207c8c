"""Watching a run: every rank's step time and bytes sent, a profiler window, a TensorBoard sink.

The job's log is written by rank 0, but a slow or chatty rank is another rank's problem, so each
step is measured on every rank (:meth:`Observer.step`: wall time of the train step, and the bytes
its collectives send, :func:`fmoe.collectives.counting`) and the measurements are gathered into
rank 0's log row (:meth:`Observer.rank_lists`, one small all-gather per step)::

    {"step": 3, "loss": 5.1, ..., "rank_step_time": [0.21, 0.22], "sent_bytes": [181000, 181000],
     "sent_bytes_by_kind": {"all_gather": [120000, 120000], "reduce_scatter": [61000, 61000]}}

``--profile-steps A:B`` runs steps A to B (inclusive) under :class:`torch.profiler.profile` and
writes one Chrome trace per rank, ``OUT/profile/rank-R.json`` (``chrome://tracing``, Perfetto,
TensorBoard's profiler plugin). ``--tensorboard`` also writes rank 0's numeric log values as
TensorBoard scalars in ``OUT/tensorboard`` (``torch.utils.tensorboard``; the optional extra
``pip install 'fmoe[tensorboard]'``).

Example:
    >>> parse_steps("3:5")
    (3, 5)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from typing import Any, Iterator, Optional

from ..collectives import all_gather_rows, counting
from ..collectives.counting import KINDS

__all__ = ["Observer", "parse_steps", "check_tensorboard", "INDEXED_BY"]

#: what a log row's list is indexed by, when not by MoE layer (maxvio, expert_bias_absmax, ...)
INDEXED_BY = {"rank_step_time": "rank", "sent_bytes": "rank", "pp_idle": "stage"}


def parse_steps(text: str, flag: str = "--profile-steps") -> tuple[int, int]:
    """``"A:B"`` -> ``(A, B)``, the first and last step of a window (1 <= A <= B).

    Raises:
        ValueError: naming ``flag``, the value and what is valid.
    """
    parts = text.split(":") if isinstance(text, str) else []
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[1]):
        raise ValueError(f"{flag} must be A:B, the first and last step profiled (1 <= A <= B), got {text!r}")
    return int(parts[0]), int(parts[1])


def check_tensorboard(flag: str = "--tensorboard") -> None:
    """Raise ``ValueError`` naming ``flag`` and the extra to install when TensorBoard is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"{flag} needs the tensorboard package, which is not installed: "
                         "pip install 'fmoe[tensorboard]'")


def _own_dir(out: str, name: str) -> str:
    """``OUT/name``, made if missing; never a symbolic link (the job refuses one before it starts,
    :func:`fmoe.training.outdir.links`; this catches one planted since)."""
    path = os.path.join(out, name)
    if os.path.islink(path):
        raise OSError(f"{path} is a symbolic link; fmoe train never writes through a link")
    os.makedirs(path, exist_ok=True)
    return path


class Observer:
    """One rank's view of the run's measurements (module docstring).

    Args:
        out: the run directory.
        rank: this rank.
        profile_steps: ``"A:B"`` or None.
        tensorboard: write rank 0's rows as TensorBoard scalars too.
        device: the device the job's collectives run on (NCCL gathers CUDA tensors).
        start: the step a resumed run continues from (its TensorBoard steps after it are purged).
    """

    def __init__(self, out: str, rank: int, profile_steps: Optional[str] = None, tensorboard: bool = False,
                 device: Any = "cpu", start: int = 0):
        self.out, self.rank, self.device = out, rank, device
        self.window = parse_steps(profile_steps) if profile_steps else None
        self.profiler: Any = None
        self.writer: Any = None
        if tensorboard and rank == 0:
            check_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run trains steps start+1.. again: TensorBoard drops what an earlier run wrote from there
            self.writer = SummaryWriter(_own_dir(out, "tensorboard"), purge_step=start + 1 if start else None)
        self.step_time = 0.0
        self.sent: dict = {}

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Measure one train step on this rank (and profile it when in the window)."""
        if self.window and step == self.window[0]:
            import torch.profiler

            self.profiler = torch.profiler.profile(record_shapes=True)
            self.profiler.__enter__()
        start = time.perf_counter()
        with counting() as sent:
            yield
        self.step_time = time.perf_counter() - start
        self.sent = dict(sent.by_kind)
        if self.profiler is not None and step >= self.window[1]:
            self._export()

    def _export(self) -> None:
        self.profiler.__exit__(None, None, None)
        trace = os.path.join(_own_dir(self.out, "profile"), f"rank-{self.rank}.json")
        if os.path.islink(trace):
            raise OSError(f"{trace} is a symbolic link; fmoe train never writes through a link")
        self.profiler.export_chrome_trace(trace)
        self.profiler = None

    def rank_lists(self) -> dict:
        """Every rank's last step time and bytes sent, in rank order (call on every rank: one
        all-gather of ``[time, bytes of each kind]`` in float64, exact for byte counts below 2**53)."""
        import torch
        import torch.distributed as dist

        mine = torch.tensor([[self.step_time] + [float(self.sent.get(k, 0)) for k in KINDS]], dtype=torch.float64)
        every = all_gather_rows(mine.to(self.device), dist.group.WORLD).cpu() if dist.is_initialized() else mine
        times, sent = every[:, 0].tolist(), every[:, 1:].to(torch.int64)
        by_kind = {k: sent[:, i].tolist() for i, k in enumerate(KINDS) if bool(sent[:, i].any())}
        return {"rank_step_time": [round(t, 6) for t in times], "sent_bytes": sent.sum(1).tolist(),
                "sent_bytes_by_kind": by_kind}

    def write(self, row: dict) -> None:
        """Rank 0: the row's numbers as TensorBoard scalars; a list as one tag per entry, named by
        what it is indexed by (:data:`INDEXED_BY`: ``rank_step_time/rank-R``, ``pp_idle/stage-S``,
        ``maxvio/layer-L``)."""
        if self.writer is None:
            return
        step = row["step"]
        for name, value in row.items():
            if isinstance(value, bool) or name == "step":
                continue
            if isinstance(value, (int, float)):
                self.writer.add_scalar(name, value, step)
            elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                index = INDEXED_BY.get(name, "layer")
                for r, v in enumerate(value):
                    self.writer.add_scalar(f"{name}/{index}-{r}", v, step)
        self.writer.flush()

    def close(self) -> None:
        """End a profile cut short (the run ended inside the window) and the TensorBoard file."""
        if self.profiler is not None:
            self._export()
        if self.writer is not None:
            self.writer.close()
