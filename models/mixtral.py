"""Mixtral: a decoder with a top-2 mixture of SwiGLU experts in every layer, as pure functions.

Numerics follow transformers' ``MixtralForCausalLM`` op for op: GQA attention with RoPE and an
optional sliding window (every layer), softmax-top-k routing always renormalised, no biases.
Parameters (D hidden, H query heads, G KV heads, hd head dim, E experts, I expert hidden)::

    embed                     [V, D]
    layers.N.attn_norm        [D]
    layers.N.attn.wq          [H*hd, D]     wk, wv [G*hd, D]     wo [D, H*hd]
    layers.N.mlp_norm         [D]
    layers.N.moe.router       [E, D]
    layers.N.moe.w_gate_up    [E, 2I, D]    gate (w1) rows first, then up (w3)
    layers.N.moe.w_down       [E, D, I]     (w2)
    norm                      [D]
    lm_head                   [V, D]        (absent with tie_word_embeddings)

Parallelism lives in :func:`plan`; :func:`forward` runs unchanged on one process or many and
returns the full logits on every rank. ``router_jitter_noise`` (training-time noise on the
router input) is not applied: forward is deterministic.
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
    """Mixtral hyper-parameters, named and defaulted as in transformers' ``MixtralConfig``."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336       # I, per expert
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    rope_scaling: tuple = ()             # sorted (key, value) pairs of a non-default rope_parameters
    max_position_embeddings: int = 131072
    sliding_window: Optional[int] = None
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
                  "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
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
        if not isinstance(self.rope_scaling, tuple):
            raise TypeError(f"Config: rope_scaling must be a tuple of (key, value) pairs, got {self.rope_scaling!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"Config: sliding_window must be None or an int >= 1, got {self.sliding_window!r}")
        nn.rope_frequencies(self.head_dim, self.rope_theta, dict(self.rope_scaling) or None,
                            self.max_position_embeddings)

    @classmethod
    def tiny(cls, **changes: Any) -> "Config":
        """2 layers, D=64, 8 query / 4 KV heads, 8 experts top-2: tp <= 4 and ep <= 8 divide it.
        ``Config.tiny(num_key_value_heads=8)`` is the variant for tp=8."""
        return cls(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_local_experts=8,
                           max_position_embeddings=256), **changes})

    @classmethod
    def small(cls) -> "Config":
        """4 layers, D=256, 8 experts top-2: for examples and benchmarks (about 14M parameters)."""
        return cls(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Config":
        """Read a Hugging Face ``config.json`` dict.

        Example:
            >>> Config.from_hf(Config.tiny(sliding_window=4).to_hf()) == Config.tiny(sliding_window=4)
            True
        """
        for key, want in (("model_type", "mixtral"), ("hidden_act", "silu")):
            if hf.get(key, want) != want:
                raise ValueError(f"Config.from_hf: {key} must be {want!r}, got {hf.get(key)!r}")
        theta, scaling = _common.rope_from_hf(hf, cls.rope_theta)
        kw = {f.name: hf[f.name] for f in fields(cls) if f.name in hf and f.name not in ("rope_theta", "rope_scaling")}
        kw["head_dim"] = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        kw["num_key_value_heads"] = hf.get("num_key_value_heads") or hf.get("num_attention_heads",
                                                                           cls.num_attention_heads)
        return cls(rope_theta=theta, rope_scaling=scaling, **kw)

    def to_hf(self) -> dict:
        """The ``config.json`` fields transformers' ``MixtralConfig`` reads."""
        out = {k: v for k, v in asdict(self).items() if k not in ("rope_theta", "rope_scaling")}
        rope = {"rope_type": "default", **dict(self.rope_scaling), "rope_theta": self.rope_theta}
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", **out,
                "rope_parameters": rope}


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters (normal(0, initializer_range) weights, unit norms); the same seed gives
    the same tree on every process.

    Example:
        >>> init(Config.tiny())["layers"][1]["moe"]["w_down"].shape
        torch.Size([8, 64, 32])
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
    q = nn.apply_rope(heads(nn.linear(x, a["wq"])), cos, sin)  # [B, S, H_local, hd]
    k = nn.apply_rope(heads(nn.linear(x, a["wk"])), cos, sin)  # [B, S, G_local, hd]
    v = heads(nn.linear(x, a["wv"]))
    if entry is not None:
        entry, (k, v) = nn.cache.write(entry, step, k=k, v=v)  # k, v: [B, cached + S, G_local, hd]
    o = nn.attention(q, k, v, causal=True, window=cfg.sliding_window,
                     num_kv_groups=cfg.num_attention_heads // cfg.num_key_value_heads, key_mask=step.key_mask)
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"]), entry  # [B, S, D]


def _router(router, cfg: Config):
    """With ``output_router_logits`` the router also returns the weighted Switch load-balance
    loss over the global batch (``aux["load_balance_loss"]``; per layer, summed by trainers)."""
    return fmoe.routing.aux_losses.with_losses(router, load_balance=cfg.router_aux_loss_coef) if cfg.output_router_logits else router


def _moe(m: dict, x: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh], impl: str,
         router: Optional[Any] = None) -> tuple[torch.Tensor, dict]:
    router = router or fmoe.routing.topk(cfg.num_experts_per_tok, normalize=True)
    y, aux = fmoe.moe(m, rearrange(x, "b s d -> (b s) d"), router=_router(router, cfg), mesh=mesh, impl=impl)  # [T, D]
    return rearrange(y, "(b s) d -> b s d", b=x.shape[0]), aux


