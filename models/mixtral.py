"""Mixtral: a decoder with a top-2 mixture of SwiGLU experts in every layer, as pure functions.

Numerics follow transformers' ``MixtralForCausalLM`` op for op: GQA attention with RoPE and an
optional sliding window (every layer), softmax-top-k routing always renormalised, no biases.
``router_jitter_noise`` (training-time noise on the router input) is not applied: forward is
deterministic. Shapes: B batch, S tokens, D hidden, H query heads, G KV heads, hd head dim,
E experts, I expert hidden, V vocab. Parallelism lives in :func:`plan` alone: the same
:func:`forward` runs on one process or many and returns the full logits on every rank.
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

    HF = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_act": "silu"}
    PRESETS = {  # tiny: 8 query / 4 KV heads (tiny(num_key_value_heads=8) for tp=8); small: about 14M parameters
        "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=8, num_local_experts=8, max_position_embeddings=256),
        "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024)}

    @property
    def num_experts(self) -> int:
        """E (``num_local_experts`` in the HF config)."""
        return self.num_local_experts

    def __post_init__(self):
        kit.check_config(self, experts="num_local_experts")


def shapes(cfg: Config) -> dict[str, tuple]:
    """Every parameter path -> its shape, in init order (the one table of ``init`` and ``hf_specs``).

    Example:
        >>> shapes(Config.tiny())["layers.1.moe.w_down"]
        (8, 64, 32)
    """
    D, E, I = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
    return kit.decoder_shapes(cfg, lambda i: {
        "attn_norm": (D,), **kit.attention_shapes(cfg), "mlp_norm": (D,),
        "moe.router": (E, D), "moe.w_gate_up": (E, 2 * I, D), "moe.w_down": (E, D, I)})  # gate (w1) rows, then up (w3)


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters of :func:`shapes`: normal(0, initializer_range) weights, unit norms; the
    same seed gives the same tree on every process."""
    return kit.init_params(shapes(cfg), cfg.initializer_range, seed, dtype)


