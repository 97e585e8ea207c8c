"""gpt-oss: attention sinks, biases everywhere and clamped-SwiGLU experts, as pure functions.

Numerics follow transformers' ``GptOssForCausalLM`` op for op: q/k/v/o projections with biases,
YaRN RoPE (when configured), one learned sink logit per query head in the softmax denominator,
sliding-window and full attention alternating by ``layer_types``, a router with a bias doing
top-k on the logits then softmax over the k kept, experts with biases and the clamped SwiGLU
``(clamp(up) + 1) * gate * sigmoid(alpha * gate)`` (gate clamped above at ``limit``).
Parameters (D hidden, H query heads, G KV heads, hd head dim, E experts, I expert hidden)::

    embed                     [V, D]
    layers.N.attn_norm        [D]
    layers.N.attn.wq          [H*hd, D]     wk, wv [G*hd, D]     wo [D, H*hd]
    layers.N.attn.bq          [H*hd]        bk, bv [G*hd]        bo [D]   (with attention_bias)
    layers.N.attn.sinks       [H]
    layers.N.mlp_norm         [D]
    layers.N.moe.router       [E, D]        router_bias [E]
    layers.N.moe.w_gate_up    [E, 2I, D]    gate rows first, then up;  b_gate_up [E, 2I]
    layers.N.moe.w_down       [E, D, I]     b_down [E, D]
    norm                      [D]
    lm_head                   [V, D]        (absent with tie_word_embeddings)

The checkpoint stores experts for ``x @ W``: ``gate_up_proj [E, D, 2I]`` with gate and up
*interleaved* on the last dim (gate = ``[..., ::2]``) and ``down_proj [E, I, D]``; the specs
de-interleave and transpose them (per-rank reads stay strided slices of the file). MXFP4
quantized checkpoints (``*_blocks`` / ``*_scales`` keys) must be dequantized first.
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
from fmoe.checkpoint import Deinterleave, Key, Spec, Transpose

_YARN = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0), ("original_max_position_embeddings", 4096),
         ("rope_type", "yarn"), ("truncate", False))
_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Config:
    """gpt-oss hyper-parameters, named and defaulted as in transformers' ``GptOssConfig``
    (gpt-oss-20b has 24 layers and 32 experts, gpt-oss-120b 36 and 128)."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880        # I, per expert
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: tuple = ()              # one of _LAYER_TYPES per layer; () = alternate, sliding first
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: tuple = _YARN          # sorted (key, value) pairs of rope_parameters; () = plain RoPE
    max_position_embeddings: int = 131072
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False  # True: each MoE layer adds coef * load-balance loss to aux

    @property
    def num_experts(self) -> int:
        """E (``num_local_experts`` in the HF config)."""
        return self.num_local_experts

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
                  "max_position_embeddings"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Config: {f} must be an int >= 1, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Config: num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"Config: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_local_experts={self.num_local_experts}")
        if not isinstance(self.layer_types, tuple) or not isinstance(self.rope_scaling, tuple):
            raise TypeError(f"Config: layer_types and rope_scaling must be tuples, got {self.layer_types!r}, "
                            f"{self.rope_scaling!r}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(_LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(_LAYER_TYPES):
            raise ValueError(f"Config: layer_types must list one of {_LAYER_TYPES} per layer "
                             f"(num_hidden_layers={self.num_hidden_layers}), got {self.layer_types!r}")
        nn.rope_frequencies(self.head_dim, self.rope_theta, dict(self.rope_scaling) or None,
                            self.max_position_embeddings)

    @classmethod
    def tiny(cls, **changes: Any) -> "Config":
        """2 layers (sliding window 4, then full), D=64, 8 query / 4 KV heads, 8 experts top-2,
        YaRN RoPE: tp <= 4 and ep <= 8 divide it; ``Config.tiny(num_key_value_heads=8)`` for tp=8."""
        return cls(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_local_experts=8,
                           num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256), **changes})

    @classmethod
    def small(cls) -> "Config":
        """4 layers, D=256, 32 experts top-4: for examples and benchmarks (about 27M parameters)."""
        return cls(vocab_size=2048, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_local_experts=32,
                   sliding_window=64, max_position_embeddings=1024)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Config":
        """Read a Hugging Face ``config.json`` dict.

        Example:
            >>> Config.from_hf(Config.tiny().to_hf()) == Config.tiny()
            True
        """
        if hf.get("model_type", "gpt_oss") != "gpt_oss":
            raise ValueError(f"Config.from_hf: model_type must be 'gpt_oss', got {hf.get('model_type')!r}")
        theta, scaling = _common.rope_from_hf(hf, cls.rope_theta, default=_YARN)  # none given: gpt-oss's YaRN
        kw = {f.name: hf[f.name] for f in fields(cls)
              if hf.get(f.name) is not None and f.name not in ("rope_theta", "rope_scaling", "layer_types")}
        kw["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        return cls(rope_theta=theta, rope_scaling=scaling,
                   layer_types=tuple(hf.get("layer_types") or ()), **kw)

    def to_hf(self) -> dict:
        """The ``config.json`` fields transformers' ``GptOssConfig`` reads."""
        out = {k: v for k, v in asdict(self).items() if k not in ("rope_theta", "rope_scaling", "layer_types")}
        rope = {"rope_type": "default", **dict(self.rope_scaling), "rope_theta": self.rope_theta}
        return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_act": "silu", **out,
                "layer_types": list(self.layer_types), "rope_parameters": rope}


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters (normal(0, initializer_range) weights, sinks and router bias; unit
    norms; zero projection and expert biases); the same seed gives the same tree everywhere.

    Example:
        >>> init(Config.tiny())["layers"][0]["attn"]["sinks"].shape
        torch.Size([8])
    """
    g = torch.Generator().manual_seed(seed)

    def make(path: str, shape: tuple) -> torch.Tensor:
        name = path.rsplit(".", 1)[-1]
        if name.endswith("norm"):
            return torch.ones(shape)
        if name.startswith("b_") or name in ("bq", "bk", "bv", "bo"):
            return torch.zeros(shape)
        return torch.randn(shape, generator=g) * cfg.initializer_range

    return fmoe.tree.unflatten({path: make(path, s.shape).to(dtype) for path, s in hf_specs(cfg).items()})


def init_cache(cfg: Config, batch: int, max_len: int, mesh: Optional[fmoe.Mesh] = None,
               dtype: torch.dtype = torch.float32) -> dict:
    """An empty decoding cache: per layer keys and values ``[B, L, G, hd]``, split over tp like
    the KV heads (:mod:`fmoe.nn.cache`); sliding layers keep their window as a mask over the slots.

    Example:
        >>> init_cache(Config.tiny(), 2, 16)["layers"][0]["k"].shape
        torch.Size([2, 16, 4, 8])
    """
    return nn.cache.kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, batch, max_len, mesh, dtype)


def _attention(a: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config,
               window: Optional[int], step: nn.cache.Step, entry: Optional[dict]) -> tuple[torch.Tensor, Optional[dict]]:
    heads = lambda t: rearrange(t, "b s (h d) -> b s h d", d=cfg.head_dim)  # noqa: E731
    q = nn.apply_rope(heads(nn.linear(x, a["wq"], a.get("bq"))), cos, sin)  # [B, S, H_local, hd]
    k = nn.apply_rope(heads(nn.linear(x, a["wk"], a.get("bk"))), cos, sin)  # [B, S, G_local, hd]
    v = heads(nn.linear(x, a["wv"], a.get("bv")))
    if entry is not None:
        entry, (k, v) = nn.cache.write(entry, step, k=k, v=v)  # k, v: [B, cached + S, G_local, hd]
    o = nn.attention(q, k, v, causal=True, window=window, sinks=a["sinks"],
                     num_kv_groups=cfg.num_attention_heads // cfg.num_key_value_heads, key_mask=step.key_mask)
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"], a.get("bo")), entry  # [B, S, D]


def _router(router, cfg: Config):
    """With ``output_router_logits`` the router also returns the weighted Switch load-balance
    loss over the global batch (``aux["load_balance_loss"]``; per layer, summed by trainers)."""
    return fmoe.routing.aux_losses.with_losses(router, load_balance=cfg.router_aux_loss_coef) if cfg.output_router_logits else router


def _moe(m: dict, x: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh], impl: str,
         router: Optional[Any] = None) -> tuple[torch.Tensor, dict]:
    y, aux = fmoe.moe(m, rearrange(x, "b s d -> (b s) d"), router=_router(router or fmoe.routing.topk_softmax(cfg.num_experts_per_tok), cfg),
                      mesh=mesh, impl=impl, act=fmoe.experts.clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit))
    return rearrange(y, "(b s) d -> b s d", b=x.shape[0]), aux  # [B, S, D]


def _layer(layer: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config, window: Optional[int],
           mesh: Optional[fmoe.Mesh], impl: str, router: Optional[Any], step: Any,
           layer_cache: Optional[dict]) -> tuple[torch.Tensor, dict, Any]:
    """One decoder layer: ``h [B, S, D]`` -> ``(h, aux of its MoE block, cache entry)``."""
    x = nn.rms_norm(h, layer["attn_norm"], cfg.rms_norm_eps)
    y, entry = _attention(layer["attn"], x, cos, sin, cfg, window, step, layer_cache)
    h = h + y
    y, aux = fmoe.remat.call("moe", _moe, layer["moe"], nn.rms_norm(h, layer["mlp_norm"], cfg.rms_norm_eps),
                             cfg, mesh, impl, router)
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
        return_aux: also return ``{"moe": [aux of each layer's fmoe.moe, in order]}``.
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
    for i, (layer, kind) in enumerate(zip(fmoe.unsharded_layers(params["layers"]), cfg.layer_types)):  # FSDP gathers
        window = cfg.sliding_window if kind == "sliding_attention" else None
        h, aux, entry = fmoe.remat.call("layer", _layer, layer, h, cos, sin, cfg, window, mesh, impl, router, step,
                                        None if cache is None else cache["layers"][i])
        entries.append(entry)
        auxes.append(aux)
    h = nn.rms_norm(h, params["norm"], cfg.rms_norm_eps)
    logits = nn.linear(h, params["embed" if cfg.tie_word_embeddings else "lm_head"], gather=True)  # [B, S, V]
    return nn.cache.outputs(logits, cache, step, entries, {"moe": auxes} if return_aux else None)


def plan(cfg: Config) -> Plan:
    """Default plan (non-strict; unnamed leaves replicated): q/k/v and their biases colwise,
    o rowwise (bias replicated), sinks local by head, experts and their biases on ``ep``,
    router replicated, embedding vocab-parallel, lm_head colwise with gathered output.

    Example:
        >>> plan(Config.tiny()).match("layers.0.attn.sinks")
        ('layers.*.attn.sinks', 'local')
    """
    return Plan({
        "embed": "vocab", "layers.*.attn.[wb][qkv]": "colwise", "layers.*.attn.wo": "rowwise",
        "layers.*.attn.sinks": "local", "layers.*.moe.router*": "replicate", "layers.*.moe.[wb]_*": "expert",
        **({} if cfg.tie_word_embeddings else {"lm_head": "colwise_gather"}),
    }, default=P(), strict=False)


# ---------------------------------------------------------------------------- checkpoint name map
HF_IGNORE = ("**.rotary_emb.inv_freq",)


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, Spec]:
    """Every parameter path -> how it is made of checkpoint tensors (shapes included).

    Example:
        >>> hf_specs(Config.tiny())["layers.0.moe.w_gate_up"]
        Transpose(Deinterleave(Key('model.layers.0.mlp.experts.gate_up_proj', (8, 64, 64)), dim=2, n=2), 1, 2)
    """
    V, D, E, I = cfg.vocab_size, cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
    H, q, kv = cfg.num_attention_heads, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    s: dict[str, Spec] = {"embed": Key("model.embed_tokens.weight", (V, D))}
    for i in range(cfg.num_hidden_layers):
        p, k = f"layers.{i}.", f"model.layers.{i}."
        s[p + "attn_norm"] = Key(k + "input_layernorm.weight", (D,))
        for x, shape in (("q", (q, D)), ("k", (kv, D)), ("v", (kv, D)), ("o", (D, q))):
            s[p + f"attn.w{x}"] = Key(k + f"self_attn.{x}_proj.weight", shape)
            if cfg.attention_bias:
                s[p + f"attn.b{x}"] = Key(k + f"self_attn.{x}_proj.bias", shape[:1])
        s[p + "attn.sinks"] = Key(k + "self_attn.sinks", (H,))
        s[p + "mlp_norm"] = Key(k + "post_attention_layernorm.weight", (D,))
        m = k + "mlp."
        s[p + "moe.router"] = Key(m + "router.weight", (E, D))
        s[p + "moe.router_bias"] = Key(m + "router.bias", (E,))
        s[p + "moe.w_gate_up"] = Transpose(Deinterleave(Key(m + "experts.gate_up_proj", (E, D, 2 * I)), dim=2), 1, 2)
        s[p + "moe.b_gate_up"] = Deinterleave(Key(m + "experts.gate_up_proj_bias", (E, 2 * I)), dim=1)
        s[p + "moe.w_down"] = Transpose(Key(m + "experts.down_proj", (E, I, D)), 1, 2)
        s[p + "moe.b_down"] = Key(m + "experts.down_proj_bias", (E, D))
    s["norm"] = Key("model.norm.weight", (D,))
    if not cfg.tie_word_embeddings:
        s["lm_head"] = Key("lm_head.weight", (V, D))
    return s


# ---------------------------------------------------------------------------- the declared interface
MODEL = Model("gpt_oss", Config, init, forward, plan, hf_specs, hf_ignore=HF_IGNORE,
              tp_fields=_common.TP_FIELDS, init_cache=init_cache,
              aux_loss_fields=_common.AUX_LOSS_FIELDS,
              width_fields={"E": "num_local_experts", "I": "intermediate_size"},
              hf_router=("topk_softmax", {"k": "num_experts_per_tok"}, {}))
check_plan, shard, load_hf, save_hf = MODEL.check_plan, MODEL.shard, MODEL.load_hf, MODEL.save_hf
