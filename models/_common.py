"""The model skeleton: what every model file shares, so that a model file reads top to bottom as
its ``Config``, its math (attention, one decoder ``block``, the layer loop in ``forward``), its
plan and its checkpoint name map (read by :mod:`._hf`).

Every model here is the same pre-norm decoder; each model's ``forward`` spells it::

    x, ctx, out = start(params, tokens, cfg, mesh, ...)  # checks; x = embed(tokens) [B, S, D] (or hidden=)
    for i, layer in out.layers(params["layers"]):       # all (a pipeline stage: its own); remat kind "layer"
        x = out.keep(*remat.call("layer", block, layer, x, i, ctx, out.entry(i)))
            # block (FSDP-gathered inside): h = x + attention(attn_norm(x)); x = h + (moe or mlp)(mlp_norm(h))
    if out.hands_on(params): return out.result(x, ...)  # a pipeline stage before the last hands x on
    logits = lm_head(norm(x))                            # [B, S, V], full on every rank
    return out.result(logits, return_aux)                # (logits, cache, aux) as asked

A model's ``attention(a, x, i, ctx, entry) -> (y, entry)`` reads what the call shares from a
:class:`Context` (config, rotary tables, cache step; mesh, impl, router, expert activation), so
``mesh`` travels in one object. Around it: config checks from the field annotations
(:func:`check_config`; the ``Config`` base, presets, ``config.json``: :class:`fmoe.models._hf.ModelConfig`),
parameters from one shape table (:func:`decoder_shapes`, :func:`init_params`), the KV cache, the
router-loss switch (:func:`with_aux_loss`); ``load_hf``, ``save_hf``, ``shard``, ``check_plan``, a
default ``init_cache`` are :class:`fmoe.model.Model` methods (:meth:`fmoe.model.Model.attribute`).
"""

from __future__ import annotations

import fnmatch
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from einops import rearrange

import fmoe
import fmoe.nn as nn
from fmoe.experts.activations import Activation, swiglu
from fmoe.routing.aux_losses import with_losses

__all__ = ["TP_FIELDS", "AUX_LOSS_FIELDS", "check_config", "rope", "decoder_shapes",
           "attention_shapes", "init_params", "init_kv_cache", "Context", "Outputs", "start", "moe", "lm_head", "mlp",
           "with_aux_loss"]

#: (parameter name inside a layer, tensor dim) -> the config field tp must divide when that dim
#: is split over tp: attention by whole heads, a dense MLP by its hidden size.
TP_FIELDS = {
    ("attn.wq", 0): "num_attention_heads", ("attn.bq", 0): "num_attention_heads",
    ("attn.wo", 1): "num_attention_heads", ("attn.sinks", 0): "num_attention_heads",
    ("attn.wq_b", 0): "num_attention_heads", ("attn.wkv_b", 0): "num_attention_heads",  # MLA
    ("attn.wk", 0): "num_key_value_heads", ("attn.bk", 0): "num_key_value_heads",
    ("attn.wv", 0): "num_key_value_heads", ("attn.bv", 0): "num_key_value_heads",
    ("mlp.w_gate_up", 0): "intermediate_size", ("mlp.b_gate_up", 0): "intermediate_size",
    ("mlp.w_down", 1): "intermediate_size",
}

#: transformers' switch and weight of the router's load-balance loss (qwen3_moe, mixtral, gpt_oss):
#: the ``Model.aux_loss_fields`` the trainer sets through ``Model.with_aux_loss``.
AUX_LOSS_FIELDS = ("output_router_logits", "router_aux_loss_coef")


