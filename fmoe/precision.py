"""Precision, one module: the "at least float32" compute rule, and the training policies.

**The compute rule.** Norms, losses, routers, statistics and attention probabilities compute in
``torch.promote_types(dtype, torch.float32)`` (:func:`at_least_f32`, :func:`upcast`): bf16 /
fp16 inputs are computed in fp32, float32 stays float32, and float64 stays float64, so a float64
model is float64 end to end and ``torch.autograd.gradcheck`` or finite differences can check it.

**Training policies**: which dtype the weights, the gradients and AdamW's moments live in. A policy is three names (``--dtype``, ``--master-dtype``, ``--optim-dtype``), each ``"fp32"``
or ``"bf16"``:

- ``compute``: the matmuls' dtype (``torch.autocast`` over the weights);
- ``master``: the weights the optimizer updates, stored (and checkpointed) in this dtype; the
  gradients autograd returns have it too, so the gradient reduction runs in it;
- ``optim``: AdamW's two moments.

``Precision("bf16", "fp32", "fp32")`` is mixed precision with fp32 masters (16 bytes per
parameter for weights, gradients and moments); ``Precision("bf16", "bf16", "bf16")`` is pure
bf16 as the reference trains (8 bytes per parameter).

Pure bf16 needs care in one place: an AdamW step is often smaller than half a bf16 ulp of the
weight (8 bits of mantissa: ``|w| * 2**-8``), and round-to-nearest then drops it, every step,
forever. The update therefore runs in fp32 on upcast copies and is written back with
**stochastic rounding** (:func:`stochastic_round`): rounded up with probability equal to the
fraction of the ulp, so the stored weight is unbiased and small steps accumulate in
expectation. (Kahan-compensated updates need a second bf16 buffer per weight, 10 bytes per
parameter instead of 8; ``benchmarks/RESULTS.md`` measures the chosen rule against fp32
masters.) The moments are rounded to nearest (their relative precision is what matters). The
random bits come from a generator seeded by ``(seed, step, rank)``, so a resumed run on the
same mesh repeats them bit for bit.

Example:
    >>> at_least_f32(torch.bfloat16), at_least_f32(torch.float64)
    (torch.float32, torch.float64)
    >>> upcast(torch.ones(2, dtype=torch.float16)).dtype
    torch.float32
    >>> dtype_of("bf16")
    torch.bfloat16
    >>> pol = Precision(compute="bf16", master="bf16", optim="bf16")
    >>> pol.master_dtype, pol.bytes_per_param()
    (torch.bfloat16, 8)
    >>> x = torch.full((4096,), 1.0 + 2 ** -9)         # a quarter ulp (2**-7) above 1.0 in bf16
    >>> r = stochastic_round(x, torch.Generator().manual_seed(0))
    >>> sorted(set(r.tolist())), 0.2 < (r > 1).float().mean().item() < 0.3
    ([1.0, 1.0078125], True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["at_least_f32", "upcast", "DTYPES", "Precision", "dtype_of", "stochastic_round", "store",
           "round_generator", "native_bf16", "gemm_dtype", "gemm"]

#: policy names (``--dtype``, ``--master-dtype``, ``--optim-dtype``, ``StepConfig.dtype``) -> torch dtypes
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def at_least_f32(dtype: torch.dtype) -> torch.dtype:
    """``torch.promote_types(dtype, torch.float32)``: the dtype fmoe computes a ``dtype`` input in."""
    return torch.promote_types(dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in :func:`at_least_f32` of its dtype (``t`` itself when it already is)."""
    return t.to(at_least_f32(t.dtype))


