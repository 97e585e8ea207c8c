"""Autoregressive generation with an explicit cache, for every model in :mod:`fmoe.models`.

``generate(model, params, cfg, prompts, max_new_tokens)`` is a pure function: the model's
cache (``model.init_cache``) goes into ``model.forward(..., cache=cache, positions=pos)`` and
comes back out, nothing is stored between calls, and sampling draws from a generator seeded
with ``seed`` (the same ids for the same inputs, on any mesh).

Prompts of different lengths share one batch by **left padding**: each prompt is right-aligned
in ``S = max(len)`` slots, padding slots hold ``pad_id`` and get position ``-1`` (hidden from
every query; :mod:`fmoe.nn.cache`), real tokens get positions ``0..len-1``, so every row's next
token is at slot ``S`` and the rotary positions equal an unpadded run's. This is what
transformers' ``generate`` does with an ``attention_mask``, so greedy ids match it token for
token.

Each step: logits of the last slot -> ``temperature`` (0: greedy argmax) -> ``top_p`` nucleus
filter -> one draw; rows that produced ``eos_id`` keep emitting ``eos_id`` and generation stops
early once every row has. On a mesh every rank calls ``generate`` with the same prompts (the
model returns full logits everywhere; tp rank 0's draw is broadcast to its tp group so ranks
can never diverge); MoE layers use ``impl`` (``"auto"``: all_reduce when ``ep == tp``, since
decoding needs no gradient).

Example:
    >>> from fmoe.models import qwen3_moe
    >>> cfg = qwen3_moe.Config.tiny()
    >>> out = generate(qwen3_moe, qwen3_moe.init(cfg), cfg, [[1, 2, 3], [4]], max_new_tokens=2)
    >>> out.shape
    torch.Size([2, 5])
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional, Sequence, Union

import torch

from ..collectives import broadcast_from
from . import model_of
from .config import positions_warning
from ..tree import leaves

__all__ = ["generate", "sample", "left_pad", "cache_bytes"]


def cache_bytes(model: Any, cfg: Any, batch: int, max_len: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the whole decoding cache of ``batch`` rows of ``max_len`` slots, computed on the
    meta device (nothing is allocated).

    Example:
        >>> from fmoe.models import qwen3_moe
        >>> cache_bytes(qwen3_moe, qwen3_moe.Config.tiny(), 2, 16) > 0
        True
    """
    with torch.device("meta"):
        cache = model_of(model).init_cache(cfg, batch, max_len, None, dtype=dtype)
    return sum(t.numel() * t.element_size() for t in leaves(cache))