# ---------------------------------------------------------------------------- configs
def check_config(cfg: Any, *, kv_heads: Optional[str] = "num_key_value_heads", experts: Optional[str] = None,
                 at_least_zero: Sequence[str] = (), rope_dim: Optional[int] = None) -> None:
    """The checks every ``Config.__post_init__`` shares, read from the field annotations, in field
    order: an ``int`` field is an int >= 1 (>= 0 if named in ``at_least_zero``), an
    ``Optional[int]`` None or that, a ``tuple`` a tuple; then query heads a multiple of
    ``kv_heads``, top-k at most ``experts``, and the rope settings valid
    (:func:`fmoe.nn.rope_frequencies` over ``rope_dim`` features, default ``cfg.head_dim``).

    Example:
        >>> from fmoe.models import mixtral
        >>> mixtral.Config.tiny(num_experts_per_tok=9)
        Traceback (most recent call last):
        ValueError: Config: num_experts_per_tok=9 exceeds num_local_experts=8
    """
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        v, hint, low = getattr(cfg, f.name), hints[f.name], 0 if f.name in at_least_zero else 1
        if hint is int or (hint == Optional[int] and v is not None):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"Config: {f.name} must be {'None or ' * (hint is not int)}an int >= {low}, got {v!r}")
        elif hint is tuple and not isinstance(v, tuple):
            raise TypeError(f"Config: {f.name} must be a tuple, got {v!r}")
    if kv_heads is not None and cfg.num_attention_heads % getattr(cfg, kv_heads):
        raise ValueError(f"Config: num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                         f"{kv_heads}={getattr(cfg, kv_heads)}")
    if experts is not None and cfg.num_experts_per_tok > getattr(cfg, experts):
        raise ValueError(f"Config: num_experts_per_tok={cfg.num_experts_per_tok} exceeds "
                         f"{experts}={getattr(cfg, experts)}")
    rope(cfg, rope_dim)


def rope(cfg: Any, dim: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention scaling)`` of the config's rope over ``dim`` features (default ``head_dim``)."""
    return nn.rope_frequencies(cfg.head_dim if dim is None else dim, cfg.rope_theta, dict(cfg.rope_scaling) or None,
                               cfg.max_position_embeddings)


# ---------------------------------------------------------------------------- parameters
def decoder_shapes(cfg: Any, layer: Callable[[int], Mapping[str, tuple]]) -> dict[str, tuple]:
    """Every parameter path -> shape, in init order: ``embed [V, D]``, ``layer(i)`` under
    ``layers.i.`` for each layer, ``norm [D]``, ``lm_head [V, D]`` (absent with tied embeddings).

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
    """Grouped-query attention projections (H query heads, G KV heads, hd head dim): ``wq [H*hd, D]``,
    ``wk, wv [G*hd, D]``, ``wo [D, H*hd]``, then with ``bias`` ``bq, bk, bv, bo``.

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
    """Parameters of ``shapes``, drawn in table order from one seeded generator: names ending in
    ``norm`` are ones, names matching a glob of ``zeros`` zeros, the rest normal(0, ``std``).

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

    return fmoe.tree.unflatten({path: make(path, shape).to(dtype) for path, shape in shapes.items()})


def init_kv_cache(cfg: Any, batch: int, max_len: int, mesh: Optional[fmoe.Mesh] = None,
                  dtype: torch.dtype = torch.float32) -> dict:
    """An empty decoding cache (:mod:`fmoe.nn.cache`): per layer keys and values ``[B, L, G, hd]``
    (G KV heads), split over tp like the KV heads; a sliding window is a mask over the slots.

    Example:
        >>> from fmoe.models import llama
        >>> init_kv_cache(llama.Config.tiny(), 2, 16)["layers"][0]["k"].shape
        torch.Size([2, 16, 2, 16])
    """
    return nn.cache.kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, batch, max_len, mesh, dtype)


# ---------------------------------------------------------------------------- forward
@dataclass(frozen=True)
class Context:
    """What every layer of one forward call shares (the same object for every layer, so a layer
    compiled once by ``fmoe.nn.remat.compiled`` serves them all).

    Attributes:
        cfg, cos, sin: the config; rotary tables of the new tokens' positions.
        step: the cache step (:class:`fmoe.nn.cache.Step`: start slot, key mask).
        mesh, impl, router, act: passed to every ``fmoe.moe`` block (:func:`moe`).
    """

    cfg: Any
    cos: torch.Tensor
    sin: torch.Tensor
    step: nn.cache.Step
    mesh: Optional[fmoe.Mesh] = None
    impl: str = "auto"
    router: Any = None
    act: Activation = swiglu


@dataclass
class Outputs:
    """What one forward's layers return, kept outside their remat blocks: per layer aux and cache entry."""

    cache: Optional[dict]
    step: nn.cache.Step
    auxes: list = field(default_factory=list)
    entries: list = field(default_factory=list)

    @staticmethod
    def layers(layers: list) -> list[tuple[int, dict]]:
        """``(i, layer)`` of the layers a tree holds (a pipeline stage's: the others are None)."""
        return [(i, layer) for i, layer in enumerate(layers) if layer is not None]

    @staticmethod
    def hands_on(params: dict) -> bool:
        """``params`` are a pipeline stage before the last (no final ``norm``): it returns ``x``."""
        return "norm" not in params

    def entry(self, i: int) -> Optional[dict]:
        """Layer ``i``'s cache entry (None without a cache)."""
        return None if self.cache is None else self.cache["layers"][i]

    def keep(self, x: torch.Tensor, aux: Optional[dict], entry: Optional[dict]) -> torch.Tensor:
        """Record a layer's ``aux`` and cache ``entry``; returns its output ``x``."""
        self.auxes.append(aux)
        self.entries.append(entry)
        return x

    def result(self, logits: torch.Tensor, return_aux: bool = False) -> Any:
        """``logits``, then the new cache when decoding, then ``{"moe": [aux of each MoE block]}``
        with ``return_aux`` (:func:`fmoe.nn.cache.outputs`)."""
        aux = {"moe": [a for a in self.auxes if a is not None]} if return_aux else None
        return nn.cache.outputs(logits, self.cache, self.step, self.entries, aux)


def start(params: dict, tokens: torch.Tensor, cfg: Any, mesh: Optional[fmoe.Mesh] = None,
          cache: Optional[dict] = None, positions: Optional[torch.Tensor] = None, *, rope_dim: Optional[int] = None,
          impl: str = "auto", router: Any = None, act: Activation = swiglu, hidden: Optional[torch.Tensor] = None,
          ) -> tuple[torch.Tensor, Context, Outputs]:
    """A forward call's start: checks, ``x = embed(tokens)`` (or ``hidden``), the :class:`Context` and :class:`Outputs`.

    Args:
        params: tree from the model's ``init`` / ``load_hf`` (plain, or sharded by a plan).
        tokens: ``[B, S]`` integer ids (the same on every rank of a tp group).
        cfg: the model's config.
        mesh: the :class:`fmoe.Mesh` of the params (needed for experts on ep; placements travel with them).
        cache: a cache from the model's ``init_cache`` to decode with (:mod:`fmoe.nn.cache`).
        positions: ``[S]`` / ``[B, S]`` rotary positions, ``-1`` for left padding (default: after the cache).
        rope_dim: rotary features (default ``cfg.head_dim``).
        impl: expert-parallel implementation of every ``fmoe.moe`` (``"auto"``, ``"all_to_all"``, ...).
        router: the router of every MoE block (any ``fmoe.routing`` router or ``router(logits) -> Routing``).
        act: the experts' activation.
        hidden: a pipeline stage's input ``[B, S, D]`` instead of the embedding (its ``params``
            hold no ``embed``; :mod:`fmoe.training.pipeline`); ``tokens`` give the positions.
    Returns:
        ``(x [B, S, D], ctx, out)``.

    Example:
        >>> from fmoe.models import llama
        >>> x, ctx, out = start(llama.init(llama.Config.tiny()), torch.zeros(1, 3, dtype=torch.long), llama.Config.tiny())
        >>> x.shape, ctx.cos.shape
        (torch.Size([1, 3, 64]), torch.Size([3, 16]))
    """
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.numel() == 0:
        raise ValueError(f"forward: tokens must be a non-empty [B, S] integer tensor, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    if mesh is None and any(fmoe.placement_of(layer["moe"]["w_gate_up"]).dim_of("ep") is not None
                            for _, layer in Outputs.layers(params["layers"]) if "moe" in layer):
        raise ValueError("forward: mesh is None but the experts are sharded over ep; pass forward(..., mesh=mesh)")
    fmoe.transforms.refuse_compiled_transform(mesh)
    inv_freq, scaling = rope(cfg, rope_dim)
    step = nn.cache.begin(tokens, cache, positions)
    if (hidden is None) != ("embed" in params):     # a pipeline stage: hidden= exactly when no embed
        raise ValueError(f"forward: hidden= is the input of a pipeline stage whose params hold no embed, and only "
                         f"of one; got embed: {'embed' in params}, hidden: {hidden is not None}")
    x = nn.embedding(tokens, params["embed"]) if hidden is None else hidden  # [B, S, D]
    cos, sin = nn.rope_cos_sin(step.positions, inv_freq, scaling, x.dtype)
    return x, Context(cfg, cos, sin, step, mesh, impl, router, act), Outputs(cache, step)


def with_aux_loss(router: Any, cfg: Any) -> Any:
    """The router-loss switch (:data:`AUX_LOSS_FIELDS`): with ``output_router_logits`` the router
    also returns the weighted Switch load-balance loss over the global batch
    (``aux["load_balance_loss"]``, per layer, summed by trainers); else ``router`` itself.

    Example:
        >>> from fmoe.models import mixtral
        >>> r = with_aux_loss(fmoe.routing.topk(2), mixtral.Config.tiny(output_router_logits=True))
        >>> sorted(r(torch.zeros(3, 8)).aux)
        ['load_balance_loss']
    """
    switch, coef = AUX_LOSS_FIELDS
    return with_losses(router, load_balance=getattr(cfg, coef)) if getattr(cfg, switch) else router


def moe(m: dict, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dict]:
    """The routed experts, ``fmoe.moe`` over the ``(b s)`` tokens: ``x [B, S, D] -> (y [B, S, D], aux)``
    (the call a model's block wraps in ``nn.remat.call("moe", ...)``)."""
    y, aux = fmoe.moe(m, rearrange(x, "b s d -> (b s) d"), router=ctx.router, mesh=ctx.mesh, impl=ctx.impl,
                      act=ctx.act)  # [T, D]
    return rearrange(y, "(b s) d -> b s d", b=x.shape[0]), aux


def lm_head(params: dict, cfg: Any) -> torch.Tensor:
    """The output projection ``[V, D]``: ``lm_head``, or the embedding with ``tie_word_embeddings``."""
    return params["embed" if cfg.tie_word_embeddings else "lm_head"]


def mlp(m: dict, x: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP (``w_gate_up [2I, D]``, ``w_down [D, I]``, optional biases): ``x [B, S, D] -> [B, S, D]``."""
    return nn.swiglu_mlp(x, m["w_gate_up"], m["w_down"], m.get("b_gate_up"), m.get("b_down"))
