"""Rank layout: how ``tp``, ``fsdp``, ``dp_replicate`` and ``ep`` share the same processes.

Two meshes are laid over the same ``world = dp_replicate * fsdp * tp`` ranks:

- the **dense** mesh ``(dp_replicate, fsdp, tp)``: ``tp`` consecutive ranks form a tensor-parallel
  group and hold the same batch; the batch a rank holds depends only on its fsdp (and replica)
  index;
- the **expert** mesh ``(dp_replicate, efsdp, ep)``: ``ep`` consecutive ranks hold one full set
  of experts (rank ``r`` of the group owns experts ``[r*E/ep, (r+1)*E/ep)``) and run the
  all-to-all together; ``efsdp = fsdp * tp / ep`` copies of that set exist, and the ranks at
  the same position in different copies form the ``efsdp`` group.

``ep`` adds no processes. It must be a multiple of ``tp`` (a TP group never straddles two expert
groups) and divide ``fsdp * tp``. Eight ranks with ``tp=2``::

    rank     0     1     2     3     4     5     6     7
    batch    [ B0 ]      [ B1 ]      [ B2 ]      [ B3 ]
    ep=2     E0-3  E4-7  E0-3  E4-7  E0-3  E4-7  E0-3  E4-7    efsdp=4
    ep=4     E0E1  E2E3  E4E5  E6E7  E0E1  E2E3  E4E5  E6E7    efsdp=2
    ep=8     E0    E1    E2    E3    E4    E5    E6    E7      efsdp=1

Both meshes are torch ``DeviceMesh``es (when ``torch.distributed`` is initialised), so sharded
parameters can be DTensors; :meth:`Mesh.group` hands out their process groups.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

__all__ = ["Mesh", "DENSE_AXES", "EXPERT_AXES", "AXES", "DATA_AXES"]

DENSE_AXES = ("dp_replicate", "fsdp", "tp")
EXPERT_AXES = ("dp_replicate", "efsdp", "ep")
AXES = ("dp_replicate", "fsdp", "tp", "efsdp", "ep")
DATA_AXES = ("fsdp", "dp_replicate", "efsdp")   # axes whose ranks hold different batches


def rank_coords(rank: int, *, tp: int, fsdp: int, dp_replicate: int, ep: int) -> dict[str, int]:
    """The coordinates of global ``rank`` on every axis of both meshes: the one rank layout
    (dense ``(dp_replicate, fsdp, tp)`` and expert ``(dp_replicate, efsdp, ep)``, tp fastest).

    Example:
        >>> rank_coords(5, tp=2, fsdp=2, dp_replicate=2, ep=4)
        {'tp': 1, 'fsdp': 0, 'dp_replicate': 1, 'ep': 1, 'efsdp': 0}
    """
    efsdp = fsdp * tp // ep
    return {"tp": rank % tp, "fsdp": (rank // tp) % fsdp, "dp_replicate": rank // (tp * fsdp),
            "ep": rank % ep, "efsdp": (rank // ep) % efsdp}


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Mesh: {name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"Mesh: {name} must be >= 1, got {name}={value}")
    return value


class Mesh:
    """The process layout of one job: sizes, coordinates and process groups per axis.

    Args:
        tp: tensor-parallel size (consecutive ranks).
        ep: expert-parallel size (consecutive ranks holding one full expert set); default
            ``tp``, the smallest valid size (so a dense model only says ``Mesh(tp=2)``).
        fsdp: data-parallel shards; default ``world // (tp * dp_replicate)``.
        dp_replicate: HSDP replicas (outermost).

    Build it on every rank after ``torch.distributed.init_process_group`` (without a process
    group the world is one process and every size must be 1).

    Example:
        >>> mesh = Mesh()                       # single process
        >>> (mesh.tp, mesh.fsdp, mesh.ep, mesh.efsdp)
        (1, 1, 1, 1)
        >>> mesh.expert_range(8)
        range(0, 8)
    """

    def __init__(self, tp: int = 1, ep: Optional[int] = None, fsdp: Optional[int] = None,
                 dp_replicate: int = 1):
        tp = _check_size("tp", tp)
        ep = _check_size("ep", tp if ep is None else ep)
        dp_replicate = _check_size("dp_replicate", dp_replicate)
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        if fsdp is None:
            if world % (tp * dp_replicate):
                raise ValueError(
                    f"Mesh: world_size {world} is not divisible by tp * dp_replicate = "
                    f"{tp} * {dp_replicate}; the parallel mesh requires "
                    "world_size = dp_replicate * fsdp * tp"
                )
            fsdp = world // (tp * dp_replicate)
        fsdp = _check_size("fsdp", fsdp)
        if dp_replicate * fsdp * tp != world:
            raise ValueError(
                f"Mesh: the parallel mesh requires dp_replicate * fsdp * tp = {dp_replicate} * "
                f"{fsdp} * {tp} = {dp_replicate * fsdp * tp} processes, but world_size is {world}"
            )
        if ep % tp:
            raise ValueError(f"Mesh: ep must be a multiple of tp, got ep={ep}, tp={tp}")
        if (fsdp * tp) % ep:
            raise ValueError(
                f"Mesh: ep must divide fsdp * tp, got ep={ep}, fsdp * tp = {fsdp} * {tp} = {fsdp * tp}"
            )
        self.tp, self.ep, self.fsdp, self.dp_replicate = tp, ep, fsdp, dp_replicate
        self.efsdp = fsdp * tp // ep
        self.world, self.rank = world, rank
        self._coords = rank_coords(rank, tp=tp, fsdp=fsdp, dp_replicate=dp_replicate, ep=ep)
        self.dense = self.expert = None
        if initialized:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            from torch.distributed.device_mesh import init_device_mesh

            self.dense = init_device_mesh(device, (dp_replicate, fsdp, tp), mesh_dim_names=DENSE_AXES)
            self.expert = init_device_mesh(
                device, (dp_replicate, self.efsdp, ep), mesh_dim_names=EXPERT_AXES
            )

    # ----------------------------------------------------------------------------- queries
    def size(self, axis: str) -> int:
        """Size of a mesh axis (``"tp"``, ``"fsdp"``, ``"ep"``, ``"efsdp"``, ``"dp_replicate"``)."""
        self._check_axis(axis)
        return getattr(self, axis)

    def rank_in(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        self._check_axis(axis)
        return self._coords[axis]

    def group(self, axis: str) -> Optional[dist.ProcessGroup]:
        """Process group of this rank along ``axis`` (None in a single process without init)."""
        self._check_axis(axis)
        dm = self.device_mesh(axis)
        return None if dm is None else dm.get_group(axis)

    def device_mesh(self, axis: str):
        """The DeviceMesh (dense or expert) that holds ``axis``."""
        self._check_axis(axis)
        return self.expert if axis in ("ep", "efsdp") else self.dense

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in coordinate order."""
        self._check_axis(axis)
        stride = {"tp": 1, "fsdp": self.tp, "dp_replicate": self.tp * self.fsdp,
                  "ep": 1, "efsdp": self.ep}[axis]
        base = self.rank - self._coords[axis] * stride
        return [base + i * stride for i in range(self.size(axis))]

    @property
    def batch_index(self) -> int:
        """Index of the data-parallel batch this rank holds (same for a whole TP group)."""
        return self._coords["dp_replicate"] * self.fsdp + self._coords["fsdp"]

    @property
    def num_batches(self) -> int:
        """Number of distinct data-parallel batches (``dp_replicate * fsdp``)."""
        return self.dp_replicate * self.fsdp

    def expert_range(self, num_experts: int) -> range:
        """Global ids of the experts this rank owns: a contiguous block of ``E / ep``.

        Example:
            >>> Mesh().expert_range(4)
            range(0, 4)
        """
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"expert_range: num_experts must be an int >= 1, got {num_experts!r}")
        if num_experts % self.ep:
            raise ValueError(
                f"Cannot evenly shard {num_experts} experts across {self.ep} expert-parallel "
                f"ranks (num_experts must be a multiple of ep={self.ep})"
            )
        n = num_experts // self.ep
        start = self._coords["ep"] * n
        return range(start, start + n)

    def _check_axis(self, axis: str) -> None:
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; valid axes are {list(AXES)}")

    def __repr__(self) -> str:
        return (
            f"Mesh(world={self.world}, rank={self.rank}, dp_replicate={self.dp_replicate}, "
            f"fsdp={self.fsdp}, tp={self.tp}, ep={self.ep}, efsdp={self.efsdp})"
        )

    def __reduce__(self):  # meshes hold process groups: rebuild, never pickle them
        raise TypeError("fmoe.Mesh cannot be pickled; build it on each rank after init_process_group")