def left_pad(prompts: Union[torch.Tensor, Sequence[Sequence[int]]], pad_id: int = 0,
             vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align prompts in one batch.

    Args:
        prompts: ``[B, S]`` integer tensor, or a list of token-id lists / 1-D tensors.
        pad_id: id written into padding slots.
        vocab_size: when given, every id must lie in ``[0, vocab_size)``.
    Returns:
        ``(tokens [B, S], positions [B, S])`` with position ``-1`` on padding.

    Example:
        >>> left_pad([[5, 6], [7]])
        (tensor([[5, 6],
                [0, 7]]), tensor([[ 0,  1],
                [-1,  0]]))
    """
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2 or prompts.dtype.is_floating_point or prompts.shape[1] == 0:
            raise ValueError(f"generate: a prompt tensor must be a non-empty [B, S] integer tensor, got "
                             f"{prompts.dtype} {tuple(prompts.shape)}")
        rows = [r.tolist() for r in prompts]
    else:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"generate: prompts must be a [B, S] tensor or a list of id lists, got "
                            f"{type(prompts).__name__}")
        rows = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError(f"generate: need at least one prompt and no empty prompt, got lengths {[len(r) for r in rows]}")
    flat = [t for r in rows for t in r]
    if any(isinstance(t, bool) or not isinstance(t, int) for t in flat):
        raise TypeError("generate: prompt ids must be ints")
    if vocab_size is not None and (min(flat) < 0 or max(flat) >= vocab_size):
        raise ValueError(f"generate: prompt ids must lie in [0, {vocab_size}), got min {min(flat)}, max {max(flat)}")
    S = max(map(len, rows))
    tokens = torch.tensor([[pad_id] * (S - len(r)) + r for r in rows], dtype=torch.long)
    positions = torch.tensor([[-1] * (S - len(r)) + list(range(len(r))) for r in rows], dtype=torch.long)
    return tokens, positions


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``logits [B, V]``: argmax when ``temperature == 0``, else a draw
    from ``softmax(logits / temperature)`` restricted to the smallest set of tokens whose
    probability reaches ``top_p`` (the top token always stays).

    Example:
        >>> sample(torch.tensor([[0.0, 2.0, 1.0]])).tolist()
        [1]
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)                # [B, V]
    if top_p < 1:
        p, order = probs.sort(dim=-1, descending=True)
        keep = (p.cumsum(-1) - p) < top_p                                            # mass before < top_p
        probs = torch.zeros_like(probs).scatter(-1, order, p * keep)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)


def _check(max_new_tokens, temperature, top_p, seed, eos_id, cfg) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ValueError(f"generate: temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p must be a number in (0, 1], got {top_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"generate: seed must be an int, got {seed!r}")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)
                               or not 0 <= eos_id < cfg.vocab_size):
        raise ValueError(f"generate: eos_id must be None or an int in [0, {cfg.vocab_size}), got {eos_id!r}")


def _memory() -> int:
    from ..checkpoint.config_check import memory_bytes

    return memory_bytes()


def _same_on_tp(ids: torch.Tensor, mesh: Any) -> torch.Tensor:
    """tp rank 0's ids on every rank of its tp group (ranks of a group share one batch)."""
    if mesh is None or mesh.tp == 1:
        return ids
    return broadcast_from(ids.contiguous(), mesh.group("tp"), group_src=0)


def generate(model: Any, params: Any, cfg: Any, prompts: Union[torch.Tensor, Sequence[Sequence[int]]],
             max_new_tokens: int, *, mesh: Any = None, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, eos_id: Optional[int] = None, pad_id: int = 0, impl: str = "auto",
             router: Optional[Any] = None) -> torch.Tensor:
    """Continue ``prompts`` by up to ``max_new_tokens`` tokens (see the module docstring).

    Args:
        model: a model module (``fmoe.models.qwen3_moe``, ...): ``forward`` and ``init_cache``.
        params: its parameters (plain, or sharded on ``mesh``).
        cfg: its config.
        prompts: ``[B, S]`` ids, or a list of id lists of different lengths.
        max_new_tokens: tokens to add per row.
        mesh: the :class:`fmoe.Mesh` the params live on (None: one process).
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_p: nucleus sampling mass (1: the whole distribution).
        seed: seed of the sampling generator.
        eos_id: stop a row at this id (None: never).
        pad_id: id of the left padding in the returned tensor.
        impl: MoE expert-parallel implementation (``"auto"``).
        router: the router the model was trained with, when not its own (``--router``).
    Returns:
        ``[B, S + n]`` ids: the left-padded prompts and ``n <= max_new_tokens`` new tokens
        (fewer only when every row produced ``eos_id``).
    """
    _check(max_new_tokens, temperature, top_p, seed, eos_id, cfg)
    tokens, positions = left_pad(prompts, pad_id, cfg.vocab_size)
    declared = model_of(model)
    if declared.init_cache is None:
        raise TypeError(f"generate: model {declared.name!r} declares no init_cache")
    device = leaves(params)[0].device
    tokens, positions = tokens.to(device), positions.to(device)
    B, S = tokens.shape
    if max_new_tokens == 0:
        return tokens
    if router is not None and not declared.routed:
        raise ValueError(f"generate: model {declared.name!r} has no MoE layers, so it takes no router")
    kwargs = ({"impl": impl} | ({"router": router} if router is not None else {})) if declared.routed else {}
    dtype = next(t for t in leaves(params) if t.dtype.is_floating_point).dtype
    need = cache_bytes(model, cfg, B, S + max_new_tokens, dtype)                     # before allocating it
    if need > _memory():
        raise ValueError(f"generate: the cache of {B} rows x {S + max_new_tokens} positions needs {need / 1e9:.3g} GB, "
                         f"more than this machine's {_memory() / 1e9:.3g} GB; lower max_new_tokens")
    long = positions_warning(cfg, S + max_new_tokens, f"generate: {S} prompt + {max_new_tokens} new positions")
    if long and (mesh is None or mesh.rank == 0):          # said once (not by every rank), for a run that starts
        warnings.warn(long, stacklevel=2)
    cache = declared.init_cache(cfg, B, S + max_new_tokens, mesh, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    out, done = [tokens], torch.zeros(B, dtype=torch.bool, device=device)
    nxt_pos = positions[:, -1:] + 1                                                   # [B, 1]
    with torch.no_grad():
        logits, cache = declared.forward(params, tokens, cfg, mesh, cache=cache, positions=positions, **kwargs)
        for t in range(max_new_tokens):
            ids = _same_on_tp(sample(logits[:, -1], temperature, top_p, gen), mesh)  # [B]
            if eos_id is not None:
                ids = torch.where(done, torch.full_like(ids, eos_id), ids)
                done = done | (ids == eos_id)
            out.append(ids[:, None])
            if t + 1 == max_new_tokens or (eos_id is not None and bool(done.all())):
                break
            logits, cache = declared.forward(params, ids[:, None], cfg, mesh, cache=cache, positions=nxt_pos + t, **kwargs)
    return torch.cat(out, dim=1)

