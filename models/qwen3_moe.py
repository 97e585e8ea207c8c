"""Qwen3-MoE: a decoder whose feed-forward blocks are mixtures of experts, as pure functions.

Numerics follow transformers' ``Qwen3MoeForCausalLM`` op for op: per-head RMSNorm on q and k
before RoPE, no attention bias, softmax-top-k routing (renormalised when ``norm_topk_prob``),
SwiGLU experts. Layers listed in ``mlp_only_layers`` or skipped by ``decoder_sparse_step`` use a
dense SwiGLU MLP instead. Parameters (D hidden, H query heads, G KV heads, hd head dim, E
experts, I expert hidden, V vocab)::

    embed                     [V, D]
    layers.N.attn_norm        [D]
    layers.N.attn.wq          [H*hd, D]     wk, wv [G*hd, D]     wo [D, H*hd]
    layers.N.attn.q_norm      [hd]          k_norm [hd]          (shared by all heads)
    layers.N.mlp_norm         [D]
    layers.N.moe.router       [E, D]
    layers.N.moe.w_gate_up    [E, 2I, D]    gate rows first, then up
    layers.N.moe.w_down       [E, D, I]
    layers.N.mlp.w_gate_up    [2I', D]      (dense layers only; I' = intermediate_size)
    norm                      [D]
    lm_head                   [V, D]        (absent with tie_word_embeddings)

Parallelism lives in :func:`plan` (dense tensor parallelism as in ``llama``, experts on
``P("ep", None, None)``); :func:`forward` only calls layer functions and ``fmoe.moe``, so it
runs unchanged on one process or many and returns the full logits on every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from einops import rearrange

import fmoe
import fmoe.nn as nn

from . import _common
from fmoe import P, Plan
from fmoe.model import Model
from fmoe.checkpoint import Cat, Key, Spec, Stack


@dataclass(frozen=True)
class Config:
    """Qwen3-MoE hyper-parameters, named and defaulted as in transformers' ``Qwen3MoeConfig``."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144        # dense MLP layers only
    moe_intermediate_size: int = 768     # I, per expert
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 64
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()             # sorted (key, value) pairs of a non-default rope_parameters
    max_position_embeddings: int = 32768
    sliding_window: Optional[int] = None  # None unless HF use_sliding_window (then every layer)
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False  # True: each MoE layer adds coef * load-balance loss to aux

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                  "decoder_sparse_step", "max_position_embeddings"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Config: {f} must be an int >= 1, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Config: num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"Config: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}")
        if not isinstance(self.mlp_only_layers, tuple) or not isinstance(self.rope_scaling, tuple):
            raise TypeError(f"Config: mlp_only_layers and rope_scaling must be tuples, got "
                            f"{self.mlp_only_layers!r}, {self.rope_scaling!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"Config: sliding_window must be None or an int >= 1, got {self.sliding_window!r}")
        nn.rope_frequencies(self.head_dim, self.rope_theta, dict(self.rope_scaling) or None,
                            self.max_position_embeddings)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` is a mixture of experts (else a dense MLP), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def tiny(cls, **changes: Any) -> "Config":
        """2 layers, D=64, 8 query / 4 KV heads, 8 experts top-2: tp <= 4 and ep <= 8 divide it.
        ``Config.tiny(num_key_value_heads=8)`` is the variant for tp=8."""
        return cls(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256),
                      **changes})

    @classmethod
    def small(cls) -> "Config":
        """4 layers, D=256, 32 experts top-4: for examples and benchmarks (about 27M parameters)."""
        return cls(vocab_size=2048, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=32,
                   num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=1024)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Config":
        """Read a Hugging Face ``config.json`` dict.

        Example:
            >>> Config.from_hf(Config.tiny().to_hf()) == Config.tiny()
            True
        """
        for key, want in (("model_type", "qwen3_moe"), ("hidden_act", "silu"), ("attention_bias", False)):
            if hf.get(key, want) != want:
                raise ValueError(f"Config.from_hf: {key} must be {want!r}, got {hf.get(key)!r}")
        theta, scaling = _common.rope_from_hf(hf, cls.rope_theta)
        skip = ("rope_theta", "rope_scaling", "sliding_window", "mlp_only_layers", "num_experts")
        kw = {f.name: hf[f.name] for f in fields(cls) if f.name in hf and f.name not in skip}
        kw["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        kw["num_experts"] = hf.get("num_experts", hf.get("num_local_experts", cls.num_experts))
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        return cls(rope_theta=theta, rope_scaling=scaling,
                   sliding_window=window, mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()), **kw)

    def to_hf(self) -> dict:
        """The ``config.json`` fields transformers' ``Qwen3MoeConfig`` reads."""
        out = {k: v for k, v in asdict(self).items() if k not in ("rope_theta", "rope_scaling", "sliding_window")}
        rope = {"rope_type": "default", **dict(self.rope_scaling), "rope_theta": self.rope_theta}
        return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_act": "silu",
                "attention_bias": False, **out, "mlp_only_layers": list(self.mlp_only_layers),
                "use_sliding_window": self.sliding_window is not None, "sliding_window": self.sliding_window,
                "rope_parameters": rope}


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters (normal(0, initializer_range) weights, unit norms); the same seed gives
    the same tree on every process.

    Example:
        >>> init(Config.tiny())["layers"][0]["moe"]["w_gate_up"].shape
        torch.Size([8, 64, 64])
    """
    g = torch.Generator().manual_seed(seed)
    make = lambda path, shape: (torch.ones(shape) if path.endswith("norm")  # noqa: E731
                                else torch.randn(shape, generator=g) * cfg.initializer_range)
    return fmoe.tree.unflatten({path: make(path, s.shape).to(dtype) for path, s in hf_specs(cfg).items()})


def init_cache(cfg: Config, batch: int, max_len: int, mesh: Optional[fmoe.Mesh] = None,
               dtype: torch.dtype = torch.float32) -> dict:
    """An empty decoding cache: per layer keys and values ``[B, L, G, hd]``, split over tp like
    the KV heads (:mod:`fmoe.nn.cache`).

    Example:
        >>> init_cache(Config.tiny(), 2, 16)["layers"][0]["k"].shape
        torch.Size([2, 16, 4, 8])
    """
    return nn.cache.kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, batch, max_len, mesh, dtype)


def _attention(a: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config,
               step: nn.cache.Step, entry: Optional[dict]) -> tuple[torch.Tensor, Optional[dict]]:
    heads = lambda t: rearrange(t, "b s (h d) -> b s h d", d=cfg.head_dim)  # noqa: E731
    eps, H, G = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    q = nn.head_rms_norm(heads(nn.linear(x, a["wq"])), a["q_norm"], eps, num_heads=H)  # [B, S, H_local, hd]
    k = nn.head_rms_norm(heads(nn.linear(x, a["wk"])), a["k_norm"], eps, num_heads=G)  # [B, S, G_local, hd]
    v = heads(nn.linear(x, a["wv"]))
    q, k = nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin)
    if entry is not None:
        entry, (k, v) = nn.cache.write(entry, step, k=k, v=v)  # k, v: [B, cached + S, G_local, hd]
    o = nn.attention(q, k, v, causal=True, window=cfg.sliding_window, num_kv_groups=H // G, key_mask=step.key_mask)
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"]), entry  # [B, S, D]


def _router(router, cfg: Config):
    """With ``output_router_logits`` the router also returns the weighted Switch load-balance
    loss over the global batch (``aux["load_balance_loss"]``; per layer, summed by trainers)."""
    return fmoe.routing.aux_losses.with_losses(router, load_balance=cfg.router_aux_loss_coef) if cfg.output_router_logits else router


def _moe(m: dict, x: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh], impl: str,
         router: Optional[Any] = None) -> tuple[torch.Tensor, dict]:
    router = router or fmoe.routing.topk(cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob)
    y, aux = fmoe.moe(m, rearrange(x, "b s d -> (b s) d"), router=_router(router, cfg), mesh=mesh, impl=impl)  # [T, D]
    return rearrange(y, "(b s) d -> b s d", b=x.shape[0]), aux


def _layer(layer: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config,
           mesh: Optional[fmoe.Mesh], impl: str, router: Optional[Any], step: Any,
           layer_cache: Optional[dict]) -> tuple[torch.Tensor, Optional[dict], Any]:
    """One decoder layer: ``h [B, S, D]`` -> ``(h, aux of its MoE block or None, cache entry)``."""
    y, entry = _attention(layer["attn"], nn.rms_norm(h, layer["attn_norm"], cfg.rms_norm_eps), cos, sin, cfg, step,
                          layer_cache)
    h = h + y
    x = nn.rms_norm(h, layer["mlp_norm"], cfg.rms_norm_eps)
    if "moe" not in layer:
        return h + nn.swiglu_mlp(x, layer["mlp"]["w_gate_up"], layer["mlp"]["w_down"]), None, entry
    y, aux = fmoe.remat.call("moe", _moe, layer["moe"], x, cfg, mesh, impl, router)
    return h + y, aux, entry


def forward(params: dict, tokens: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh] = None, *,
            impl: str = "auto", return_aux: bool = False,
            router: Optional[Any] = None, cache: Optional[dict] = None,
            positions: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple]:
    """Logits of the causal language model.

    Args:
        params: tree from :func:`init` / :func:`load_hf` (plain, or sharded by a plan).
        tokens: ``[B, S]`` integer ids (the same on every rank of a tp group).
        cfg: the config.
        mesh: the :class:`fmoe.Mesh` the params are sharded on (required when experts are on ep).
        impl: expert-parallel implementation for ``fmoe.moe`` (``"auto"``, ``"all_to_all"``, ...).
        return_aux: also return ``{"moe": [aux of each MoE layer, in order]}``.
        router: replaces the model's router in every MoE layer (any ``fmoe.routing`` router or
            your own ``router(logits) -> Routing``): for routing research on a real model.
        cache: a cache from :func:`init_cache` to decode with (then the new cache is returned
            after the logits; see :mod:`fmoe.nn.cache`).
        positions: ``[S]`` or ``[B, S]`` rotary positions of the tokens, ``-1`` for left padding;
            default: right after the cached tokens.
    Returns:
        logits ``[B, S, V]``, full on every rank; ``(logits, cache)`` with a cache; aux last with
        ``return_aux``.

    Example:
        >>> cfg = Config.tiny()
        >>> forward(init(cfg), torch.zeros(2, 5, dtype=torch.long), cfg).shape
        torch.Size([2, 5, 128])
    """
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.numel() == 0:
        raise ValueError(f"forward: tokens must be a non-empty [B, S] integer tensor, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    if mesh is None and any(fmoe.placement_of(layer["moe"]["w_gate_up"]).dim_of("ep") is not None
                            for layer in params["layers"] if "moe" in layer):
        raise ValueError("forward: mesh is None but the experts are sharded over ep; pass forward(..., mesh=mesh)")
    inv_freq, scaling = nn.rope_frequencies(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling) or None,
                                            cfg.max_position_embeddings)
    step = nn.cache.begin(tokens, cache, positions)
    h = nn.embedding(tokens, params["embed"])  # [B, S, D]
    cos, sin = nn.rope_cos_sin(step.positions, inv_freq, scaling, h.dtype)
    auxes, entries = [], []
    for i, layer in enumerate(fmoe.unsharded_layers(params["layers"])):  # FSDP: one gather per layer
        h, aux, entry = fmoe.remat.call("layer", _layer, layer, h, cos, sin, cfg, mesh, impl, router, step,
                                        None if cache is None else cache["layers"][i])
        entries.append(entry)
        auxes += [aux] if aux is not None else []
    h = nn.rms_norm(h, params["norm"], cfg.rms_norm_eps)
    logits = nn.linear(h, params["embed" if cfg.tie_word_embeddings else "lm_head"], gather=True)  # [B, S, V]
    return nn.cache.outputs(logits, cache, step, entries, {"moe": auxes} if return_aux else None)


def plan(cfg: Config) -> Plan:
    """Default plan (non-strict; unnamed leaves replicated): q/k/v colwise, o rowwise, q/k norms
    replicated, experts on ``ep``, router replicated, dense MLPs packed colwise / rowwise,
    embedding vocab-parallel, lm_head colwise with gathered output.

    Example:
        >>> plan(Config.tiny()).match("layers.1.moe.w_down")
        ('layers.*.moe.w_*', 'expert')
    """
    return Plan({
        "embed": "vocab", "layers.*.attn.w[qkv]": "colwise", "layers.*.attn.wo": "rowwise",
        "layers.*.attn.[qk]_norm": "replicate", "layers.*.moe.router": "replicate", "layers.*.moe.w_*": "expert",
        **({} if all(map(cfg.is_sparse, range(cfg.num_hidden_layers))) else
           {"layers.*.mlp.w_gate_up": "packed_colwise", "layers.*.mlp.w_down": "rowwise"}),
        **({} if cfg.tie_word_embeddings else {"lm_head": "colwise_gather"}),
    }, default=P(), strict=False)


# ---------------------------------------------------------------------------- checkpoint name map
HF_IGNORE = ("**.rotary_emb.inv_freq",)


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, Spec]:
    """Every parameter path -> how it is made of checkpoint tensors (shapes included).

    Experts are read from per-expert keys (``mlp.experts.3.gate_proj.weight``, what
    ``save_pretrained`` writes) or, when ``keys`` holds them, from the fused in-memory keys
    (``mlp.experts.gate_up_proj [E, 2I, D]``, ``mlp.experts.down_proj [E, D, I]``).

    Example:
        >>> hf_specs(Config.tiny())["layers.0.moe.w_down"].shape
        (8, 64, 32)
    """
    V, D, E, I, Id = cfg.vocab_size, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    hd, q, kv = cfg.head_dim, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    keys = set(keys or ())
    s: dict[str, Spec] = {"embed": Key("model.embed_tokens.weight", (V, D))}
    for i in range(cfg.num_hidden_layers):
        p, k = f"layers.{i}.", f"model.layers.{i}."
        s[p + "attn_norm"] = Key(k + "input_layernorm.weight", (D,))
        for x, shape in (("q", (q, D)), ("k", (kv, D)), ("v", (kv, D)), ("o", (D, q))):
            s[p + f"attn.w{x}"] = Key(k + f"self_attn.{x}_proj.weight", shape)
        s[p + "attn.q_norm"] = Key(k + "self_attn.q_norm.weight", (hd,))
        s[p + "attn.k_norm"] = Key(k + "self_attn.k_norm.weight", (hd,))
        s[p + "mlp_norm"] = Key(k + "post_attention_layernorm.weight", (D,))
        m = k + "mlp."
        if not cfg.is_sparse(i):
            s[p + "mlp.w_gate_up"] = Cat([Key(m + "gate_proj.weight", (Id, D)), Key(m + "up_proj.weight", (Id, D))], 0)
            s[p + "mlp.w_down"] = Key(m + "down_proj.weight", (D, Id))
            continue
        s[p + "moe.router"] = Key(m + "gate.weight", (E, D))
        if m + "experts.gate_up_proj" in keys:  # fused layout
            s[p + "moe.w_gate_up"] = Key(m + "experts.gate_up_proj", (E, 2 * I, D))
            s[p + "moe.w_down"] = Key(m + "experts.down_proj", (E, D, I))
        else:  # one key per expert and projection, stacked on a new expert dim
            per = lambda n, shape: Stack([Key(f"{m}experts.{e}.{n}.weight", shape) for e in range(E)])  # noqa: E731
            s[p + "moe.w_gate_up"] = Cat([per("gate_proj", (I, D)), per("up_proj", (I, D))], dim=1)
            s[p + "moe.w_down"] = per("down_proj", (D, I))
    s["norm"] = Key("model.norm.weight", (D,))
    if not cfg.tie_word_embeddings:
        s["lm_head"] = Key("lm_head.weight", (V, D))
    return s


# ---------------------------------------------------------------------------- the declared interface
MODEL = Model("qwen3_moe", Config, init, forward, plan, hf_specs, hf_ignore=HF_IGNORE,
              tp_fields=_common.TP_FIELDS, init_cache=init_cache,
              aux_loss_fields=_common.AUX_LOSS_FIELDS,
              hf_router=("topk", {"k": "num_experts_per_tok", "normalize": "norm_topk_prob"}, {}))
check_plan, shard, load_hf, save_hf = MODEL.check_plan, MODEL.shard, MODEL.load_hf, MODEL.save_hf
