"""gpt-oss: attention sinks, biases everywhere and clamped-SwiGLU experts, as pure functions.

As transformers' ``GptOssForCausalLM`` op for op: q/k/v/o with biases, YaRN RoPE, a learned sink
logit per query head in the softmax denominator, sliding-window / full attention by ``layer_types``,
a biased router (top-k on the logits, softmax over the k), experts with biases and the clamped
SwiGLU ``(clamp(up) + 1) * gate * sigmoid(alpha * gate)`` (gate clamped above at ``limit``). Shapes:
B, S, D, H / G heads, hd, E, I, V (MXFP4 ``*_blocks`` / ``*_scales`` keys: dequantize first).
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
from fmoe.checkpoint import Deinterleave, Key, Spec, Transpose

_YARN = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0), ("original_max_position_embeddings", 4096),
         ("rope_type", "yarn"), ("truncate", False))
_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Config(kit.ModelConfig):
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
    sliding_window: int = 128            # of the "sliding_attention" layers
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

    HF = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_act": "silu"}
    PRESETS = {  # tiny: sliding window 4, then full, YaRN; tiny(num_key_value_heads=8) for tp=8. small: ~27M params
        "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                     max_position_embeddings=256),
        "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_local_experts=32,
                      sliding_window=64, max_position_embeddings=1024)}

    @property
    def num_experts(self) -> int:
        """E (``num_local_experts`` in the HF config)."""
        return self.num_local_experts

    def __post_init__(self):
        kit.check_config(self, experts="num_local_experts")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(_LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(_LAYER_TYPES):
            raise ValueError(f"Config: layer_types must list one of {_LAYER_TYPES} per layer "
                             f"(num_hidden_layers={self.num_hidden_layers}), got {self.layer_types!r}")


def shapes(cfg: Config) -> dict[str, tuple]:
    """Every parameter path -> its shape, in init order.

    Example:
        >>> shapes(Config.tiny())["layers.0.moe.b_gate_up"]
        (8, 64)
    """
    D, E, I, H = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size, cfg.num_attention_heads
    q, kv = H * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = {}
    for x, shape in (("q", (q, D)), ("k", (kv, D)), ("v", (kv, D)), ("o", (D, q))):
        attn.update({f"attn.w{x}": shape, **({f"attn.b{x}": shape[:1]} if cfg.attention_bias else {})})
    return kit.decoder_shapes(cfg, lambda i: {
        "attn_norm": (D,), **attn, "attn.sinks": (H,), "mlp_norm": (D,), "moe.router": (E, D), "moe.router_bias": (E,),
        "moe.w_gate_up": (E, 2 * I, D), "moe.b_gate_up": (E, 2 * I),  # gate rows first, then up
        "moe.w_down": (E, D, I), "moe.b_down": (E, D)})


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters of :func:`shapes`: normal(0, initializer_range) weights, sinks and router
    bias; unit norms; zero projection and expert biases; the same seed gives the same tree everywhere."""
    return kit.init_params(shapes(cfg), cfg.initializer_range, seed, dtype, zeros=("b_*", "b[qkvo]"))


