"""Expert compute, in one home: this rank's block of experts run on the rows routed to them.

:class:`LocalExperts` holds the local expert weights and is the one entry point of the MoE layer
and of every expert-parallel implementation (:mod:`fmoe.ep`): given rows and, per row, ``K``
slots (a routing weight and a local expert id, ``-1`` for a slot whose expert lives elsewhere),
:meth:`LocalExperts.weighted_sum_per_row` returns ``sum_k w[n, k] * expert_k(rows[n])``. It sorts
the (row, slot) assignments by expert once and runs one of four paths that give the same numbers
(the tests check it):

==========  =========================================  ==========================================
path        module                                     when (:meth:`LocalExperts.path`)
==========  =========================================  ==========================================
blocked     :mod:`fmoe.experts.blocked`: gather,        CPU, activation named ``"swiglu"``, no
            GEMMs, weight and scatter-add block by      biases, and ``matmul="loop"`` or ``"auto"``
            block (no ``[A, D]`` temporaries)          with >= ``BLOCKED_MIN_ROWS`` rows/expert
                                                       (any number in bf16 / fp16)
grouped     :mod:`fmoe.experts.mlp`: one               ``matmul="grouped"`` or ``"auto"``, where
            ``torch._grouped_mm`` per projection       it applies: aligned shapes, rows, fp32 /
                                                       bf16 / fp16 (bf16 on CUDA)
loop        :mod:`fmoe.experts.mlp`: one matmul per    otherwise
            expert
traced      :mod:`fmoe.experts.ops`: the grouped       under ``torch.func`` transforms and
            GEMMs as ``torch.library`` operators,      ``torch.compile`` (:mod:`fmoe.transforms`)
            group sizes kept on the device
==========  =========================================  ==========================================

The choice is made from explicit data (``matmul``, the activation's *name*
(:func:`fmoe.experts.activations.activation_name`), the biases, the device and the number of
assignments), never from object identity. Weights are fused per expert: ``w_gate_up [E, 2I, D]``
(gate rows first) and ``w_down [E, D, I]``, optionally ``b_gate_up [E, 2I]`` and ``b_down [E, D]``.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from . import fake_splits
from ..precision import gemm_dtype
from .activations import Activation, activation_name, clamped_swiglu, swiglu
from ..transforms import active as transforms_active
from ..transforms import compiling, vmapping
from .blocked import weighted_expert_sum
from .mlp import check_groups, expert_mlp, grouped_mm_available, use_grouped
from .ops import check_matmul, expert_mlp_offs, offsets

__all__ = ["LocalExperts", "BLOCKED_MIN_ROWS", "sorted_by_expert", "expert_mlp", "weighted_expert_sum",
           "check_matmul", "check_groups", "grouped_mm_available", "use_grouped", "Activation", "swiglu",
           "clamped_swiglu"]

BLOCKED_MIN_ROWS = 256   # mean rows per local expert from which "auto" takes the blocked CPU path


def sorted_by_expert(local_ids: torch.Tensor, num_local: int) -> tuple[torch.Tensor, list[int]]:
    """Stable order grouping ``local_ids`` by expert, and the count per expert (one host sync)."""
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=num_local).tolist()
    return order, counts


class LocalExperts:
    """This rank's block of experts, callable on rows.

    Args:
        weights: dict with local ``w_gate_up [El, 2I, D]``, ``w_down [El, D, I]`` and optional
            ``b_gate_up``, ``b_down``.
        first: global id of the first local expert.
        num_experts: E, the global number of experts.
        act: activation ``act(gate, up)`` (:mod:`fmoe.experts.activations`; any callable works, only one
            named ``"swiglu"`` takes the fused paths).
        matmul: ``"auto"``, ``"grouped"`` or ``"loop"`` (see the module docstring).

    Example:
        >>> ex = LocalExperts({"w_gate_up": torch.randn(2, 6, 4), "w_down": torch.randn(2, 4, 3)}, 0, 2)
        >>> ex.weighted_sum_per_row(torch.randn(5, 4), torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.long)).shape
        torch.Size([5, 4])
    """

    def __init__(self, weights: dict, first: int, num_experts: int, act: Union[Activation, Callable] = swiglu,
                 matmul: str = "auto"):
        check_matmul("LocalExperts", "matmul", matmul)
        self.weights, self.first, self.num_experts = weights, first, num_experts
        self.num_local = weights["w_gate_up"].shape[0]
        self.range = range(first, first + self.num_local)
        self.act, self.matmul = act, matmul

    def __call__(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Outputs ``[N, D]`` (unweighted) of expert ``local_ids[n]`` on ``rows[n]``."""
        order, counts = sorted_by_expert(local_ids, self.num_local)
        out = self.run_sorted(rows.index_select(0, order), counts)
        return torch.empty_like(out).index_copy(0, order, out)

    @property
    def plain_swiglu(self) -> bool:
        """SwiGLU experts without biases: the ones the fused kernels run."""
        return (activation_name(self.act) == "swiglu"
                and "b_gate_up" not in self.weights and "b_down" not in self.weights)

    def blocked(self, rows: torch.Tensor, num_assignments: int) -> bool:
        """Whether the blocked CPU path runs for ``num_assignments`` (row, expert) pairs: plain
        SwiGLU experts on CPU with ``matmul="loop"``, or ``"auto"`` and at least
        ``BLOCKED_MIN_ROWS`` assignments per local expert on average (below that the
        whole-tensor grouped GEMMs cost less than a Python loop over experts), or ``"auto"`` in
        bf16 / fp16 at any size: its GEMMs reuse a few oneDNN kernel shapes where the grouped and
        loop paths build a new kernel for every new expert row count (:mod:`fmoe.experts.blocked`).
        Never on fake tensors (the dry run plans a GPU job: it takes the CUDA paths,
        :mod:`fmoe.experts.fake_splits`)."""
        return self.plain_swiglu and rows.device.type == "cpu" and not fake_splits.is_fake(rows) and (
            self.matmul == "loop" or
            (self.matmul == "auto" and (rows.dtype in (torch.bfloat16, torch.float16)
                                        or num_assignments >= BLOCKED_MIN_ROWS * self.num_local)))

    def path(self, rows: torch.Tensor, num_assignments: int) -> str:
        """The path :meth:`weighted_sum_per_row` takes: ``"traced"``, ``"blocked"``,
        ``"grouped"`` or ``"loop"`` (see the module docstring)."""
        if transforms_active():
            return "traced"
        if self.blocked(rows, num_assignments):     # the hand-fused CPU path
            return "blocked"
        w = self.weights
        return "grouped" if use_grouped(rows, w["w_gate_up"], w["w_down"], self.matmul) else "loop"

    def weighted_sum(self, rows: torch.Tensor, row_of: torch.Tensor, counts: list[int],
                     scale: torch.Tensor) -> torch.Tensor:
        """``out[n] = sum of scale[a] * expert(rows[n])`` over the assignments ``a`` of row ``n``
        (``row_of [A]`` sorted by local expert, ``counts[e]`` each); ``[N, D]``."""
        w, ct = self.weights, gemm_dtype(rows)
        if ct != rows.dtype:                # bf16 on a CPU without native bf16: fp32 paths on the same values
            up = LocalExperts({k: v.to(ct) for k, v in w.items()}, self.first, self.num_experts, self.act, self.matmul)
            return up.weighted_sum(rows.to(ct), row_of, counts, scale.to(ct)).to(rows.dtype)
        if self.blocked(rows, row_of.shape[0]):
            return weighted_expert_sum(rows, row_of, counts, w["w_gate_up"], w["w_down"], scale=scale)
        out = self.run_sorted(rows.index_select(0, row_of), counts, scale=scale)   # [A, D], weighted
        return out.new_zeros(rows.shape[0], out.shape[-1]).index_add(0, row_of, out)

    def weighted_sum_per_row(self, rows: torch.Tensor, slot_w: torch.Tensor, slot_ids: torch.Tensor,
                             num_used: Optional[int] = None) -> torch.Tensor:
        """``out[n] = sum_k slot_w[n, k] * expert(slot_ids[n, k])(rows[n])`` over slots with id >= 0.

        One stable sort of the ``[N * K]`` slots (unused slots keyed last), then the experts with
        the weights folded in over the gathered rows, added back per row.

        Args:
            rows: ``[N, D]``.
            slot_w: ``[N, K]`` routing weight per slot.
            slot_ids: ``[N, K]`` local expert id per slot, ``-1`` for a slot not on this rank.
            num_used: the number of slots with id >= 0 when the caller knows it on the host
                (saves a host sync under ``torch.compile``).
        Returns:
            ``[N, D]``.
        """
        if self.path(rows, slot_ids.numel() if num_used is None else num_used) == "traced":
            return self._weighted_sum_traced(rows, slot_w, slot_ids, num_used)   # grouped operators
        k, e = slot_ids.shape[1], self.num_local
        flat = slot_ids.reshape(-1)
        keyed = torch.where(flat >= 0, flat, e)                                     # [N*K], unused -> e
        order = torch.argsort(keyed, stable=True)
        if fake_splits.is_fake(keyed):    # dry run: the used slots spread evenly (fmoe.experts.fake_splits)
            counts = fake_splits.even_counts(flat.shape[0] if num_used is None else num_used, e)
        else:
            counts = torch.bincount(keyed, minlength=e + 1).tolist()[:e]           # one host sync
        order = order[:sum(counts)]                                                 # assignments A
        row_of = torch.div(order, k, rounding_mode="floor")
        w = slot_w.reshape(-1).index_select(0, order).to(rows.dtype)               # [A]
        return self.weighted_sum(rows, row_of, counts, w)                           # [N, D]

    def _weighted_sum_traced(self, rows, slot_w, slot_ids, num_used: Optional[int]) -> torch.Tensor:
        """The ``"traced"`` path: one stable sort of the slots, then :func:`_sorted_expert_sum`
        with the group sizes on the device; no host sync when ``num_used`` is given (the dispatch
        learns it in its split-size exchange; every slot in one process). Otherwise one ``int()``
        (the ``all_reduce`` dispatch) when eager; while Dynamo traces, none (it would break the
        graph): all ``N * K`` slots go to the grouped operators, the unused ones sorted after the
        last group, where the operators compute nothing (no FLOPs added; the rows there are masked
        to zero, :func:`fmoe.experts.ops.expert_mlp_offs`'s ``valid``). Under an eager ``vmap``, where no
        host value exists, unused slots ride along on local expert 0 with weight 0 (adding nothing)."""
        e = self.num_local
        flat = slot_ids.reshape(-1)                                                 # [N*K]
        used = flat >= 0
        padded = num_used is None and compiling()          # vmapping() is False while tracing
        if num_used is None and vmapping():
            keyed, num_used = torch.where(used, flat, 0), flat.shape[0]
            slot_w = torch.where(slot_ids >= 0, slot_w, 0)
        elif padded:                # tracing without a host count: every slot, the unused ones after the last group
            keyed, num_used = torch.where(used, flat, e), flat.shape[0]
            slot_w = torch.where(slot_ids >= 0, slot_w, 0)
        else:
            keyed = torch.where(used, flat, e)                                      # unused slots sorted last, cut
            num_used = int(used.sum()) if num_used is None else num_used
        order = torch.argsort(keyed, stable=True)[:num_used]                       # [A]
        counts = torch.zeros(e + 1, dtype=torch.int64, device=flat.device).scatter_add(0, keyed, torch.ones_like(keyed))
        ew = self.weights
        return _sorted_expert_sum(rows, slot_w, order, counts[:e], ew["w_gate_up"], ew["w_down"],
                                  ew.get("b_gate_up"), ew.get("b_down"),
                                  None if activation_name(self.act) == "swiglu" else self.act,
                                  "loop" if self.matmul == "loop" else "auto", padded)

    def run_sorted(self, rows: torch.Tensor, counts: list[int], scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Outputs (times ``scale [N]`` if given) for rows already grouped by local expert
        (``counts[e]`` rows each)."""
        w = self.weights
        return expert_mlp(rows, counts, w["w_gate_up"], w["w_down"], w.get("b_gate_up"),
                          w.get("b_down"), act=self.act, matmul=self.matmul, scale=scale)


def _sorted_expert_sum(rows: torch.Tensor, slot_w: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: Optional[torch.Tensor],
                       b_down: Optional[torch.Tensor], act: Optional[Callable], matmul: str,
                       padded: bool = False) -> torch.Tensor:
    """``out[n] = sum of slot_w[a] * expert(rows[n])`` over the assignments ``a`` of row ``n``:
    ``order [A]`` the flat ``(row, slot)`` indices into ``slot_w [N, K]`` sorted by local expert,
    ``counts [El]`` (a tensor) assignments per expert. Gather, the grouped expert MLP
    (:func:`fmoe.experts.ops.expert_mlp_offs`), scatter-add: no host sync, so it traces as one
    graph; ``[N, D]``. ``padded``:
    ``order`` holds every slot, the assignments after ``counts.sum()`` outside every group (zero weight)."""
    row_of = torch.div(order, slot_w.shape[1], rounding_mode="floor")                        # [A]
    w = slot_w.reshape(-1).index_select(0, order).to(rows.dtype)                            # [A]
    valid = torch.arange(order.shape[0], device=order.device) < counts.sum() if padded else None
    out = expert_mlp_offs(rows.index_select(0, row_of), offsets(counts), w_gate_up, w_down, b_gate_up, b_down,
                          act=act, scale=w, matmul=matmul, valid=valid)                      # [A, D]
    return out.new_zeros(rows.shape[0], out.shape[-1]).index_add(0, row_of, out)