@torch.compiler.assume_constant_result
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: torch's CPU capability is AVX-512 (or above)
    and the CPU has ``avx512_bf16`` or AMX tiles (``lscpu`` flags ``avx512_bf16`` / ``amx_bf16``).
    A constant to ``torch.compile`` (no graph break)."""
    cap = torch.backends.cpu.get_cpu_capability()
    return cap.startswith(("AVX512", "AMX")) and (torch.cpu._is_avx512_bf16_supported()
                                                  or torch.cpu._is_amx_tile_supported())


def gemm_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM of ``t`` (and operands of its dtype) runs in: ``t.dtype``, except bf16 on
    a CPU without native bf16 (:func:`native_bf16`): float32, on the same bf16 values.

    Example:
        >>> gemm_dtype(torch.ones(2)), gemm_dtype(torch.ones(2, dtype=torch.bfloat16)) in (torch.bfloat16, torch.float32)
        (torch.float32, True)
    """
    if t.dtype == torch.bfloat16 and t.device.type == "cpu" and not native_bf16():
        return torch.float32
    return t.dtype


def gemm(op: Callable[..., torch.Tensor], x: torch.Tensor, *others: Optional[torch.Tensor]) -> torch.Tensor:
    """``op(x, *others)`` (a GEMM: ``torch.matmul``, ``F.linear``) in :func:`gemm_dtype` of ``x``,
    the result in ``x``'s dtype: ``op`` itself, except bf16 on a CPU without native bf16, where
    it multiplies the same bf16 values in fp32. ``None`` operands (a missing bias) pass through.

    Example:
        >>> a = torch.ones(2, 3, dtype=torch.bfloat16)
        >>> gemm(torch.matmul, a, a.t()).dtype, gemm(torch.matmul, a, a.t()).tolist()
        (torch.bfloat16, [[3.0, 3.0], [3.0, 3.0]])
    """
    ct = gemm_dtype(x)
    if ct == x.dtype:
        return op(x, *others)
    return op(x.to(ct), *(None if t is None else t.to(ct) for t in others)).to(x.dtype)


def dtype_of(name: str, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a policy name (``ValueError`` naming ``field`` and the valid names)."""
    if name not in DTYPES:
        raise ValueError(f"{field} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class Precision:
    """A training precision policy (see the module docstring).

    Attributes:
        compute: ``--dtype``; master: ``--master-dtype``; optim: ``--optim-dtype``.
    """

    compute: str = "fp32"
    master: str = "fp32"
    optim: str = "fp32"

    def __post_init__(self):
        for field in ("compute", "master", "optim"):
            dtype_of(getattr(self, field), f"Precision.{field}")

    @property
    def master_dtype(self) -> torch.dtype:
        return DTYPES[self.master]

    @property
    def optim_dtype(self) -> torch.dtype:
        return DTYPES[self.optim]

    def bytes_per_param(self) -> int:
        """Weights + gradients + two moments, bytes per trained parameter."""
        m, o = self.master_dtype.itemsize, self.optim_dtype.itemsize
        return 2 * m + 2 * o


def round_generator(seed: int, step: int, rank: int, device: torch.device) -> torch.Generator:
    """The generator of one update's stochastic rounding: the same bits for the same
    ``(seed, step, rank)`` (a resumed run repeats them)."""
    g = torch.Generator(device=device)
    g.manual_seed(((seed * 1_000_003 + step) * 1_009 + rank) & 0xFFFF_FFFF_FFFF_FFFF)   # any 64-bit seed
    return g


def stochastic_round(x: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 stochastically: up with probability equal to the dropped
    fraction of the bf16 ulp (unbiased: ``E[round(x)] = x``). Adds 16 random bits below the
    bf16 mantissa and truncates; infinities and NaNs stay what they are.

    Args:
        x: float32 tensor.
        generator: the random source (:func:`round_generator`).
    Returns:
        a bfloat16 tensor of ``x``'s shape.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round: x must be float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    finite = torch.isfinite(x)
    rounded = torch.where(finite, (bits + noise) & -65536, bits & -65536)    # -65536 = 0xFFFF0000
    return rounded.view(torch.float32).to(torch.bfloat16)   # exact: the low 16 bits are zero


def store(x: torch.Tensor, dtype: torch.dtype, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """An fp32 result written back in ``dtype``: itself for fp32, stochastically rounded to
    bf16 when a ``generator`` is given, rounded to nearest otherwise."""
    if dtype == x.dtype:
        return x
    if dtype == torch.bfloat16 and generator is not None and x.dtype == torch.float32:
        return stochastic_round(x, generator)
    return x.to(dtype)
