"""Shared experts: a dense SwiGLU MLP every token passes through, added to the routed output.

DeepSeek-MoE/V3 and Qwen2-MoE add always-on experts (several shared experts are one MLP of
their summed width) to the routed mixture; Qwen2-MoE scales them by a per-token sigmoid gate::

    y = moe(x) + sigmoid(x @ gate.T) * w_down @ act(w_gate_up @ x)      (gate optional)

They live in the MoE params as ``params["shared"] = {"w_gate_up": [2I, D], "w_down": [D, I],
"gate": [1, D] (optional)}`` and ``fmoe.moe`` adds them. They run through the dense MLP the
models use (:func:`fmoe.nn.swiglu_mlp`), so the placements are the dense MLP's: replicated or
split over ``fsdp`` (gathered for the call, gradient reduce-scattered), or tensor-parallel with
``w_gate_up`` ``packed_colwise`` and ``w_down`` ``rowwise`` (partial outputs summed over ``tp``,
the gradient of x summed over ``tp``). The gate is replicated. Every TP rank ends with the full
output and the full-batch gradient of x, like the routed experts. With sequence parallelism
(``fmoe.Mesh(..., sp=True)``) x is this rank's piece of the tokens, and so is the output; the
linear layers gather and scatter the tokens (:mod:`fmoe.nn.linear`) and the gate's gradient is
``Partial`` over tp.
"""

from __future__ import annotations

from typing import Any

import torch

from ..experts.activations import Activation, swiglu
from ..fsdp import unshard
from ..precision import gemm
from ..sharding import check_fused_gate_up, placement_of
from ._tp import sp_group
from .mlp import swiglu_mlp

__all__ = ["shared_expert", "check_shared"]

_KEYS = ("w_gate_up", "w_down", "gate")


def check_shared(shared: Any, D: int, dtype: torch.dtype) -> int:
    """Validate ``params["shared"]``; returns its hidden size I (``ValueError`` naming the key)."""
    if not isinstance(shared, dict):
        raise TypeError(f"moe: params['shared'] must be a dict with w_gate_up [2I, D], w_down [D, I] "
                        f"(and optional gate [1, D]), got {type(shared).__name__}")
    missing = [k for k in ("w_gate_up", "w_down") if k not in shared]
    unknown = sorted(set(shared) - set(_KEYS))
    if missing or unknown:
        raise ValueError(f"moe: params['shared'] is missing {missing} / has unexpected {unknown}; "
                         f"valid keys: {list(_KEYS)}")
    gu, dn = shared["w_gate_up"], shared["w_down"]
    if gu.ndim != 2 or gu.shape[1] != D or gu.shape[0] % 2:
        raise ValueError(f"moe: params['shared']['w_gate_up'] must be [2I, D={D}], got {tuple(gu.shape)}")
    I = gu.shape[0] // 2
    if tuple(dn.shape) != (D, I):
        raise ValueError(f"moe: params['shared']['w_down'] must be [D={D}, I={I}], got {tuple(dn.shape)}")
    if "gate" in shared and tuple(shared["gate"].shape) != (1, D):
        raise ValueError(f"moe: params['shared']['gate'] must be [1, D={D}], got {tuple(shared['gate'].shape)}")
    for k, v in shared.items():
        if v.dtype != dtype:
            raise ValueError(f"moe: x dtype {dtype} differs from params['shared'][{k!r}] dtype {v.dtype}")
    gp, dp = placement_of(gu), placement_of(dn)
    check_fused_gate_up(gp, "moe: params['shared']['w_gate_up']")
    if (gp.dim_of("tp"), dp.dim_of("tp")) not in ((None, None), (0, 1)):
        raise ValueError(f"moe: shared expert placements w_gate_up {gp!r}, w_down {dp!r} are not "
                         "supported over tp: use packed_colwise P('tp', None, packed=2) and rowwise "
                         "P(None, 'tp'), or no tp split")
    if "gate" in shared and placement_of(shared["gate"]).dim_of("tp") is not None:
        raise ValueError("moe: params['shared']['gate'] must not be split over tp")
    return I


def shared_expert(shared: dict, x: torch.Tensor, act: Activation = swiglu) -> torch.Tensor:
    """Output ``[T, D]`` of the shared experts on this rank's tokens (see the module docstring).

    Args:
        shared: ``{"w_gate_up": [2I, D], "w_down": [D, I], "gate": [1, D] optional}``, plain or
            placed by ``fmoe.shard``.
        x: ``[T, D]``.
        act: ``act(gate, up)`` (default SwiGLU).
    Returns:
        ``[T, D]``.

    Example:
        >>> s = {"w_gate_up": torch.ones(6, 4), "w_down": torch.ones(4, 3)}
        >>> shared_expert(s, torch.zeros(2, 4)).shape
        torch.Size([2, 4])
    """
    check_shared(shared, x.shape[-1], x.dtype)
    y = swiglu_mlp(x, shared["w_gate_up"], shared["w_down"], act=act)         # [T, D]; tp handled by linear
    if "gate" in shared:
        partial = ("tp",) if sp_group(shared["gate"])[1] > 1 else ()   # sequence parallel: own tokens only
        gate = unshard(shared["gate"], keep=(), partial_grad=partial)
        y = torch.sigmoid(gemm(torch.matmul, x, gate.t())) * y                # [T, 1] * [T, D]
    return y