def attention(a: dict, x: torch.Tensor, ctx: kit.Context, entry: Optional[dict],
              window: Optional[int]) -> tuple[torch.Tensor, Optional[dict]]:
    """Grouped-query attention with biases and one sink logit per head, over the last ``window``
    keys (None: all): ``x [B, S, D] -> [B, S, D]``."""
    cfg = ctx.cfg
    heads = lambda t: rearrange(t, "b s (h d) -> b s h d", d=cfg.head_dim)  # noqa: E731
    q = nn.apply_rope(heads(nn.linear(x, a["wq"], a.get("bq"))), ctx.cos, ctx.sin)  # [B, S, H_local, hd]
    k = nn.apply_rope(heads(nn.linear(x, a["wk"], a.get("bk"))), ctx.cos, ctx.sin)  # [B, S, G_local, hd]
    v = heads(nn.linear(x, a["wv"], a.get("bv")))
    if entry is not None:
        entry, (k, v) = nn.cache.write(entry, ctx.step, k=k, v=v)  # k, v: [B, cached + S, G_local, hd]
    o = nn.attention(q, k, v, causal=True, window=window, sinks=a["sinks"],
                     num_kv_groups=cfg.num_attention_heads // cfg.num_key_value_heads, key_mask=ctx.step.key_mask, cp=ctx.cp)
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"], a.get("bo")), entry  # [B, S, D]


def block(layer: dict, x: torch.Tensor, i: int, ctx: kit.Context, entry: Optional[dict]) -> tuple:
    """Decoder layer ``i``, sliding or full attention by ``layer_types``: ``x [B, S, D] -> (x, aux of
    its MoE block, cache entry)``; FSDP-split weights gathered here (remat "layer" regathers them)."""
    layer, cfg, eps = fmoe.unshard_layer(layer), ctx.cfg, ctx.cfg.rms_norm_eps
    window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
    a, entry = attention(layer["attn"], nn.rms_norm(x, layer["attn_norm"], eps), ctx, entry, window)
    h = x + a
    y, aux = nn.remat.call("moe", kit.moe, layer["moe"], nn.rms_norm(h, layer["mlp_norm"], eps), ctx, i)
    return h + y, aux, entry                                  # the experts' activation: ctx.act


def default_router(cfg: Config, biased: bool = False):
    """Top-k of the logits, softmax over the chosen (``biased``: selection also reads ``expert_bias``)."""
    make = fmoe.routing.balance.biased_topk_softmax if biased else fmoe.routing.topk_softmax
    return make(cfg.num_experts_per_tok)


def forward(params: dict, tokens: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh] = None, *,
            impl: str = "auto", return_aux: bool = False, router: Optional[Any] = None,
            cache: Optional[dict] = None, positions: Optional[torch.Tensor] = None,
            hidden: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple]:
    """Logits ``[B, S, V]``, full on every rank (``(logits, cache)`` with a ``cache``; ``{"moe": [aux
    of each MoE layer]}`` last with ``return_aux``); ``router`` replaces every MoE layer's top-k
    then softmax; the other arguments as :func:`fmoe.model.start` takes them.

    Example:
        >>> cfg = Config.tiny()
        >>> forward(init(cfg), torch.zeros(2, 5, dtype=torch.long), cfg).shape
        torch.Size([2, 5, 128])
    """
    router = kit.with_aux_loss(router or default_router(cfg), cfg)
    act = fmoe.experts.clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit)
    x, ctx, out = kit.start(params, tokens, cfg, mesh, cache, positions, impl=impl, router=router, act=act,
                                hidden=hidden)
    for i, layer in out.layers(params["layers"]):  # x: [B, S, D]; all layers (a pipeline stage: its own)
        x = out.keep(*nn.remat.call("layer", block, layer, x, i, ctx, out.entry(i)))
    if out.hands_on(params):  # a pipeline stage before the last: x [B, S, D] goes on to the next stage
        return out.result(x, return_aux)
    logits = nn.linear(nn.rms_norm(x, params["norm"], cfg.rms_norm_eps), kit.lm_head(params, cfg), gather=True)
    return out.result(logits, return_aux)  # logits: [B, S, V], full on every rank


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
HF_LAYER = {  # parameter of layer N -> its key(s) after "model.layers.N.", or a spec of (prefix, shape); the
    # experts are stored for x @ W (last two dims swapped), gate_up_proj [E, D, 2I] with gate and up interleaved
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    **{f"attn.{w}{x}": f"self_attn.{x}_proj.{kind}" for w, kind in (("w", "weight"), ("b", "bias")) for x in "qkvo"},
    "attn.sinks": "self_attn.sinks", "moe.router": "mlp.router.weight", "moe.router_bias": "mlp.router.bias",
    "moe.w_gate_up": lambda k, s: Transpose(Deinterleave(Key(k + "mlp.experts.gate_up_proj", (s[0], s[2], s[1])), dim=2), 1, 2),
    "moe.b_gate_up": lambda k, s: Deinterleave(Key(k + "mlp.experts.gate_up_proj_bias", s), dim=1),
    "moe.w_down": lambda k, s: Transpose(Key(k + "mlp.experts.down_proj", (s[0], s[2], s[1])), 1, 2),
    "moe.b_down": "mlp.experts.down_proj_bias",
}


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, Spec]:
    """Every parameter path -> how it is made of checkpoint tensors (:data:`HF_LAYER` over :func:`shapes`).

    Example:
        >>> hf_specs(Config.tiny())["layers.0.moe.w_gate_up"]
        Transpose(Deinterleave(Key('model.layers.0.mlp.experts.gate_up_proj', (8, 64, 64)), dim=2, n=2), 1, 2)
    """
    return kit.hf_specs(shapes(cfg), HF_LAYER, keys)


MODEL = kit.Model("gpt_oss", Config, init, forward, plan, hf_specs, tp_fields=kit.TP_FIELDS,
                  context_parallel=True,
              init_cache=kit.init_kv_cache, aux_loss_fields=kit.AUX_LOSS_FIELDS,
              width_fields={"E": "num_local_experts", "I": "intermediate_size"},
              hf_router=("topk_softmax", {"k": "num_experts_per_tok"}, {}), router=default_router)


def __getattr__(name: str) -> Any:  # load_hf, save_hf, shard, check_plan, init_cache: MODEL's methods
    return MODEL.attribute(__name__, name)
