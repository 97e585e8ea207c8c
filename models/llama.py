"""Llama: the dense decoder-only transformer, as pure functions over a parameter tree.

The tensor-parallel reference model of fmoe (no experts). Numerics follow transformers'
``LlamaForCausalLM`` op for op. Parameters, in the Hugging Face ``[out, in]`` layout
(D hidden, H query heads, G KV heads, hd head dim, I MLP hidden, V vocab)::

    embed                    [V, D]
    layers.N.attn_norm       [D]
    layers.N.attn.wq         [H*hd, D]     wk, wv [G*hd, D]     wo [D, H*hd]
    layers.N.attn.bq ... bo  (only with attention_bias)
    layers.N.mlp_norm        [D]
    layers.N.mlp.w_gate_up   [2I, D]       gate rows first, then up
    layers.N.mlp.w_down      [D, I]        (b_gate_up [2I], b_down [D] with mlp_bias)
    norm                     [D]
    lm_head                  [V, D]        (absent with tie_word_embeddings: embed is reused)

Parallelism lives in :func:`plan`, never in :func:`forward`: the layer functions of
:mod:`fmoe.nn` read each parameter's placement and communicate as needed, so the same forward
runs on one process or many and returns the full logits ``[B, S, V]`` on every rank.

Example:
    >>> cfg = Config.tiny()
    >>> params = init(cfg, seed=0)
    >>> forward(params, torch.zeros(2, 5, dtype=torch.long), cfg).shape
    torch.Size([2, 5, 128])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from einops import rearrange

import fmoe
import fmoe.checkpoint as ckpt
import fmoe.nn as nn

from . import _common
from fmoe import P, Plan
from fmoe.model import Model


@dataclass(frozen=True)
class Config:
    """Llama hyper-parameters, named as in the Hugging Face ``config.json``."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) pairs of a HF rope_parameters dict, e.g. llama3
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Config: {f} must be an int >= 1, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Config: num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not isinstance(self.rope_scaling, tuple):
            raise TypeError(f"Config: rope_scaling must be a tuple of (key, value) pairs, got {self.rope_scaling!r}")
        nn.rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling_dict(), self.max_position_embeddings)

    def rope_scaling_dict(self) -> Optional[dict]:
        """``rope_scaling`` as a dict (None for plain RoPE)."""
        return dict(self.rope_scaling) or None

    @classmethod
    def tiny(cls) -> "Config":
        """A 2-layer model for tests (GQA: 4 query heads, 2 KV heads)."""
        return cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)

    @classmethod
    def small(cls) -> "Config":
        """A 4-layer model for examples and benchmarks (about 4M parameters)."""
        return cls(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Config":
        """Read a Hugging Face ``config.json`` dict (transformers 4.x or 5.x rope fields).

        Example:
            >>> Config.from_hf(Config.tiny().to_hf()) == Config.tiny()
            True
        """
        if hf.get("model_type", "llama") != "llama":
            raise ValueError(f"Config.from_hf: model_type must be 'llama', got {hf.get('model_type')!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Config.from_hf: hidden_act must be 'silu', got {hf.get('hidden_act')!r}")
        theta, scaling = _common.rope_from_hf(hf, cls.rope_theta)
        kw = {f.name: hf[f.name] for f in fields(cls) if f.name in hf and f.name not in ("rope_theta", "rope_scaling")}
        if kw.get("head_dim") is None:
            kw["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
        kw.setdefault("num_key_value_heads", hf.get("num_attention_heads", cls.num_attention_heads))
        return cls(rope_theta=theta, rope_scaling=scaling, **kw)

    def to_hf(self) -> dict:
        """The ``config.json`` fields transformers' ``LlamaConfig`` reads."""
        out = {k: v for k, v in asdict(self).items() if k not in ("rope_theta", "rope_scaling")}
        rope = {"rope_type": "default", **dict(self.rope_scaling), "rope_theta": self.rope_theta}
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
                **out, "rope_parameters": rope}


def _layout(cfg: Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every parameter path -> (shape, initialiser), in init order."""
    D, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = {"embed": ((V, D), "normal")}
    for i in range(cfg.num_hidden_layers):
        at, ml = f"layers.{i}.attn.", f"layers.{i}.mlp."
        out[f"layers.{i}.attn_norm"] = ((D,), "ones")
        out.update({at + "wq": ((q, D), "normal"), at + "wk": ((kv, D), "normal"),
                    at + "wv": ((kv, D), "normal"), at + "wo": ((D, q), "normal")})
        if cfg.attention_bias:
            out.update({at + "bq": ((q,), "zeros"), at + "bk": ((kv,), "zeros"),
                        at + "bv": ((kv,), "zeros"), at + "bo": ((D,), "zeros")})
        out[f"layers.{i}.mlp_norm"] = ((D,), "ones")
        out.update({ml + "w_gate_up": ((2 * I, D), "normal"), ml + "w_down": ((D, I), "normal")})
        if cfg.mlp_bias:
            out.update({ml + "b_gate_up": ((2 * I,), "zeros"), ml + "b_down": ((D,), "zeros")})
    out["norm"] = ((D,), "ones")
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((V, D), "normal")
    return out


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters (normal(0, initializer_range) weights, unit norms, zero biases).

    Args:
        cfg: the config; seed: the same seed gives the same tree on every process;
        dtype: parameter dtype.
    Returns:
        the nested parameter dict (layout in the module docstring).

    Example:
        >>> init(Config.tiny())["layers"][0]["attn"]["wq"].shape
        torch.Size([64, 64])
    """
    g = torch.Generator().manual_seed(seed)
    make = {"normal": lambda s: torch.randn(s, generator=g) * cfg.initializer_range,
            "ones": torch.ones, "zeros": torch.zeros}
    flat = {path: make[kind](shape).to(dtype) for path, (shape, kind) in _layout(cfg).items()}
    return fmoe.tree.unflatten(flat)


def init_cache(cfg: Config, batch: int, max_len: int, mesh: Optional[fmoe.Mesh] = None,
               dtype: torch.dtype = torch.float32) -> dict:
    """An empty decoding cache: per layer keys and values ``[B, L, G, hd]``, split over tp like
    the KV heads (:mod:`fmoe.nn.cache`).

    Example:
        >>> init_cache(Config.tiny(), 2, 16)["layers"][0]["k"].shape
        torch.Size([2, 16, 2, 16])
    """
    return nn.cache.kv_cache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, batch, max_len, mesh, dtype)


def _attention(a: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config,
               step: nn.cache.Step, entry: Optional[dict]) -> tuple[torch.Tensor, Optional[dict]]:
    heads = lambda t: rearrange(t, "b s (h d) -> b s h d", d=cfg.head_dim)  # noqa: E731
    q = heads(nn.linear(x, a["wq"], a.get("bq")))  # [B, S, H_local, hd]
    k = heads(nn.linear(x, a["wk"], a.get("bk")))  # [B, S, G_local, hd]
    v = heads(nn.linear(x, a["wv"], a.get("bv")))
    q, k = nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin)
    if entry is not None:
        entry, (k, v) = nn.cache.write(entry, step, k=k, v=v)  # k, v: [B, cached + S, G_local, hd]
    o = nn.attention(q, k, v, causal=True, num_kv_groups=cfg.num_attention_heads // cfg.num_key_value_heads,
                     key_mask=step.key_mask)
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"], a.get("bo")), entry  # [B, S, D]


