"""The pure half of the rank layout: sizes and coordinates on every axis, no processes.

:func:`check_layout` holds the layout rules once (every size an int >= 1, ``world = pp *
dp_replicate * fsdp * cp * tp``, ``ep`` a multiple of ``tp`` dividing ``fsdp * cp * tp``);
:func:`rank_coords` is the one rank layout (``pp`` outermost, tp fastest), :func:`stage_layers`
the decoder layers of each pipeline stage; :class:`RankLayout`
is one rank's place in it (what the memory plan and programs use without starting ranks;
:class:`fmoe.mesh.Mesh` adds the process groups). The picture is in :mod:`fmoe.mesh`.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Sequence

__all__ = ["stage_layers", "RankLayout", "Layout", "check_layout", "rank_coords", "FIELD_NAMES", "DENSE_AXES", "EXPERT_AXES", "AXES",
           "DATA_AXES"]

DENSE_AXES = ("dp_replicate", "fsdp", "tp")
EXPERT_AXES = ("dp_replicate", "efsdp", "ep")
AXES = ("dp_replicate", "fsdp", "tp", "efsdp", "ep", "pp", "cp")
DATA_AXES = ("fsdp", "dp_replicate", "efsdp")   # axes whose ranks hold different batches


def rank_coords(rank: int, *, tp: int, fsdp: int, dp_replicate: int, ep: int, pp: int = 1,
                cp: int = 1) -> dict[str, int]:
    """The coordinates of global ``rank`` on every axis of both meshes: the one rank layout
    (``pp`` outermost; inside a stage dense ``(dp_replicate, fsdp, tp)`` and expert
    ``(dp_replicate, efsdp, ep)``, tp fastest). With context parallelism the meshes' ``fsdp`` axis
    spans the ``fsdp`` data shards times the ``cp`` ranks that split each sequence (cp inside:
    coordinate ``fsdp = data shard * cp + cp rank``), so parameters shard over both.

    Example:
        >>> rank_coords(5, tp=2, fsdp=2, dp_replicate=2, ep=4)
        {'tp': 1, 'fsdp': 0, 'dp_replicate': 1, 'ep': 1, 'efsdp': 0, 'pp': 0, 'cp': 0}
        >>> rank_coords(5, tp=2, fsdp=2, dp_replicate=1, ep=2, pp=2)["pp"]
        1
        >>> rank_coords(3, tp=1, fsdp=2, dp_replicate=1, ep=4, cp=2)
        {'tp': 0, 'fsdp': 3, 'dp_replicate': 0, 'ep': 3, 'efsdp': 0, 'pp': 0, 'cp': 1}
    """
    shards = fsdp * cp
    efsdp, stage = shards * tp // ep, dp_replicate * shards * tp
    local = rank % stage
    f = (local // tp) % shards
    return {"tp": local % tp, "fsdp": f, "dp_replicate": local // (tp * shards),
            "ep": local % ep, "efsdp": (local // ep) % efsdp, "pp": rank // stage, "cp": f % cp}


class Layout(NamedTuple):
    """The sizes of one valid rank layout (see :func:`check_layout`)."""

    world: int
    tp: int
    ep: int
    fsdp: int
    dp_replicate: int
    pp: int = 1
    cp: int = 1

    @property
    def efsdp(self) -> int:
        """Copies of one full expert set: ``fsdp * cp * tp / ep``."""
        return self.fsdp * self.cp * self.tp // self.ep


#: How :func:`check_layout` names each field in its errors unless told otherwise.
FIELD_NAMES = {"world": "world_size", "tp": "tp", "ep": "ep", "fsdp": "fsdp", "dp_replicate": "dp_replicate",
               "pp": "pp", "cp": "cp"}


def check_layout(world: int, *, tp: int = 1, ep: Optional[int] = None, fsdp: Optional[int] = None,
                 dp_replicate: int = 1, pp: int = 1, names: Optional[Mapping[str, str]] = None, cp: int = 1) -> Layout:
    """The layout rules of a mesh over ``world`` ranks, checked without any process: every size
    an int >= 1, ``world = pp * dp_replicate * fsdp * cp * tp``, ``ep`` a multiple of ``tp``
    dividing ``fsdp * cp * tp`` (the expert mesh folds over the data and cp ranks). :class:`Mesh`
    checks with it, and so does a program before it starts ranks.

    Args:
        world: number of ranks.
        tp, ep, fsdp, dp_replicate, pp, cp: the sizes (``ep`` default ``tp``; ``fsdp`` default
            ``world // (pp * tp * dp_replicate * cp)``).
        names: how the caller's user spells a field in errors, e.g. ``{"world": "--nproc",
            "tp": "--tp"}`` (default :data:`FIELD_NAMES`); a flag is quoted as ``--tp 2``, a keyword
            as ``tp=2``.
    Returns:
        the checked :class:`Layout`.
    Raises:
        TypeError: a size that is not an int.
        ValueError: a size below 1 or a rule broken, naming the field, its value and what is valid.

    Example:
        >>> check_layout(8, tp=2, ep=4)
        Layout(world=8, tp=2, ep=4, fsdp=4, dp_replicate=1, pp=1, cp=1)
        >>> check_layout(8, tp=2, ep=3)
        Traceback (most recent call last):
        ...
        ValueError: ep=3 must be a multiple of tp=2 (a tensor-parallel group never straddles two expert groups); valid ep: 2, 4, 8
    """
    name = {**FIELD_NAMES, **(names or {})}

    def said(field: str, value: int) -> str:
        return f"{name[field]} {value}" if name[field].startswith("-") else f"{name[field]}={value}"

    ep = tp if ep is None else ep
    sizes = [("world", world), ("tp", tp), ("ep", ep), ("dp_replicate", dp_replicate), ("pp", pp), ("cp", cp)]
    for field, value in sizes + ([] if fsdp is None else [("fsdp", fsdp)]):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name[field]} must be an int >= 1, got {value!r} ({type(value).__name__})")
        if value < 1:
            raise ValueError(f"{name[field]} must be >= 1, got {said(field, value)}")
    if pp > 1 and world % pp:
        raise ValueError(f"{said('world', world)} must be divisible by {said('pp', pp)} (pipeline stages of equal "
                         f"size); valid {name['pp']}: {', '.join(str(d) for d in range(1, world + 1) if world % d == 0)}")
    whole, world = world, world // pp           # the rest of the rules hold inside one stage
    if pp > 1:                                  # errors below speak of one stage's ranks
        name = {**name, "world": f"{name['world']}/{name['pp']}"}
    if cp > 1 and world % (cp * tp):
        raise ValueError(f"{said('cp', cp)} times {said('tp', tp)} must divide {said('world', world)} (context-parallel "
                         f"groups of equal size); valid {name['cp']}: "
                         f"{', '.join(str(d) for d in range(1, world // tp + 1) if world % (d * tp) == 0)}")
    if fsdp is None:
        if world % (tp * dp_replicate * cp):
            extra = f" * {name['cp']}" if cp > 1 else ""
            raise ValueError(
                f"{said('world', world)} must be divisible by {name['tp']} * {name['dp_replicate']}{extra} = "
                f"{tp * dp_replicate * cp} ({said('tp', tp)}, {said('dp_replicate', dp_replicate)}"
                + (f", {said('cp', cp)}" if cp > 1 else "") + f"): fsdp = "
                f"{name['world']} / ({name['tp']} * {name['dp_replicate']}{extra}) must be a whole number")
        fsdp = world // (tp * dp_replicate * cp)
    if dp_replicate * fsdp * cp * tp != world:
        extra = (f" * {name['cp']}", f" * {cp}") if cp > 1 else ("", "")
        raise ValueError(
            f"the parallel mesh requires {name['dp_replicate']} * {name['fsdp']}{extra[0]} * {name['tp']} = {dp_replicate} * "
            f"{fsdp}{extra[1]} * {tp} = {dp_replicate * fsdp * cp * tp} processes, but {name['world']} is {world}")
    shards = fsdp * cp                          # the meshes' fsdp axis: data shards x cp ranks
    valid = ", ".join(str(e) for e in range(tp, shards * tp + 1, tp) if (shards * tp) % e == 0)
    if ep % tp:
        raise ValueError(f"{said('ep', ep)} must be a multiple of {said('tp', tp)} (a tensor-parallel group never "
                         f"straddles two expert groups); valid {name['ep']}: {valid}")
    if (shards * tp) % ep:
        what = f"fsdp * cp * tp = {fsdp} * {cp} * {tp}" if cp > 1 else f"fsdp * tp = {fsdp} * {tp}"
        raise ValueError(f"{said('ep', ep)} must divide {what} = {shards * tp} (the ranks of one "
                         f"data-parallel replica); valid {name['ep']}: {valid}")
    return Layout(whole, tp, ep, fsdp, dp_replicate, pp, cp)


def stage_layers(num_layers: int, pp: int, sizes: Optional[Sequence[int]] = None) -> list[range]:
    """The layers of each of ``pp`` stages: contiguous, equal blocks, or blocks of ``sizes``
    layers (``--pp-layers``, e.g. fewer on the last stage, which also holds the head).

    Raises:
        ValueError: ``pp`` does not divide ``num_layers``, or ``sizes`` are not ``pp`` counts
            >= 1 summing to ``num_layers``.

    Example:
        >>> stage_layers(8, 4)
        [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
        >>> stage_layers(5, 2, [3, 2])
        [range(0, 3), range(3, 5)]
    """
    if sizes is not None:
        sizes = list(sizes)
        if len(sizes) != pp or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes) \
                or sum(sizes) != num_layers:
            raise ValueError(f"pp_layers {sizes} must be {pp} layer counts >= 1 summing to the model's {num_layers} "
                             "decoder layers")
        starts = [sum(sizes[:s]) for s in range(pp)]
        return [range(a, a + n) for a, n in zip(starts, sizes)]
    if pp < 1 or num_layers % pp:
        raise ValueError(f"pp={pp} must divide the model's {num_layers} decoder layers (stages of equal depth); "
                         f"valid pp: {[d for d in range(1, num_layers + 1) if num_layers % d == 0]}")
    n = num_layers // pp
    return [range(s * n, (s + 1) * n) for s in range(pp)]


class RankLayout:
    """One rank's place in a valid layout: sizes and coordinates on every axis, no processes.

    The pure half of :class:`Mesh` (which adds the process groups); programs that plan a run
    without starting ranks use it directly (the memory plan). Errors are :func:`check_layout`'s.

    Args:
        world: number of ranks; rank: this rank.
        tp, ep, fsdp, dp_replicate, pp, cp: the sizes, as in :func:`check_layout`.
        names: how errors spell the fields (:func:`check_layout`).
        sp: sequence parallelism over ``tp`` (needs ``tp > 1``).

    ``fsdp`` counts the data shards; the meshes' ``fsdp`` axis (``size("fsdp")``,
    ``rank_in("fsdp")``, ``ranks("fsdp")``) spans them times the ``cp`` ranks, which hold pieces
    of one sequence: parameters shard over both, and a replicated leaf's gradient is partial over
    both. ``batch_index`` / ``num_batches`` count the token slices whose losses a step sums (each
    cp rank's piece is one); ``sequence_index`` / ``num_sequences`` the sequences (the data).

    Example:
        >>> m = RankLayout(8, 3, tp=2, ep=4)
        >>> m.fsdp, m.efsdp, m.rank_in("tp"), m.rank_in("ep"), m.batch_index, m.ranks("ep")
        (4, 2, 1, 3, 1, [0, 1, 2, 3])
        >>> c = RankLayout(8, 3, tp=2, ep=4, cp=2)
        >>> c.fsdp, c.size("fsdp"), c.rank_in("cp"), c.ranks("cp"), c.batch_index, c.sequence_index
        (2, 4, 1, [1, 3], 1, 0)
    """

    def __init__(self, world: int, rank: int = 0, tp: int = 1, ep: Optional[int] = None,
                 fsdp: Optional[int] = None, dp_replicate: int = 1, names: Optional[Mapping[str, str]] = None,
                 pp: int = 1, sp: bool = False, cp: int = 1):
        layout = check_layout(world, tp=tp, ep=ep, fsdp=fsdp, dp_replicate=dp_replicate, pp=pp, names=names, cp=cp)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be an int in [0, {world}) for {world} ranks, got {rank!r}")
        if not isinstance(sp, bool) or (sp and layout.tp == 1):
            said = {**FIELD_NAMES, **(names or {})}
            raise ValueError(f"{said.get('sp', 'sp')} (sequence parallelism) splits the sequence over tp and needs "
                             f"{said['tp']} > 1, got sp={sp!r} with tp={layout.tp}")
        self.world, self.rank = world, rank
        self.tp, self.ep, self.fsdp, self.dp_replicate = layout.tp, layout.ep, layout.fsdp, layout.dp_replicate
        self.efsdp, self.pp, self.sp, self.cp = layout.efsdp, layout.pp, sp, layout.cp
        self._coords = rank_coords(rank, tp=self.tp, fsdp=self.fsdp, dp_replicate=self.dp_replicate, ep=self.ep,
                                   pp=self.pp, cp=self.cp)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return self._coords["pp"]

    @property
    def stage_world(self) -> int:
        """Ranks in one pipeline stage (``world / pp``): the ranks every other axis lives on."""
        return self.world // self.pp

    def size(self, axis: str) -> int:
        """Size of a mesh axis (``"tp"``, ``"fsdp"`` (data shards x cp), ``"ep"``, ``"efsdp"``,
        ``"dp_replicate"``, ``"pp"``, ``"cp"``)."""
        self._check_axis(axis)
        return self.fsdp * self.cp if axis == "fsdp" else getattr(self, axis)

    def rank_in(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        self._check_axis(axis)
        return self._coords[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in coordinate order."""
        self._check_axis(axis)
        stride = {"tp": 1, "fsdp": self.tp, "dp_replicate": self.tp * self.fsdp * self.cp,
                  "ep": 1, "efsdp": self.ep, "pp": self.stage_world, "cp": self.tp}[axis]
        base = self.rank - self._coords[axis] * stride
        return [base + i * stride for i in range(self.size(axis))]

    @property
    def batch_index(self) -> int:
        """Index of the token slice this rank holds, among those whose losses a step sums: its
        data-parallel batch, or with ``cp > 1`` its piece of that batch's sequences (same for a
        whole TP group)."""
        return self._coords["dp_replicate"] * self.fsdp * self.cp + self._coords["fsdp"]

    @property
    def num_batches(self) -> int:
        """Number of distinct token slices (``dp_replicate * fsdp * cp``)."""
        return self.dp_replicate * self.fsdp * self.cp

    @property
    def sequence_index(self) -> int:
        """Index of the data-parallel batch of sequences this rank reads (its cp group's)."""
        return self.batch_index // self.cp

    @property
    def num_sequences(self) -> int:
        """Number of distinct data-parallel batches of sequences (``dp_replicate * fsdp``)."""
        return self.dp_replicate * self.fsdp

    def expert_range(self, num_experts: int) -> range:
        """Global ids of the experts this rank owns: a contiguous block of ``E / ep``.

        Example:
            >>> RankLayout(4, 1, ep=4).expert_range(8)
            range(2, 4)
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
            f"{type(self).__name__}(world={self.world}, rank={self.rank}, dp_replicate={self.dp_replicate}, "
            f"fsdp={self.fsdp}, tp={self.tp}, ep={self.ep}, efsdp={self.efsdp}"
            + (f", pp={self.pp}" if self.pp > 1 else "") + (f", cp={self.cp}" if self.cp > 1 else "") + (", sp=True" if self.sp else "") + ")"
        )


