"""A model's parameters from one shape table: every path -> its shape, read by ``init``, by the
checkpoint name map (:func:`fmoe.model.hf_specs`) and by the plan checks, so a shape is never
written twice; the KV cache; the config fields that tensor parallelism must divide.

A model's ``shapes(cfg)`` spells its layer with the helpers here::

    def shapes(cfg):
        D, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        return kit.decoder_shapes(cfg, lambda i: {
            "attn_norm": (D,), **kit.attention_shapes(cfg), "mlp_norm": (D,),
            "moe.router": (E, D), "moe.w_gate_up": (E, 2 * I, D), "moe.w_down": (E, D, I)})

    def init(cfg, seed=0, dtype=torch.float32):
        return kit.init_params(shapes(cfg), cfg.initializer_range, seed, dtype)
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .. import tree as _tree
from ..mesh import Mesh
from ..nn import cache as _cache

__all__ = ["TP_FIELDS", "decoder_shapes", "attention_shapes", "init_params", "init_kv_cache"]

#: (parameter name inside a layer, tensor dim) -> the config field tp must divide when that dim
#: is split over tp: attention by whole heads, a dense MLP or a shared expert by its hidden size
#: (``Model.tp_fields``, checked by :meth:`fmoe.model.Model.build_plan`).
TP_FIELDS = {
    ("attn.wq", 0): "num_attention_heads", ("attn.bq", 0): "num_attention_heads",
    ("attn.wo", 1): "num_attention_heads", ("attn.sinks", 0): "num_attention_heads",
    ("attn.wq_b", 0): "num_attention_heads", ("attn.wkv_b", 0): "num_attention_heads",  # MLA
    ("attn.wk", 0): "num_key_value_heads", ("attn.bk", 0): "num_key_value_heads",
    ("attn.wv", 0): "num_key_value_heads", ("attn.bv", 0): "num_key_value_heads",
    ("mlp.w_gate_up", 0): "intermediate_size", ("mlp.b_gate_up", 0): "intermediate_size",
    ("mlp.w_down", 1): "intermediate_size",
    ("moe.shared.w_gate_up", 0): "shared_expert_intermediate_size",       # transformers' Qwen2-MoE name
    ("moe.shared.w_down", 1): "shared_expert_intermediate_size",
}


def decoder_shapes(cfg: Any, layer: Callable[[int], Mapping[str, tuple]]) -> dict[str, tuple]:
    """Every parameter path -> shape of a decoder, in init order.

    Args:
        cfg: a config with ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``tie_word_embeddings``.
        layer: ``layer(i) -> {name inside layer i: shape}``.
    Returns:
        ``embed [V, D]``, ``layer(i)`` under ``layers.i.`` for each layer, ``norm [D]``,
        ``lm_head [V, D]`` (absent with tied embeddings).

    Example:
        >>> from fmoe.models import llama
        >>> list(decoder_shapes(llama.Config.tiny(), lambda i: {"attn_norm": (64,)}))
        ['embed', 'layers.0.attn_norm', 'layers.1.attn_norm', 'norm', 'lm_head']
    """
    V, D = cfg.vocab_size, cfg.hidden_size
    out = {"embed": (V, D)}
    for i in range(cfg.num_hidden_layers):
        out.update({f"layers.{i}.{name}": shape for name, shape in layer(i).items()})
    out["norm"] = (D,)
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (V, D)
    return out


def attention_shapes(cfg: Any, bias: bool = False) -> dict[str, tuple]:
    """Grouped-query attention projections (H query heads, G KV heads, hd head dim).

    Args:
        cfg: a config with ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``.
        bias: add the biases.
    Returns:
        ``attn.wq [H*hd, D]``, ``attn.wk, attn.wv [G*hd, D]``, ``attn.wo [D, H*hd]``, then with
        ``bias`` ``attn.bq, attn.bk, attn.bv, attn.bo``.

    Example:
        >>> from fmoe.models import llama
        >>> attention_shapes(llama.Config.tiny())["attn.wk"]
        (32, 64)
    """
    D, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {"attn.wq": (q, D), "attn.wk": (kv, D), "attn.wv": (kv, D), "attn.wo": (D, q)}
    return {**out, **({"attn.bq": (q,), "attn.bk": (kv,), "attn.bv": (kv,), "attn.bo": (D,)} if bias else {})}


def init_params(shapes: Mapping[str, tuple], std: float, seed: int, dtype: torch.dtype,
                zeros: Sequence[str] = ()) -> dict:
    """Random parameters of a shape table, drawn in table order from one seeded generator (the
    same tree on every process).

    Args:
        shapes: path -> shape (:func:`decoder_shapes`).
        std: the normal weights' standard deviation.
        seed: the generator's seed.
        dtype: the parameters' dtype.
        zeros: globs of last path segments that start at zero (biases).
    Returns:
        the nested tree: names ending in ``norm`` ones, names matching ``zeros`` zeros, the rest
        normal(0, ``std``).

    Example:
        >>> init_params({"w": (2, 3), "b_w": (2,), "norm": (3,)}, 0.02, 0, torch.float32, zeros=("b_*",))["b_w"]
        tensor([0., 0.])
    """
    g = torch.Generator().manual_seed(seed)

    def make(path: str, shape: tuple) -> torch.Tensor:
        name = path.rsplit(".", 1)[-1]
        if name.endswith("norm"):
            return torch.ones(shape)
        if any(fnmatch.fnmatchcase(name, z) for z in zeros):
            return torch.zeros(shape)
        return torch.randn(shape, generator=g) * std

    return _tree.unflatten({path: make(path, shape).to(dtype) for path, shape in shapes.items()})


def init_kv_cache(cfg: Any, batch: int, max_len: int, mesh: Optional[Mesh] = None,
                  dtype: torch.dtype = torch.float32) -> dict:
    """An empty decoding cache (:mod:`fmoe.nn.cache`) of a grouped-query attention model: the
    ``init_cache`` a model declares on its :class:`fmoe.model.Model`.

    Args:
        cfg: a config with ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``.
        batch: B, the sequences decoded together.
        max_len: L, the slots per sequence (prompt and new tokens).
        mesh: the mesh (the KV heads are split over tp like the attention's).
        dtype: the cache's dtype.
    Returns:
        per layer keys and values ``[B, L, G, hd]``; a sliding window is a mask over the slots.

    Example:
        >>> from fmoe.models import llama
        >>> init_kv_cache(llama.Config.tiny(), 2, 16)["layers"][0]["k"].shape
        torch.Size([2, 16, 2, 16])
    """
    return _cache.kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, batch, max_len, mesh, dtype)