def attention(a: dict, x: torch.Tensor, i: int, ctx: kit.Context,
              entry: Optional[dict]) -> tuple[torch.Tensor, Optional[dict]]:
    """Grouped-query attention with RoPE and the optional sliding window: ``x [B, S, D] -> [B, S, D]``."""
    cfg = ctx.cfg
    heads = lambda t: rearrange(t, "b s (h d) -> b s h d", d=cfg.head_dim)  # noqa: E731
    q = nn.apply_rope(heads(nn.linear(x, a["wq"])), ctx.cos, ctx.sin)  # [B, S, H_local, hd]
    k = nn.apply_rope(heads(nn.linear(x, a["wk"])), ctx.cos, ctx.sin)  # [B, S, G_local, hd]
    v = heads(nn.linear(x, a["wv"]))
    if entry is not None:
        entry, (k, v) = nn.cache.write(entry, ctx.step, k=k, v=v)  # k, v: [B, cached + S, G_local, hd]
    o = nn.attention(q, k, v, causal=True, window=cfg.sliding_window,
                     num_kv_groups=cfg.num_attention_heads // cfg.num_key_value_heads, key_mask=ctx.step.key_mask, cp=ctx.cp)
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"]), entry  # [B, S, D]


def block(layer: dict, x: torch.Tensor, i: int, ctx: kit.Context, entry: Optional[dict]) -> tuple:
    """Decoder layer ``i``: ``x [B, S, D] -> (x, aux of its MoE block, cache entry)``; its FSDP-split
    weights are gathered here, so remat kind "layer" gathers them again in backward."""
    layer, eps = fmoe.unshard_layer(layer), ctx.cfg.rms_norm_eps
    a, entry = attention(layer["attn"], nn.rms_norm(x, layer["attn_norm"], eps), i, ctx, entry)
    h = x + a
    y, aux = nn.remat.call("moe", kit.moe, layer["moe"], nn.rms_norm(h, layer["mlp_norm"], eps), ctx, i)
    return h + y, aux, entry


def default_router(cfg: Config, biased: bool = False):
    """Softmax -> top-k, always renormalized (``biased``: selection also reads ``expert_bias``)."""
    make = fmoe.routing.balance.biased_topk if biased else fmoe.routing.topk
    return make(cfg.num_experts_per_tok, normalize=True)


def forward(params: dict, tokens: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh] = None, *,
            impl: str = "auto", return_aux: bool = False, router: Optional[Any] = None,
            cache: Optional[dict] = None, positions: Optional[torch.Tensor] = None,
            hidden: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple]:
    """Logits ``[B, S, V]`` of the causal language model, full on every rank; ``(logits, cache)``
    with a ``cache`` (:func:`init_cache`); ``{"moe": [aux of each MoE layer]}`` last with
    ``return_aux``. ``router`` replaces the softmax top-k router of every MoE layer; the other
    arguments as :func:`fmoe.model.start` takes them.

    Example:
        >>> cfg = Config.tiny()
        >>> forward(init(cfg), torch.zeros(2, 5, dtype=torch.long), cfg).shape
        torch.Size([2, 5, 128])
    """
    router = kit.with_aux_loss(router or default_router(cfg), cfg)
    x, ctx, out = kit.start(params, tokens, cfg, mesh, cache, positions, impl=impl, router=router,
                                hidden=hidden)  # [B, S, D]
    for i, layer in out.layers(params["layers"]):  # all (a pipeline stage: its own)
        x = out.keep(*nn.remat.call("layer", block, layer, x, i, ctx, out.entry(i)))
    if out.hands_on(params):  # a pipeline stage before the last: x [B, S, D] goes on to the next stage
        return out.result(x, return_aux)
    logits = nn.linear(nn.rms_norm(x, params["norm"], cfg.rms_norm_eps), kit.lm_head(params, cfg), gather=True)
    return out.result(logits, return_aux)  # logits: [B, S, V], full on every rank


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
HF_LAYER = {  # parameter of layer N -> its key(s) after "model.layers.N." (the hub layout)
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    **{f"attn.w{x}": f"self_attn.{x}_proj.weight" for x in "qkvo"},
    "moe.router": "block_sparse_moe.gate.weight",
    "moe.w_gate_up": kit.Experts("block_sparse_moe.experts.", "w1", "w3"),  # gate, up: one key per expert, stacked
    "moe.w_down": kit.Experts("block_sparse_moe.experts.", "w2"),
}
HF_FUSED = {"moe.router": "mlp.gate.weight", "moe.w_gate_up": "mlp.experts.gate_up_proj",
            "moe.w_down": "mlp.experts.down_proj"}  # transformers' in-memory names, read where a checkpoint holds them


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, Spec]:
    """Every parameter path -> how it is made of checkpoint tensors: :data:`HF_LAYER` over
    :func:`shapes`, or :data:`HF_FUSED` in the layers where ``keys`` hold the fused names.

    Example:
        >>> hf_specs(Config.tiny())["layers.0.moe.router"]
        Key('model.layers.0.block_sparse_moe.gate.weight', (8, 64))
    """
    return kit.hf_specs(shapes(cfg), HF_LAYER, keys, fused=HF_FUSED)


MODEL = kit.Model("mixtral", Config, init, forward, plan, hf_specs, tp_fields=kit.TP_FIELDS,
                  context_parallel=True,
              init_cache=kit.init_kv_cache, aux_loss_fields=kit.AUX_LOSS_FIELDS,
              width_fields={"E": "num_local_experts", "I": "intermediate_size"},
              hf_router=("topk", {"k": "num_experts_per_tok"}, {"normalize": True}), router=default_router)


def __getattr__(name: str) -> Any:  # load_hf, save_hf, shard, check_plan, init_cache: MODEL's methods
    return MODEL.attribute(__name__, name)
