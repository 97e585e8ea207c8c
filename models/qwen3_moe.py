"""Qwen3-MoE: a decoder whose feed-forward blocks are mixtures of experts, as pure functions.

Numerics follow transformers' ``Qwen3MoeForCausalLM`` op for op: per-head RMSNorm on q and k
before RoPE, no attention bias, softmax-top-k routing (renormalised when ``norm_topk_prob``),
SwiGLU experts; layers in ``mlp_only_layers`` or skipped by ``decoder_sparse_step`` are dense
SwiGLU MLPs. Shapes: B batch, S tokens, D hidden, H query / G KV heads, hd head dim, E experts,
I expert / Id dense hidden, V vocab. Parallelism lives in :func:`plan` alone: the same forward
runs on one process or many.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from einops import rearrange

import fmoe
import fmoe.nn as nn

from fmoe import P, Plan
from fmoe import model as kit
from fmoe.checkpoint import Spec


@dataclass(frozen=True)
class Config(kit.ModelConfig):
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

    HF = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_act": "silu",
          "attention_bias": False}
    PRESETS = {  # tiny: 8 query / 4 KV heads (tiny(num_key_value_heads=8) for tp=8); small: about 27M parameters
        "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, max_position_embeddings=256),
        "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=32,
                      num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=1024)}

    def __post_init__(self):
        kit.check_config(self, experts="num_experts")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` is a mixture of experts (else a dense MLP), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Config":  # transformers 5 writes num_experts as num_local_experts;
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None   # a window only when used
        return super().from_hf({"num_experts": hf.get("num_local_experts", cls.num_experts), **hf, "sliding_window": window})

    def to_hf(self) -> dict:
        return {**super().to_hf(), "use_sliding_window": self.sliding_window is not None}


def shapes(cfg: Config) -> dict[str, tuple]:
    """Every parameter path -> its shape, in init order (the one table of ``init`` and ``hf_specs``).

    Example:
        >>> shapes(Config.tiny())["layers.0.moe.w_gate_up"]
        (8, 64, 64)
    """
    D, E, I, Id, hd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size, cfg.head_dim
    moe = {"moe.router": (E, D), "moe.w_gate_up": (E, 2 * I, D), "moe.w_down": (E, D, I)}  # gate rows, then up
    mlp = {"mlp.w_gate_up": (2 * Id, D), "mlp.w_down": (D, Id)}                              # dense layers only
    return kit.decoder_shapes(cfg, lambda i: {
        "attn_norm": (D,), **kit.attention_shapes(cfg), "attn.q_norm": (hd,), "attn.k_norm": (hd,),  # all heads
        "mlp_norm": (D,), **(moe if cfg.is_sparse(i) else mlp)})


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters of :func:`shapes`: normal(0, initializer_range) weights, unit norms; the
    same seed gives the same tree on every process."""
    return kit.init_params(shapes(cfg), cfg.initializer_range, seed, dtype)


def attention(a: dict, x: torch.Tensor, i: int, ctx: kit.Context,
              entry: Optional[dict]) -> tuple[torch.Tensor, Optional[dict]]:
    """Grouped-query attention with RMSNorm per head on q and k: ``x [B, S, D] -> [B, S, D]``."""
    cfg = ctx.cfg
    heads = lambda t: rearrange(t, "b s (h d) -> b s h d", d=cfg.head_dim)  # noqa: E731
    eps, H, G = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    q = nn.head_rms_norm(heads(nn.linear(x, a["wq"])), a["q_norm"], eps, num_heads=H)  # [B, S, H_local, hd]
    k = nn.head_rms_norm(heads(nn.linear(x, a["wk"])), a["k_norm"], eps, num_heads=G)  # [B, S, G_local, hd]
    v = heads(nn.linear(x, a["wv"]))
    q, k = nn.apply_rope(q, ctx.cos, ctx.sin), nn.apply_rope(k, ctx.cos, ctx.sin)
    if entry is not None:
        entry, (k, v) = nn.cache.write(entry, ctx.step, k=k, v=v)  # k, v: [B, cached + S, G_local, hd]
    o = nn.attention(q, k, v, causal=True, window=cfg.sliding_window, num_kv_groups=H // G,
                     key_mask=ctx.step.key_mask, cp=ctx.cp)
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"]), entry  # [B, S, D]


