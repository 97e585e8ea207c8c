"""OLMoE: every feed-forward block a mixture of experts, with RMSNorm over the whole q and k
projections, as pure functions on the public kit :mod:`fmoe.model`.

Numerics follow transformers' ``OlmoeForCausalLM`` op for op: q and k normalised over all their
heads at once (``q_norm [H*hd]``, ``k_norm [G*hd]``) before RoPE, q, k and v clipped to
``[-clip_qkv, clip_qkv]`` when set, softmax-top-k routing (renormalised when
``norm_topk_prob``), SwiGLU experts, the pad row of the embedding without gradient
(``pad_token_id``, 1 as transformers'). Shapes: B batch, S tokens, D hidden, H query / G KV heads,
hd head dim (``D // H``), E experts, I expert hidden, V vocab. Parallelism lives in :func:`plan`:
the q / k norms are split over tp like the projections' rows, and :func:`fmoe.nn.rms_norm` sums
the squares over the tp group, so the same forward runs on one process or many.
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
    """OLMoE hyper-parameters, named and defaulted as in transformers' ``OlmoeConfig``."""

    vocab_size: int = 50304
    hidden_size: int = 2048
    intermediate_size: int = 1024        # I, per expert
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    clip_qkv: Optional[float] = None     # q, k, v clamped to [-clip_qkv, clip_qkv] (None: not clipped)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()             # sorted (key, value) pairs of a non-default rope_parameters
    max_position_embeddings: int = 4096
    pad_token_id: Optional[int] = 1
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.01
    output_router_logits: bool = False  # True: each MoE layer adds coef * load-balance loss to aux

    HF = {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "hidden_act": "silu", "attention_bias": False}
    PRESETS = {  # tiny: 8 query / 4 KV heads (hd 8); small: about 27M parameters
        "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256),
        "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_experts=32,
                      num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)}

    @property
    def head_dim(self) -> int:
        """hd: ``hidden_size // num_attention_heads``, as transformers' OLMoE (no field of its own)."""
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self):
        kit.check_config(self, experts="num_experts")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"Config: clip_qkv must be None or a number > 0, got {self.clip_qkv!r}")


def shapes(cfg: Config) -> dict[str, tuple]:
    """Every parameter path -> its shape, in init order (the one table of ``init`` and ``hf_specs``).

    Example:
        >>> shapes(Config.tiny())["layers.0.attn.k_norm"]
        (32,)
    """
    D, E, I, hd = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size, cfg.head_dim
    return kit.decoder_shapes(cfg, lambda i: {
        "attn_norm": (D,), **kit.attention_shapes(cfg), "attn.q_norm": (cfg.num_attention_heads * hd,),
        "attn.k_norm": (cfg.num_key_value_heads * hd,), "mlp_norm": (D,),  # over the whole projections
        "moe.router": (E, D), "moe.w_gate_up": (E, 2 * I, D), "moe.w_down": (E, D, I)})  # gate rows, then up


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters of :func:`shapes`: normal(0, initializer_range) weights, unit norms; the
    same seed gives the same tree on every process."""
    return kit.init_params(shapes(cfg), cfg.initializer_range, seed, dtype)


def attention(a: dict, x: torch.Tensor, i: int, ctx: kit.Context,
              entry: Optional[dict]) -> tuple[torch.Tensor, Optional[dict]]:
    """Grouped-query attention, q and k normed over their projections, q k v clipped: ``x [B, S, D] -> [B, S, D]``."""
    cfg, eps, c, hd = ctx.cfg, ctx.cfg.rms_norm_eps, ctx.cfg.clip_qkv, ctx.cfg.head_dim
    heads = lambda t: rearrange(t if c is None else t.clamp(-c, c), "b s (h d) -> b s h d", d=hd)  # noqa: E731
    q = heads(nn.rms_norm(nn.linear(x, a["wq"]), a["q_norm"], eps))  # [B, S, H_local, hd]
    k = heads(nn.rms_norm(nn.linear(x, a["wk"]), a["k_norm"], eps))  # [B, S, G_local, hd]
    v = heads(nn.linear(x, a["wv"]))
    q, k = nn.apply_rope(q, ctx.cos, ctx.sin), nn.apply_rope(k, ctx.cos, ctx.sin)
    if entry is not None:
        entry, (k, v) = nn.cache.write(entry, ctx.step, k=k, v=v)  # k, v: [B, cached + S, G_local, hd]
    o = nn.attention(q, k, v, causal=True, num_kv_groups=cfg.num_attention_heads // cfg.num_key_value_heads,
                     key_mask=ctx.step.key_mask, cp=ctx.cp)
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
    """Default plan (non-strict; others replicated): q/k/v colwise with their norms split like
    their rows, o rowwise, experts on ``ep``, embedding vocab-parallel, lm_head colwise gathered.

    Example:
        >>> plan(Config.tiny()).match("layers.1.attn.q_norm")
        ('layers.*.attn.[qk]_norm', 'colwise')
    """
    return Plan({
        "embed": "vocab", "layers.*.attn.w[qkv]": "colwise", "layers.*.attn.[qk]_norm": "colwise",
        "layers.*.attn.wo": "rowwise", "layers.*.moe.router": "replicate", "layers.*.moe.w_*": "expert",
        **({} if cfg.tie_word_embeddings else {"lm_head": "colwise_gather"}),
    }, default=P(), strict=False)


# ---------------------------------------------------------------------------- checkpoint name map
HF_LAYER = {  # parameter of layer N -> its key after "model.layers.N."
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    **{f"attn.w{x}": f"self_attn.{x}_proj.weight" for x in "qkvo"},
    "attn.q_norm": "self_attn.q_norm.weight", "attn.k_norm": "self_attn.k_norm.weight",
    "moe.router": "mlp.gate.weight",
    "moe.w_gate_up": kit.Experts("mlp.experts.", "gate_proj", "up_proj"),  # one key per expert, stacked
    "moe.w_down": kit.Experts("mlp.experts.", "down_proj"),
}
HF_FUSED = {"moe.w_gate_up": "mlp.experts.gate_up_proj", "moe.w_down": "mlp.experts.down_proj"}


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, Spec]:
    """Every parameter path -> how it is made of checkpoint tensors: :data:`HF_LAYER` over
    :func:`shapes`, or :data:`HF_FUSED` in the layers where ``keys`` hold transformers' fused names.

    Example:
        >>> hf_specs(Config.tiny())["layers.0.attn.q_norm"]
        Key('model.layers.0.self_attn.q_norm.weight', (64,))
    """
    return kit.hf_specs(shapes(cfg), HF_LAYER, keys, fused=HF_FUSED)


TP_FIELDS = {**kit.TP_FIELDS, ("attn.q_norm", 0): "num_attention_heads", ("attn.k_norm", 0): "num_key_value_heads"}
MODEL = kit.Model("olmoe", Config, init, forward, plan, hf_specs, tp_fields=TP_FIELDS, init_cache=kit.init_kv_cache,
                  aux_loss_fields=kit.AUX_LOSS_FIELDS, width_fields={"I": "intermediate_size", "Id": None},
                  hf_router=("topk", {"k": "num_experts_per_tok", "normalize": "norm_topk_prob"}, {}),
                  router=default_router, context_parallel=True)


def __getattr__(name: str) -> Any:  # load_hf, save_hf, shard, check_plan, init_cache: MODEL's methods
    return MODEL.attribute(__name__, name)
