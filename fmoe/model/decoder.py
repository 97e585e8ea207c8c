"""The decoder scaffold: the start of a forward call, what its layers share, the routed experts,
the dense MLP and the head, so that a model file spells only its own math.

Every model here is a pre-norm decoder; each model's ``forward`` spells it::

    x, ctx, out = kit.start(params, tokens, cfg, mesh, ...)  # checks; x = embed(tokens) [B, S, D] (or hidden=)
    for i, layer in out.layers(params["layers"]):           # all (a pipeline stage: its own); remat kind "layer"
        x = out.keep(*nn.remat.call("layer", block, layer, x, i, ctx, out.entry(i)))
            # block (FSDP-gathered inside): h = x + attention(attn_norm(x)); x = h + (kit.moe or kit.mlp)(mlp_norm(h))
    if out.hands_on(params): return out.result(x, ...)      # a pipeline stage before the last hands x on
    logits = nn.linear(norm(x), kit.lm_head(params, cfg), gather=True)   # [B, S, V], full on every rank
    return out.result(logits, return_aux)                    # (logits, cache, aux) as asked

A model's ``attention(a, x, i, ctx, entry) -> (y, entry)`` reads what the call shares from the
:class:`Context` (config, rotary tables, cache step; mesh, impl, router, expert activation), so
``mesh`` travels in one object, the same for every layer (a regionally compiled layer is traced
once). :class:`Outputs` collects what the layers return outside their remat blocks.

The router loss (:func:`with_aux_loss`, switched by transformers' ``output_router_logits`` and
weighted by ``router_aux_loss_coef``, :data:`AUX_LOSS_FIELDS`) is the Switch load-balance loss
of each MoE layer over the global batch: with E experts, top-K, T tokens, ``f_e`` the fraction of
the T*K routed slots that go to expert e and ``P_e`` the mean router probability of e,
``loss_layer = coef * E * sum_e f_e * P_e``, summed over the layers by the trainer. transformers'
``load_balancing_loss_func`` instead concatenates every layer's logits, so its loss is
``coef * E * sum_e f'_e * P'_e`` with ``f'``, ``P'`` pooled over all layers' tokens and ``f'``
counted per top-K slot without dividing by K: for L MoE layers with equal statistics ours is
``L / K`` times transformers' value (the gradient direction per layer is the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from einops import rearrange

from .. import nn
from ..experts.activations import Activation, swiglu
from ..mesh import Mesh
from ..moe import moe as _moe
from ..routing.aux_losses import with_losses
from ..sharding import placement_of
from ..transforms import refuse_compiled_transform
from .config import rope

__all__ = ["AUX_LOSS_FIELDS", "Context", "Outputs", "start", "moe", "mlp", "lm_head", "with_aux_loss"]

#: transformers' switch and weight of the router's load-balance loss (qwen3_moe, mixtral, gpt_oss):
#: the ``Model.aux_loss_fields`` the trainer sets through ``Model.with_aux_loss``.
AUX_LOSS_FIELDS = ("output_router_logits", "router_aux_loss_coef")


@dataclass(frozen=True)
class Context:
    """What every layer of one forward call shares (the same object for every layer, so a layer
    compiled once by ``fmoe.nn.remat.compiled`` serves them all).

    Attributes:
        cfg, cos, sin: the config; rotary tables of the new tokens' positions.
        step: the cache step (:class:`fmoe.nn.cache.Step`: start slot, key mask).
        mesh, impl, router, act: passed to every ``fmoe.moe`` block (:func:`moe`).
        token_ids: ``[T]`` the ids of the tokens this rank's MoE blocks route, in their row order
            (this rank's piece of the sequence under sequence parallelism), offered to every
            router with the layer index (:data:`fmoe.routing.OFFERED`).
        cp: context parallelism (``mesh.cp > 1``): the layers hold this rank's two chunks of each
            sequence, and a model passes ``cp=ctx.cp`` to ``fmoe.nn.attention``.
    """

    cfg: Any
    cos: torch.Tensor
    sin: torch.Tensor
    step: nn.cache.Step
    mesh: Optional[Mesh] = None
    impl: str = "auto"
    router: Any = None
    act: Activation = swiglu
    token_ids: Optional[torch.Tensor] = None
    cp: Optional[nn.ContextParallel] = None


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


def start(params: dict, tokens: torch.Tensor, cfg: Any, mesh: Optional[Mesh] = None,
          cache: Optional[dict] = None, positions: Optional[torch.Tensor] = None, *, rope_dim: Optional[int] = None,
          impl: str = "auto", router: Any = None, act: Activation = swiglu, hidden: Optional[torch.Tensor] = None,
          ) -> tuple[torch.Tensor, Context, Outputs]:
    """A forward call's start: checks, ``x = embed(tokens)`` (or ``hidden``), the :class:`Context` and :class:`Outputs`.

    The embedding's ``padding_idx`` is ``cfg.pad_token_id`` (:class:`fmoe.model.ModelConfig`): its
    row gets no gradient, as in transformers.

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

    With context parallelism (``mesh.cp > 1``) ``tokens`` are the whole sequences on every cp
    rank, and the layers run on this rank's two chunks (:mod:`fmoe.nn.context_parallel`: their
    tokens, rope positions; ``x``, ``hidden`` and the logits are ``[B, 2 S / (2 cp), ...]``).
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
    if mesh is None and any(placement_of(layer["moe"]["w_gate_up"]).dim_of("ep") is not None
                            for _, layer in Outputs.layers(params["layers"]) if "moe" in layer):
        raise ValueError("forward: mesh is None but the experts are sharded over ep; pass forward(..., mesh=mesh)")
    refuse_compiled_transform(mesh)
    inv_freq, scaling = rope(cfg, rope_dim)
    cp = nn.ContextParallel.of(mesh)
    if cp is not None:                              # this rank's head and tail chunks of each sequence
        if cache is not None or positions is not None:
            raise ValueError(f"forward: context parallelism (cp={cp.size}) splits whole training sequences; decoding "
                             "with a cache or given positions needs a mesh with cp=1")
        step = nn.cache.Step(cp.positions(tokens.shape[1], tokens.device), 0, None)
        tokens = cp.shard(tokens, dim=1)
    else:
        step = nn.cache.begin(tokens, cache, positions)
    if (hidden is None) != ("embed" in params):     # a pipeline stage: hidden= exactly when no embed
        raise ValueError(f"forward: hidden= is the input of a pipeline stage whose params hold no embed, and only "
                         f"of one; got embed: {'embed' in params}, hidden: {hidden is not None}")
    x = nn.embedding(tokens, params["embed"], cfg.pad_token_id) if hidden is None else hidden  # [B, S, D]
    cos, sin = nn.rope_cos_sin(step.positions, inv_freq, scaling, x.dtype)
    ids = tokens
    if mesh is not None and mesh.sp:               # the layers hold this tp rank's piece of the sequence
        S, n, r = tokens.shape[1], mesh.tp, mesh.rank_in("tp")
        ids = tokens[:, r * S // n:(r + 1) * S // n]
    return x, Context(cfg, cos, sin, step, mesh, impl, router, act, ids.reshape(-1), cp), Outputs(cache, step)


def with_aux_loss(router: Any, cfg: Any) -> Any:
    """The router-loss switch (:data:`AUX_LOSS_FIELDS`; the formula: the module docstring).

    Args:
        router: the router of the MoE blocks.
        cfg: a config with ``output_router_logits`` and ``router_aux_loss_coef``.
    Returns:
        with ``output_router_logits`` the router that also returns the weighted Switch
        load-balance loss over the global batch (``aux["load_balance_loss"]``, per layer, summed
        by trainers); else ``router`` itself.

    Example:
        >>> import fmoe
        >>> from fmoe.models import mixtral
        >>> r = with_aux_loss(fmoe.routing.topk(2), mixtral.Config.tiny(output_router_logits=True))
        >>> sorted(r(torch.zeros(3, 8)).aux)
        ['load_balance_loss']
    """
    switch, coef = AUX_LOSS_FIELDS
    return with_losses(router, load_balance=getattr(cfg, coef)) if getattr(cfg, switch) else router


def moe(m: dict, x: torch.Tensor, ctx: Context, i: int) -> tuple[torch.Tensor, dict]:
    """The routed experts, ``fmoe.moe`` over the ``(b s)`` tokens (the call a model's block wraps
    in ``nn.remat.call("moe", ...)``); the router is offered ``token_ids`` and ``layer`` (it gets
    them if it declares them: :data:`fmoe.routing.OFFERED`).

    Args:
        m: the layer's MoE parameters (``router``, ``w_gate_up``, ``w_down``, optional ``shared``).
        x: ``[B, S, D]`` normed hidden states.
        ctx: the call's :class:`Context` (mesh, impl, router, activation, token ids).
        i: the decoder layer's index (offered to the router as ``layer``).
    Returns:
        ``(y [B, S, D], aux)``.

    Example:
        >>> from fmoe.models import mixtral
        >>> cfg = mixtral.Config.tiny()
        >>> _, ctx, _ = start(mixtral.init(cfg), torch.zeros(1, 3, dtype=torch.long), cfg, router=mixtral.default_router(cfg))
        >>> moe(mixtral.init(cfg)["layers"][0]["moe"], torch.randn(1, 3, 64), ctx, 0)[0].shape
        torch.Size([1, 3, 64])
    """
    y, aux = _moe(m, rearrange(x, "b s d -> (b s) d"), router=ctx.router, mesh=ctx.mesh, impl=ctx.impl,
                  act=ctx.act, router_inputs={"token_ids": ctx.token_ids, "layer": i})  # [T, D]
    return rearrange(y, "(b s) d -> b s d", b=x.shape[0]), aux


def lm_head(params: dict, cfg: Any) -> torch.Tensor:
    """The output projection.

    Args:
        params: the model's tree.
        cfg: a config with ``tie_word_embeddings``.
    Returns:
        ``[V, D]``: ``lm_head``, or the embedding with ``tie_word_embeddings``.

    Example:
        >>> from fmoe.models import llama
        >>> cfg = llama.Config.tiny(tie_word_embeddings=True)
        >>> p = llama.init(cfg)
        >>> lm_head(p, cfg) is p["embed"]
        True
    """
    return params["embed" if cfg.tie_word_embeddings else "lm_head"]


def mlp(m: dict, x: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP (:func:`fmoe.nn.swiglu_mlp`).

    Args:
        m: ``w_gate_up [2I, D]`` (gate rows first), ``w_down [D, I]``, optional ``b_gate_up``, ``b_down``.
        x: ``[B, S, D]``.
    Returns:
        ``[B, S, D]``.

    Example:
        >>> m = {"w_gate_up": torch.zeros(8, 4), "w_down": torch.zeros(4, 4)}
        >>> mlp(m, torch.ones(1, 2, 4)).shape
        torch.Size([1, 2, 4])
    """
    return nn.swiglu_mlp(x, m["w_gate_up"], m["w_down"], m.get("b_gate_up"), m.get("b_down"))