def _layer(layer: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: Config, step: Any,
           layer_cache: Optional[dict]) -> tuple[torch.Tensor, Any]:
    """One decoder layer: ``h [B, S, D]`` -> ``(h, cache entry)``."""
    y, entry = _attention(layer["attn"], nn.rms_norm(h, layer["attn_norm"], cfg.rms_norm_eps), cos, sin, cfg, step,
                          layer_cache)
    h = h + y
    m = layer["mlp"]
    return h + nn.swiglu_mlp(nn.rms_norm(h, layer["mlp_norm"], cfg.rms_norm_eps), m["w_gate_up"], m["w_down"],
                             m.get("b_gate_up"), m.get("b_down")), entry


def forward(params: dict, tokens: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh] = None, *,
            cache: Optional[dict] = None, positions: Optional[torch.Tensor] = None) -> Any:
    """Logits of a causal language model.

    Args:
        params: tree from :func:`init` (plain tensors) or sharded with :func:`shard`.
        tokens: ``[B, S]`` integer ids (the same on every rank of a tp group).
        cfg: the model config.
        mesh: accepted for the common model signature; placements travel with the parameters.
        cache: a cache from :func:`init_cache` to decode with (then the new cache is returned
            after the logits; see :mod:`fmoe.nn.cache`).
        positions: ``[S]`` or ``[B, S]`` rotary positions of the tokens, ``-1`` for left padding;
            default: right after the cached tokens.
    Returns:
        logits ``[B, S, V]``, full on every rank; ``(logits, cache)`` with a cache.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.numel() == 0:
        raise ValueError(f"forward: tokens must be a non-empty [B, S] integer tensor, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    inv_freq, scaling = nn.rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict(),
                                            cfg.max_position_embeddings)
    step = nn.cache.begin(tokens, cache, positions)
    h = nn.embedding(tokens, params["embed"])  # [B, S, D]
    cos, sin = nn.rope_cos_sin(step.positions, inv_freq, scaling, h.dtype)
    entries = []
    for i, layer in enumerate(fmoe.unsharded_layers(params["layers"])):  # FSDP: one gather per layer
        h, entry = fmoe.remat.call("layer", _layer, layer, h, cos, sin, cfg, step,
                                   None if cache is None else cache["layers"][i])
        entries.append(entry)
    h = nn.rms_norm(h, params["norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    logits = nn.linear(h, head, gather=True)  # [B, S, V]: the full vocabulary whatever the plan
    return nn.cache.outputs(logits, cache, step, entries)


def plan(cfg: Config) -> Plan:
    """Default tensor-parallel plan (non-strict rules; leaves not named are replicated):
    q/k/v colwise, o rowwise, fused gate/up packed colwise, down rowwise, embedding
    vocab-parallel, lm_head colwise with gathered output, norms replicated.

    Example:
        >>> plan(Config.tiny()).match("layers.1.attn.wk")
        ('layers.*.attn.w[qkv]', 'colwise')
    """
    rules: dict[str, Union[str, P]] = {
        "embed": "vocab",
        "layers.*.attn.w[qkv]": "colwise", "layers.*.attn.wo": "rowwise",
        "layers.*.mlp.w_gate_up": "packed_colwise", "layers.*.mlp.w_down": "rowwise",
        "layers.*.attn_norm": "replicate", "layers.*.mlp_norm": "replicate", "norm": "replicate",
    }
    if cfg.attention_bias:
        rules.update({"layers.*.attn.b[qkv]": "colwise", "layers.*.attn.bo": "replicate"})
    if cfg.mlp_bias:
        rules.update({"layers.*.mlp.b_gate_up": "packed_colwise", "layers.*.mlp.b_down": "replicate"})
    if not cfg.tie_word_embeddings:
        rules["lm_head"] = "colwise_gather"
    return Plan(rules, default=P(), strict=False)


_HF_LAYER = {"attn_norm": ["input_layernorm.weight"], "mlp_norm": ["post_attention_layernorm.weight"],
             **{f"attn.{w}{x}": [f"self_attn.{x}_proj.{kind}"] for w, kind in (("w", "weight"), ("b", "bias"))
                for x in "qkvo"},
             "mlp.w_gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.w_down": ["mlp.down_proj.weight"],
             "mlp.b_gate_up": ["mlp.gate_proj.bias", "mlp.up_proj.bias"], "mlp.b_down": ["mlp.down_proj.bias"]}
_HF_TOP = {"embed": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"], "lm_head": ["lm_head.weight"]}


def hf_names(cfg: Config) -> dict[str, list[str]]:
    """Each parameter path -> the Hugging Face tensor key(s) it is made of.

    Fusion rule: a path with several keys is their concatenation on dim 0, in list order
    (``w_gate_up = cat(gate_proj.weight, up_proj.weight)``; the same for ``b_gate_up``).
    Every other path is exactly one key. With ``tie_word_embeddings`` there is no ``lm_head``
    (transformers' ``save_pretrained`` writes no ``lm_head.weight`` then either).

    Example:
        >>> hf_names(Config.tiny())["layers.1.mlp.w_gate_up"]
        ['model.layers.1.mlp.gate_proj.weight', 'model.layers.1.mlp.up_proj.weight']
    """
    out = {}
    for path in _layout(cfg):
        if path.startswith("layers."):
            _, i, name = path.split(".", 2)
            out[path] = [f"model.layers.{i}.{key}" for key in _HF_LAYER[name]]
        else:
            out[path] = list(_HF_TOP[path])
    return out


HF_IGNORE = ("**.rotary_emb.inv_freq",)


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, ckpt.Spec]:
    """Every parameter path -> how it is read from a checkpoint (:func:`hf_names` as specs:
    one key, or the dim-0 concatenation of several).

    Example:
        >>> hf_specs(Config.tiny())["layers.0.mlp.w_gate_up"].shape
        (256, 64)
    """
    layout, names = _layout(cfg), hf_names(cfg)
    out = {}
    for path, (shape, _) in layout.items():
        ks = names[path]
        if len(ks) == 1:
            out[path] = ckpt.Key(ks[0], shape)
        else:
            part = (shape[0] // len(ks),) + tuple(shape[1:])
            out[path] = ckpt.Cat([ckpt.Key(k, part) for k in ks], dim=0)
    return out


# ---------------------------------------------------------------------------- the declared interface
MODEL = Model("llama", Config, init, forward, plan, hf_specs, hf_ignore=HF_IGNORE,
              tp_fields=_common.TP_FIELDS, init_cache=init_cache, routed=False,
              remat_blocks=("layer",), width_fields={"E": None, "K": None, "I": None})
check_plan, shard, load_hf, save_hf = MODEL.check_plan, MODEL.shard, MODEL.load_hf, MODEL.save_hf
