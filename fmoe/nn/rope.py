"""Rotary position embedding (RoPE), Llama/Qwen style, with the common frequency scalings.

RoPE rotates each pair of features ``(x[i], x[i + hd/2])`` of a query or key by the angle
``position * inv_freq[i]``. Three steps, each a pure function, so a model can swap any of them
(e.g. pass cos/sin precomputed for its own scaling straight to :func:`apply_rope`):

1. :func:`rope_frequencies` -> ``inv_freq [hd/2]`` and an attention scaling factor, for the
   ``rope_type`` of a Hugging Face ``rope_parameters`` dict: ``default``, ``linear``,
   ``llama3`` (Llama 3.1+) or ``yarn`` (gpt-oss, DeepSeek);
2. :func:`rope_cos_sin` -> ``cos, sin [..., S, hd]`` for given positions (scaled by the factor);
3. :func:`apply_rope` -> ``x * cos + rotate_half(x) * sin`` on ``[B, S, H, hd]``.

The arithmetic follows transformers' ``modeling_rope_utils`` and ``apply_rotary_pos_emb`` op
for op, so fp32 results agree exactly. RoPE acts per head, so tp-sharded heads need nothing.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch

from ..precision import at_least_f32

__all__ = ["rope_frequencies", "rope_cos_sin", "apply_rope", "yarn_mscale", "ROPE_TYPES"]

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long waves: / factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * m * ln(scale) + 1`` (1 when ``scale <= 1``), as
    transformers' ``get_mscale``; DeepSeek also scales its softmax by ``yarn_mscale(factor,
    mscale_all_dim) ** 2``.

    Example:
        >>> round(yarn_mscale(40.0, 1.0), 4)
        1.3689
    """
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: Mapping[str, Any], max_pos: Optional[int]) -> tuple[torch.Tensor, float]:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor")
    if factor is None:
        if max_pos is None:
            raise ValueError("rope_frequencies: yarn without 'factor' needs max_position_embeddings")
        factor = max_pos / old_len

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = float(yarn_mscale(factor, m) / yarn_mscale(factor, m_all)) if m and m_all else yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # dim index that turns `rotations` times
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # share of the unscaled frequency per pair
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attn


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[Mapping[str, Any]] = None,
                     max_position_embeddings: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` and the cos/sin scaling factor.

    Args:
        head_dim: per-head feature size (even).
        theta: RoPE base (``rope_theta``).
        scaling: None or a Hugging Face ``rope_parameters`` / ``rope_scaling`` dict with
            ``rope_type`` in :data:`ROPE_TYPES` and that type's fields.
        max_position_embeddings: only for ``yarn`` without ``factor``.
    Returns:
        ``(inv_freq, attention_scaling)``.

    Example:
        >>> rope_frequencies(4, 10000.0)
        (tensor([1.0000, 0.0100]), 1.0)
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope_frequencies: head_dim must be an even int >= 2, got {head_dim!r}")
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"rope_frequencies: theta must be a positive number, got {theta!r}")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_frequencies: rope_type {kind!r} is not supported; supported: {list(ROPE_TYPES)} "
                         "(or pass your own cos/sin to apply_rope)")
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    inv_freq = _base_inv_freq(head_dim, theta)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq, 1.0


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``positions``.

    Args:
        positions: integer positions ``[S]`` or ``[B, S]``.
        inv_freq: ``[hd / 2]`` from :func:`rope_frequencies`.
        attention_scaling: factor applied to both tables (YaRN), 1.0 otherwise.
        dtype: dtype of the returned tables, computed in at least fp32 (fp64 stays fp64, so a
            float64 model is float64 end to end; bf16/fp16 tables are computed in fp32).
    Returns:
        ``(cos, sin)``, each ``[..., S, hd]``.

    Example:
        >>> cos, sin = rope_cos_sin(torch.arange(3), torch.ones(2))
        >>> cos.shape
        torch.Size([3, 4])
    """
    work = at_least_f32(dtype)
    freqs = positions[..., None].to(work) * inv_freq.to(device=positions.device, dtype=work)
    return torch.ops.fmoe.rope_tables(freqs, float(attention_scaling), dtype)


# The tables as one opaque operator: under torch.compile Inductor would otherwise inline the
# cos / sin computation into every consumer, recomputing both per head in each layer's q and k
# kernels (measured: ~85 ms of a 0.27 s bf16 step of the small preset); an operator's outputs are
# buffers every layer reads. Elementwise over ``freqs``, so its vmap rule is the op itself.
torch.library.define("fmoe::rope_tables", "(Tensor freqs, float scaling, ScalarType dtype) -> (Tensor, Tensor)")


@torch.library.impl("fmoe::rope_tables", "CompositeExplicitAutograd")
def _rope_tables(freqs: torch.Tensor, scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    emb = torch.cat((freqs, freqs), dim=-1)                                     # [..., S, hd]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


@torch.library.register_fake("fmoe::rope_tables")
def _(freqs, scaling, dtype):
    shape = (*freqs.shape[:-1], 2 * freqs.shape[-1])
    return freqs.new_empty(shape, dtype=dtype), freqs.new_empty(shape, dtype=dtype)


@torch.library.register_vmap("fmoe::rope_tables")
def _(info, in_dims, freqs, scaling, dtype):
    d = in_dims[0]
    out = torch.ops.fmoe.rope_tables(freqs if d is None else freqs.movedim(d, 0), scaling, dtype)
    return out, (None if d is None else 0, None if d is None else 0)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys.

    Args:
        x: ``[B, S, H, hd]`` (any number of local heads).
        cos: ``[S, hd]`` or ``[B, S, hd]``.
        sin: same shape as ``cos``.
    Returns:
        ``[B, S, H, hd]``.

    Example:
        >>> cos, sin = rope_cos_sin(torch.arange(3), torch.ones(2))
        >>> apply_rope(torch.ones(1, 3, 2, 4), cos, sin).shape
        torch.Size([1, 3, 2, 4])
    """
    if x.ndim != 4 or cos.shape != sin.shape or cos.shape[-1] != x.shape[-1] or cos.shape[-2] != x.shape[1]:
        piece = x.ndim == 4 and 0 < x.shape[1] < cos.shape[-2] and cos.shape[-2] % x.shape[1] == 0
        raise ValueError(f"apply_rope: x must be [B, S, H, hd] with cos/sin [(B,) S, hd]; got x "
                         f"{tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
                         + ("; with sequence parallelism (a mesh with sp=True) x holds a piece of the sequence "
                            "unless a colwise projection gathered it: rotate the output of a colwise layer, or "
                            "gather a replicated projection's with nn.shared_by_heads, as DeepSeek-V3's MLA does"
                            if piece else ""))
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)