def _layer(layer: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config,
           mesh: Optional[fmoe.Mesh], impl: str, router: Optional[Any], step: Any,
           layer_cache: Optional[dict]) -> tuple[torch.Tensor, dict, Any]:
    """One decoder layer: ``h [B, S, D]`` -> ``(h, aux of its MoE block, cache entry)``."""
    y, entry = _attention(layer["attn"], nn.rms_norm(h, layer["attn_norm"], cfg.rms_norm_eps), cos, sin, cfg, step,
                          layer_cache)
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
        auxes.append(aux)
    h = nn.rms_norm(h, params["norm"], cfg.rms_norm_eps)
    logits = nn.linear(h, params["embed" if cfg.tie_word_embeddings else "lm_head"], gather=True)  # [B, S, V]
    return nn.cache.outputs(logits, cache, step, entries, {"moe": auxes} if return_aux else None)


def plan(cfg: Config) -> Plan:
    """Default plan (non-strict; unnamed leaves replicated): q/k/v colwise, o rowwise, experts
    on ``ep``, router replicated, embedding vocab-parallel, lm_head colwise with gathered output.

    Example:
        >>> plan(Config.tiny()).match("layers.0.attn.wo")
        ('layers.*.attn.wo', 'rowwise')
    """
    return Plan({
        "embed": "vocab", "layers.*.attn.w[qkv]": "colwise", "layers.*.attn.wo": "rowwise",
        "layers.*.moe.router": "replicate", "layers.*.moe.w_*": "expert",
        **({} if cfg.tie_word_embeddings else {"lm_head": "colwise_gather"}),
    }, default=P(), strict=False)


# ---------------------------------------------------------------------------- checkpoint name map
HF_IGNORE = ("**.rotary_emb.inv_freq",)


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, Spec]:
    """Every parameter path -> how it is made of checkpoint tensors (shapes included).

    The hub layout (what ``save_pretrained`` writes) keeps one key per expert under
    ``block_sparse_moe`` (``experts.3.w1.weight``: gate, ``w3``: up, ``w2``: down); when ``keys``
    holds transformers' fused in-memory names (``mlp.experts.gate_up_proj``) those are read.

    Example:
        >>> hf_specs(Config.tiny())["layers.0.moe.router"]
        Key('model.layers.0.block_sparse_moe.gate.weight', (8, 64))
    """
    V, D, E, I = cfg.vocab_size, cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    keys = set(keys or ())
    s: dict[str, Spec] = {"embed": Key("model.embed_tokens.weight", (V, D))}
    for i in range(cfg.num_hidden_layers):
        p, k = f"layers.{i}.", f"model.layers.{i}."
        s[p + "attn_norm"] = Key(k + "input_layernorm.weight", (D,))
        for x, shape in (("q", (q, D)), ("k", (kv, D)), ("v", (kv, D)), ("o", (D, q))):
            s[p + f"attn.w{x}"] = Key(k + f"self_attn.{x}_proj.weight", shape)
        s[p + "mlp_norm"] = Key(k + "post_attention_layernorm.weight", (D,))
        if k + "mlp.experts.gate_up_proj" in keys:  # fused layout (transformers' in-memory names)
            s[p + "moe.router"] = Key(k + "mlp.gate.weight", (E, D))
            s[p + "moe.w_gate_up"] = Key(k + "mlp.experts.gate_up_proj", (E, 2 * I, D))
            s[p + "moe.w_down"] = Key(k + "mlp.experts.down_proj", (E, D, I))
            continue
        m = k + "block_sparse_moe."
        per = lambda w, shape: Stack([Key(f"{m}experts.{e}.{w}.weight", shape) for e in range(E)])  # noqa: E731
        s[p + "moe.router"] = Key(m + "gate.weight", (E, D))
        s[p + "moe.w_gate_up"] = Cat([per("w1", (I, D)), per("w3", (I, D))], dim=1)
        s[p + "moe.w_down"] = per("w2", (D, I))
    s["norm"] = Key("model.norm.weight", (D,))
    if not cfg.tie_word_embeddings:
        s["lm_head"] = Key("lm_head.weight", (V, D))
    return s


# ---------------------------------------------------------------------------- the declared interface
MODEL = Model("mixtral", Config, init, forward, plan, hf_specs, hf_ignore=HF_IGNORE,
              tp_fields=_common.TP_FIELDS, init_cache=init_cache,
              aux_loss_fields=_common.AUX_LOSS_FIELDS,
              width_fields={"E": "num_local_experts", "I": "intermediate_size"},
              hf_router=("topk", {"k": "num_experts_per_tok"}, {"normalize": True}))
check_plan, shard, load_hf, save_hf = MODEL.check_plan, MODEL.shard, MODEL.load_hf, MODEL.save_hf
