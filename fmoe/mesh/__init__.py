"""Rank layout: how ``pp``, ``tp``, ``fsdp``, ``dp_replicate`` and ``ep`` share the same processes.

``pp`` (pipeline stages) is the outermost axis: ``world = pp * dp_replicate * fsdp * tp`` and
stage ``s`` is ranks ``[s * world / pp, (s + 1) * world / pp)``; every other axis lives inside
one stage, where two meshes are laid over the same ``dp_replicate * fsdp * tp`` ranks:

- the **dense** mesh ``(dp_replicate, fsdp, tp)``: ``tp`` consecutive ranks form a tensor-parallel
  group and hold the same batch; the batch a rank holds depends only on its fsdp (and replica)
  index;
- the **expert** mesh ``(dp_replicate, efsdp, ep)``: ``ep`` consecutive ranks hold one full set
  of experts (rank ``r`` of the group owns experts ``[r*E/ep, (r+1)*E/ep)``) and run the
  all-to-all together; ``efsdp = fsdp * tp / ep`` copies of that set exist, and the ranks at
  the same position in different copies form the ``efsdp`` group.

``ep`` adds no processes. It must be a multiple of ``tp`` (a TP group never straddles two expert
groups) and divide ``fsdp * tp``. :func:`check_layout` holds these rules, once: :class:`Mesh`
checks with it, and so do programs before they start any rank (``fmoe train``, the
memory plan). Eight ranks with ``tp=2``::

    rank     0     1     2     3     4     5     6     7
    batch    [ B0 ]      [ B1 ]      [ B2 ]      [ B3 ]
    ep=2     E0-3  E4-7  E0-3  E4-7  E0-3  E4-7  E0-3  E4-7    efsdp=4
    ep=4     E0E1  E2E3  E4E5  E6E7  E0E1  E2E3  E4E5  E6E7    efsdp=2
    ep=8     E0    E1    E2    E3    E4    E5    E6    E7      efsdp=1

Both meshes are torch ``DeviceMesh``es (when ``torch.distributed`` is initialised; with ``pp > 1``
the stage's slices of one ``(pp, ...)`` mesh), so sharded parameters can be DTensors;
:meth:`Mesh.group` hands out their process groups. The ranks at the same place in every stage
form the ``pp`` group (:meth:`RankLayout.ranks`), which passes activations stage to stage.

``sp`` (sequence parallelism, a way of using the ``tp`` axis, so it needs ``tp > 1``): between
tensor-parallel blocks the residual stream is split over ``tp`` on the sequence dimension
(:mod:`fmoe.nn`); it adds no processes.

``cp`` (context parallelism): ``cp`` ranks (stride ``tp``, inside one data shard) split each
sequence of their batch in ``2 cp`` chunks, rank ``c`` holding chunks ``c`` and ``2 cp - 1 - c``
(:mod:`fmoe.nn.context_parallel`); attention gathers K/V over the ``cp`` group. ``world = pp *
dp_replicate * fsdp * cp * tp``. The meshes' ``fsdp`` axis spans the data shards times the cp
ranks (``size("fsdp") = fsdp * cp``): parameters shard over both and a replicated leaf's gradient
is partial over both, so the cp pieces' gradients are summed like data-parallel batches'; the
expert mesh folds over the data x cp ranks (``efsdp * ep = fsdp * cp * tp``), so cp ranks route
their own tokens. Eight ranks, ``cp=2, ep=4``::

    rank     0     1     2     3     4     5     6     7
    batch    [   B0    ]   [   B1    ]  ...            (fsdp=4, cp=2: B0..B3)
    chunks   0,3   1,2   0,3   1,2   0,3   1,2   0,3   1,2
    ep=4     E0E1  E2E3  E4E5  E6E7  E0E1  E2E3  E4E5  E6E7    efsdp=2
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .layout import AXES, DATA_AXES, DENSE_AXES, EXPERT_AXES, Layout, RankLayout, check_layout, rank_coords, stage_layers

__all__ = ["Mesh", "stage_layers", "RankLayout", "Layout", "check_layout", "rank_coords", "DENSE_AXES", "EXPERT_AXES", "AXES", "DATA_AXES"]


class Mesh(RankLayout):
    """The process layout of one job: a :class:`RankLayout` (sizes, coordinates) plus the process
    groups per axis.

    Args:
        tp: tensor-parallel size (consecutive ranks).
        ep: expert-parallel size (consecutive ranks holding one full expert set); default
            ``tp``, the smallest valid size (so a dense model only says ``Mesh(tp=2)``).
        fsdp: data-parallel shards; default ``world // (tp * dp_replicate)``.
        dp_replicate: HSDP replicas (outermost inside a stage).
        pp: pipeline stages (the outermost axis; :mod:`fmoe.training.pipeline`).
        sp: sequence parallelism over ``tp`` (needs ``tp > 1``; :mod:`fmoe.nn`).
        cp: context-parallel size (ranks splitting each sequence; :mod:`fmoe.nn.context_parallel`).
        device_type: device type of the DeviceMeshes (default ``"cuda"`` over NCCL, else
            ``"cpu"``); the dry run's fake process group names ``"cuda"`` to plan a GPU job.

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
                 dp_replicate: int = 1, pp: int = 1, device_type: Optional[str] = None, sp: bool = False,
                 cp: int = 1):
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        try:
            super().__init__(world, rank, tp=tp, ep=ep, fsdp=fsdp, dp_replicate=dp_replicate, pp=pp, sp=sp, cp=cp)
        except (TypeError, ValueError) as e:
            raise type(e)(f"Mesh: {e}") from None
        self.dense = self.expert = self.stages = self.stage_group = self.cp_group = None
        if initialized:
            device = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
            from torch.distributed.device_mesh import init_device_mesh

            dense, expert = (self.dp_replicate, self.size("fsdp"), self.tp), (self.dp_replicate, self.efsdp, self.ep)
            if self.pp == 1:
                self.dense = init_device_mesh(device, dense, mesh_dim_names=DENSE_AXES)
                self.expert = init_device_mesh(device, expert, mesh_dim_names=EXPERT_AXES)
            else:                       # this stage's slices of one (pp, ...) mesh per kind
                full = init_device_mesh(device, (self.pp, *dense), mesh_dim_names=("pp", *DENSE_AXES))
                self.stages, self.dense = full, full[DENSE_AXES]
                self.expert = init_device_mesh(device, (self.pp, *expert), mesh_dim_names=("pp", *EXPERT_AXES))[EXPERT_AXES]
                n = self.stage_world                # every rank makes every stage's group, in order
                groups = [dist.new_group(list(range(s * n, (s + 1) * n))) for s in range(self.pp)]
                self.stage_group = groups[self.stage]   # the step's metrics reduce over one stage
            if self.cp > 1:                             # every rank makes every cp group, in order
                layouts = [RankLayout(world, r, tp=tp, ep=ep, fsdp=fsdp, dp_replicate=dp_replicate, pp=pp, cp=cp)
                           for r in range(world)]
                for ranks in sorted({tuple(m.ranks("cp")) for m in layouts}):
                    g = dist.new_group(list(ranks))
                    if rank in ranks:
                        self.cp_group = g

    # ----------------------------------------------------------------------------- process groups
    def group(self, axis: str) -> Optional[dist.ProcessGroup]:
        """Process group of this rank along ``axis`` (None in a single process without init)."""
        self._check_axis(axis)
        if axis == "cp":
            return self.cp_group
        dm = self.device_mesh(axis)
        return None if dm is None else dm.get_group(axis)

    def device_mesh(self, axis: str):
        """The DeviceMesh (dense or expert; for ``"pp"`` the whole ``(pp, ...)`` mesh) that holds ``axis``
        (``"cp"`` is no DeviceMesh axis: its ranks are part of ``"fsdp"``; :meth:`group` has its group)."""
        self._check_axis(axis)
        if axis == "cp":
            raise ValueError("the cp ranks are part of the meshes' fsdp axis; use mesh.group('cp')")
        if axis == "pp":
            return self.stages
        return self.expert if axis in ("ep", "efsdp") else self.dense

    def __reduce__(self):  # meshes hold process groups: rebuild, never pickle them
        raise TypeError("fmoe.Mesh cannot be pickled; build it on each rank after init_process_group")