def block(layer: dict, x: torch.Tensor, i: int, ctx: kit.Context, entry: Optional[dict]) -> tuple:
    """Decoder layer ``i``: ``x [B, S, D] -> (x, aux of its MoE block or None, cache entry)``; its
    FSDP-split weights are gathered here, so remat kind "layer" gathers them again in backward."""
    layer, eps = fmoe.unshard_layer(layer), ctx.cfg.rms_norm_eps
    a, entry = attention(layer["attn"], nn.rms_norm(x, layer["attn_norm"], eps), i, ctx, entry)
    h = x + a
    x = nn.rms_norm(h, layer["mlp_norm"], eps)
    if "moe" not in layer:                                   # mlp_only_layers, decoder_sparse_step
        return h + kit.mlp(layer["mlp"], x), None, entry
    y, aux = nn.remat.call("moe", kit.moe, layer["moe"], x, ctx, i)
    return h + y, aux, entry


def default_router(cfg: Config, biased: bool = False):
    """Softmax -> top-k, renormalized as the config says (``biased``: selection also reads ``expert_bias``)."""
    make = fmoe.routing.balance.biased_topk if biased else fmoe.routing.topk
    return make(cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob)


def forward(params: dict, tokens: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh] = None, *,
            impl: str = "auto", return_aux: bool = False, router: Optional[Any] = None,
            cache: Optional[dict] = None, positions: Optional[torch.Tensor] = None,
            hidden: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple]:
    """Logits ``[B, S, V]``, full on every rank (``(logits, cache)`` with a ``cache``; ``{"moe": [aux
    of each MoE layer]}`` last with ``return_aux``); ``router`` replaces every MoE layer's softmax
    top-k; the other arguments as :func:`fmoe.model.start` takes them.

    Example:
        >>> cfg = Config.tiny()
        >>> forward(init(cfg), torch.zeros(2, 5, dtype=torch.long), cfg).shape
        torch.Size([2, 5, 128])
    """
    router = kit.with_aux_loss(router or default_router(cfg), cfg)
    x, ctx, out = kit.start(params, tokens, cfg, mesh, cache, positions, impl=impl, router=router, hidden=hidden)
    for i, layer in out.layers(params["layers"]):  # x: [B, S, D]; all layers (a pipeline stage: its own)
        x = out.keep(*nn.remat.call("layer", block, layer, x, i, ctx, out.entry(i)))
    if out.hands_on(params):  # a pipeline stage before the last: x [B, S, D] goes on to the next stage
        return out.result(x, return_aux)
    logits = nn.linear(nn.rms_norm(x, params["norm"], cfg.rms_norm_eps), kit.lm_head(params, cfg), gather=True)
    return out.result(logits, return_aux)  # logits: [B, S, V], full on every rank


def plan(cfg: Config) -> Plan:
    """Default plan (non-strict; others replicated): q/k/v colwise, o rowwise, experts on ``ep``,
    dense MLPs packed colwise / rowwise, embedding vocab-parallel, lm_head colwise gathered.

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
HF_LAYER = {  # parameter of layer N -> its key(s) after "model.layers.N." (a list: concatenated on dim 0)
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    **{f"attn.w{x}": f"self_attn.{x}_proj.weight" for x in "qkvo"},
    "attn.q_norm": "self_attn.q_norm.weight", "attn.k_norm": "self_attn.k_norm.weight",
    "mlp.w_gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.w_down": "mlp.down_proj.weight",
    "moe.router": "mlp.gate.weight",
    "moe.w_gate_up": kit.Experts("mlp.experts.", "gate_proj", "up_proj"),  # one key per expert, stacked
    "moe.w_down": kit.Experts("mlp.experts.", "down_proj"),
}
HF_FUSED = {"moe.w_gate_up": "mlp.experts.gate_up_proj", "moe.w_down": "mlp.experts.down_proj"}


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, Spec]:
    """Every parameter path -> how it is made of checkpoint tensors: :data:`HF_LAYER` over
    :func:`shapes` (experts one key per expert, what ``save_pretrained`` writes), or
    :data:`HF_FUSED` in the layers where ``keys`` hold transformers' fused in-memory names.

    Example:
        >>> hf_specs(Config.tiny())["layers.0.moe.w_down"].shape
        (8, 64, 32)
    """
    return kit.hf_specs(shapes(cfg), HF_LAYER, keys, fused=HF_FUSED)


MODEL = kit.Model("qwen3_moe", Config, init, forward, plan, hf_specs, tp_fields=kit.TP_FIELDS,
                  context_parallel=True,
              init_cache=kit.init_kv_cache, aux_loss_fields=kit.AUX_LOSS_FIELDS,
              hf_router=("topk", {"k": "num_experts_per_tok", "normalize": "norm_topk_prob"}, {}),
              router=default_router)


def __getattr__(name: str) -> Any:  # load_hf, save_hf, shard, check_plan, init_cache: MODEL's methods
    return MODEL.attribute(__name__, name)
