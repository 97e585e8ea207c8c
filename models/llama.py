"""Llama: the dense decoder-only transformer, as pure functions over a parameter tree.

The tensor-parallel reference model of fmoe (no experts). Numerics follow transformers'
``LlamaForCausalLM`` op for op. Shapes: B batch, S tokens, D hidden, H query heads, G KV heads,
hd head dim, I MLP hidden, V vocab; biases only with ``attention_bias`` / ``mlp_bias``.
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

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from einops import rearrange

import fmoe
import fmoe.nn as nn

from fmoe import P, Plan
from fmoe import model as kit
from fmoe.checkpoint import Spec


@dataclass(frozen=True)
class Config(kit.ModelConfig):
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

    HF = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu"}
    PRESETS = {  # tiny: for tests (GQA: 4 query heads, 2 KV heads); small: about 4M parameters
        "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
        "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024)}

    def __post_init__(self):
        kit.check_config(self)


def shapes(cfg: Config) -> dict[str, tuple]:
    """Every parameter path -> its shape, in init order (HF ``[out, in]`` layout).

    Example:
        >>> shapes(Config.tiny())["layers.0.mlp.w_gate_up"]
        (256, 64)
    """
    D, I = cfg.hidden_size, cfg.intermediate_size
    mlp = {"mlp.w_gate_up": (2 * I, D), "mlp.w_down": (D, I)}  # gate rows first, then up
    return kit.decoder_shapes(cfg, lambda i: {
        "attn_norm": (D,), **kit.attention_shapes(cfg, bias=cfg.attention_bias), "mlp_norm": (D,), **mlp,
        **({"mlp.b_gate_up": (2 * I,), "mlp.b_down": (D,)} if cfg.mlp_bias else {})})


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters of :func:`shapes`: normal(0, initializer_range) weights, unit norms, zero
    biases; the same seed gives the same tree on every process.

    Example:
        >>> init(Config.tiny())["layers"][0]["attn"]["wq"].shape
        torch.Size([64, 64])
    """
    return kit.init_params(shapes(cfg), cfg.initializer_range, seed, dtype, zeros=("b_*", "b[qkvo]"))


def attention(a: dict, x: torch.Tensor, i: int, ctx: kit.Context,
              entry: Optional[dict]) -> tuple[torch.Tensor, Optional[dict]]:
    """Grouped-query attention with RoPE: ``x [B, S, D] -> [B, S, D]``."""
    cfg = ctx.cfg
    heads = lambda t: rearrange(t, "b s (h d) -> b s h d", d=cfg.head_dim)  # noqa: E731
    q = heads(nn.linear(x, a["wq"], a.get("bq")))  # [B, S, H_local, hd]
    k = heads(nn.linear(x, a["wk"], a.get("bk")))  # [B, S, G_local, hd]
    v = heads(nn.linear(x, a["wv"], a.get("bv")))
    q, k = nn.apply_rope(q, ctx.cos, ctx.sin), nn.apply_rope(k, ctx.cos, ctx.sin)
    if entry is not None:
        entry, (k, v) = nn.cache.write(entry, ctx.step, k=k, v=v)  # k, v: [B, cached + S, G_local, hd]
    o = nn.attention(q, k, v, causal=True, num_kv_groups=cfg.num_attention_heads // cfg.num_key_value_heads,
                     key_mask=ctx.step.key_mask, cp=ctx.cp)
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"], a.get("bo")), entry  # [B, S, D]


def block(layer: dict, x: torch.Tensor, i: int, ctx: kit.Context, entry: Optional[dict]) -> tuple:
    """Decoder layer ``i``: ``x [B, S, D] -> (x, None, cache entry)`` (no MoE block: no aux); its
    FSDP-split weights are gathered here, so remat kind "layer" gathers them again in backward."""
    layer, eps = fmoe.unshard_layer(layer), ctx.cfg.rms_norm_eps
    a, entry = attention(layer["attn"], nn.rms_norm(x, layer["attn_norm"], eps), i, ctx, entry)
    h = x + a
    return h + kit.mlp(layer["mlp"], nn.rms_norm(h, layer["mlp_norm"], eps)), None, entry


def forward(params: dict, tokens: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh] = None, *,
            cache: Optional[dict] = None, positions: Optional[torch.Tensor] = None,
            hidden: Optional[torch.Tensor] = None) -> Any:
    """Logits ``[B, S, V]`` of the causal language model, full on every rank; ``(logits, cache)``
    with a ``cache`` (:func:`init_cache`). Arguments as :func:`fmoe.model.start` takes
    them (``mesh`` for the common signature: placements travel with the parameters).

    Example:
        >>> cfg = Config.tiny()
        >>> forward(init(cfg), torch.zeros(2, 5, dtype=torch.long), cfg).shape
        torch.Size([2, 5, 128])
    """
    x, ctx, out = kit.start(params, tokens, cfg, mesh, cache, positions, hidden=hidden)  # [B, S, D]
    for i, layer in out.layers(params["layers"]):  # all (a pipeline stage: its own)
        x = out.keep(*nn.remat.call("layer", block, layer, x, i, ctx, out.entry(i)))
    if out.hands_on(params):  # a pipeline stage before the last: x [B, S, D] goes on to the next stage
        return out.result(x)
    logits = nn.linear(nn.rms_norm(x, params["norm"], cfg.rms_norm_eps), kit.lm_head(params, cfg), gather=True)
    return out.result(logits)  # logits: [B, S, V], full on every rank


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


# ---------------------------------------------------------------------------- checkpoint name map
HF_LAYER = {  # parameter of layer N -> its key(s) after "model.layers.N." (a list: concatenated on dim 0)
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    **{f"attn.{w}{x}": f"self_attn.{x}_proj.{kind}" for w, kind in (("w", "weight"), ("b", "bias")) for x in "qkvo"},
    "mlp.w_gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.w_down": "mlp.down_proj.weight",
    "mlp.b_gate_up": ["mlp.gate_proj.bias", "mlp.up_proj.bias"], "mlp.b_down": "mlp.down_proj.bias",
}


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
    return kit.hf_names(shapes(cfg), HF_LAYER)


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, Spec]:
    """Every parameter path -> how it is read from a checkpoint (:func:`hf_names` as specs:
    one key, or the dim-0 concatenation of several).

    Example:
        >>> hf_specs(Config.tiny())["layers.0.mlp.w_gate_up"].shape
        (256, 64)
    """
    return kit.hf_specs(shapes(cfg), HF_LAYER, keys)


MODEL = kit.Model("llama", Config, init, forward, plan, hf_specs, tp_fields=kit.TP_FIELDS,
                  context_parallel=True,
              init_cache=kit.init_kv_cache, routed=False, remat_blocks=("layer",),
              width_fields={"E": None, "K": None, "I": None})


def __getattr__(name: str) -> Any:  # load_hf, save_hf, shard, check_plan, init_cache: MODEL's methods
    return MODEL.attribute(__name__, name)
