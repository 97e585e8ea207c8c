"""DeepSeek-V3 (also Kimi K2, DeepSeek-R1): latent attention and aux-loss-free MoE, as pure functions.

Numerics follow transformers' ``DeepseekV3ForCausalLM`` op for op. **MLA**: queries from a plain
or a low-rank projection (``wq_b @ norm(wq_a @ x)``); keys and values from one compressed latent
``c = norm(x @ wkv_a[:C])``, expanded per head by ``wkv_b``, plus one rotary key ``k_rot`` shared
by every head (a head's key is ``[k_nope_h | k_rot]``; a decoding cache holds only ``c`` and
``k_rot``). **RoPE** on the ``qk_rope_head_dim`` features, YaRN with ``mscale`` as transformers
computes it; ``rope_interleave`` reads the pairs interleaved, as DeepSeek's checkpoints store
them. **Routing** as ``noaux_tc`` (:func:`fmoe.routing.sigmoid_topk`): sigmoid scores plus
``expert_bias`` (no gradient; the trainer's ``update_bias`` moves it) pick ``topk_group`` of
``n_group`` groups, then the top-k; weights are the unbiased scores, renormalised with
``norm_topk_prob``, times ``routed_scaling_factor``. **Shared experts** (one SwiGLU MLP) join
every MoE layer; the first ``first_k_dense_replace`` layers are dense.

Shapes: B batch, S tokens, D hidden, H heads, C kv_lora_rank, Q q_lora_rank, n/r/v the
nope/rope/value head dims, E experts, I expert hidden, Is = I * n_shared_experts, Id dense
hidden. Parallelism lives in :func:`plan` alone (MLA split by heads, experts on ``ep``).
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

LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm keep the default eps


@dataclass(frozen=True)
class Config(kit.ModelConfig):
    """DeepSeek-V3 hyper-parameters, named and defaulted as in transformers' ``DeepseekV3Config``."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432       # dense layers
    moe_intermediate_size: int = 2048    # I, per expert (shared experts: I * n_shared_experts)
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: Optional[int] = 1536    # None: plain q projection
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()             # sorted (key, value) pairs of a non-default rope_parameters
    rope_interleave: bool = True

    HF = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_act": "silu",
          "attention_bias": False}
    PRESETS = {  # tiny: 3 layers (the first dense), 8 experts in 4 groups (2 used) top-2: tp, ep <= 8. small: 32 top-4
        "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                     num_attention_heads=8, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                     first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                     v_head_dim=12, max_position_embeddings=256),
        "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=8, n_routed_experts=32, n_group=4, topk_group=2,
                      num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96,
                      qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=1024)}

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts
    shared_expert_intermediate_size = property(lambda self: self.moe_intermediate_size * self.n_shared_experts)  # Is

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def __post_init__(self):
        kit.check_config(self, kv_heads=None, at_least_zero=("first_k_dense_replace",),
                             rope_dim=self.qk_rope_head_dim)
        E, G, k = self.n_routed_experts, self.n_group, self.topk_group
        if E % G or E // G < 2 or k > G or self.num_experts_per_tok > k * (E // G):
            raise ValueError(f"Config: n_group={G} must split n_routed_experts={E} into groups of >= 2 experts (a "
                             f"group scores its top-2 sum), topk_group={k} be <= n_group and num_experts_per_tok="
                             f"{self.num_experts_per_tok} <= topk_group * n_routed_experts / n_group = {k * (E // G)}")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` is a mixture of experts (the first ``first_k_dense_replace`` are dense)."""
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Config":  # MLA: a KV head per query head; null groups: one
        heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
        if kv is not None and kv != heads:
            raise ValueError(f"Config.from_hf: num_key_value_heads={kv} must equal num_attention_heads={heads} "
                             "(MLA expands every head from the latent)")
        return super().from_hf({**hf, **{f: 1 for f in ("n_group", "topk_group") if f in hf and hf[f] is None}})

    def to_hf(self) -> dict:
        return {**super().to_hf(), "num_key_value_heads": self.num_attention_heads}


def shapes(cfg: Config) -> dict[str, tuple]:
    """Every parameter path -> its shape, in init order (the one table of ``init`` and ``hf_specs``)."""
    D, E, I, Id = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    H, C, Q, r, n, v = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim,
                        cfg.qk_nope_head_dim, cfg.v_head_dim)
    Is = cfg.shared_expert_intermediate_size                                             # the shared experts' MLP
    q = ({"attn.wq": (H * (n + r), D)} if Q is None else                                   # plain q projection
         {"attn.wq_a": (Q, D), "attn.q_a_norm": (Q,), "attn.wq_b": (H * (n + r), Q)})      # low-rank q
    attn = {**q, "attn.wkv_a": (C + r, D), "attn.kv_a_norm": (C,),                         # latent c, then k_rot
            "attn.wkv_b": (H * (n + v), C), "attn.wo": (D, H * v)}                         # c -> per-head k_nope, v
    moe = {"moe.router": (E, D), "moe.expert_bias": (E,), "moe.w_gate_up": (E, 2 * I, D), "moe.w_down": (E, D, I),
           "moe.shared.w_gate_up": (2 * Is, D), "moe.shared.w_down": (D, Is)}             # shared experts: one MLP
    mlp = {"mlp.w_gate_up": (2 * Id, D), "mlp.w_down": (D, Id)}                            # the first dense layers
    return kit.decoder_shapes(cfg, lambda i: {"attn_norm": (D,), **attn, "mlp_norm": (D,),
                                                  **(moe if cfg.is_sparse(i) else mlp)})


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Random parameters of :func:`shapes`: normal(0, initializer_range) weights, unit norms, zero
    expert bias; the same seed gives the same tree on every process."""
    return kit.init_params(shapes(cfg), cfg.initializer_range, seed, dtype, zeros=("expert_bias",))


def init_cache(cfg: Config, batch: int, max_len: int, mesh: Optional[fmoe.Mesh] = None,
               dtype: torch.dtype = torch.float32) -> dict:
    """An empty decoding cache (:mod:`fmoe.nn.cache`): per layer the compressed ``latent
    [B, L, C]`` and the rotary key ``k_rot [B, L, r]``, shared by all heads (so replicated)."""
    entry = {"latent": (cfg.kv_lora_rank,), "k_rot": (cfg.qk_rope_head_dim,)}
    return nn.cache.init_cache(batch, max_len, [entry] * cfg.num_hidden_layers, dtype=dtype, mesh=mesh)


def softmax_scale(cfg: Config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` with YaRN (as transformers)."""
    s, scale = dict(cfg.rope_scaling), cfg.qk_head_dim ** -0.5
    if s.get("rope_type", s.get("type", "default")) != "default" and s.get("mscale_all_dim"):
        m = nn.yarn_mscale(s["factor"], s["mscale_all_dim"])
        scale = scale * m * m
    return scale


def attention(a: dict, x: torch.Tensor, ctx: kit.Context, entry: Optional[dict]) -> tuple[torch.Tensor, Optional[dict]]:
    """Multi-head latent attention: ``x [B, S, D] -> [B, S, D]``, caching the latent and the rope key."""
    cfg, cos, sin, step = ctx.cfg, ctx.cos, ctx.sin, ctx.step
    n, r, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    heads = lambda t, d: rearrange(t, "b s (h d) -> b s h d", d=d)  # noqa: E731

    def rope(t: torch.Tensor) -> torch.Tensor:  # rope_interleave: pairs (x0, x1), ...: evens then odds, as usual
        return nn.apply_rope(rearrange(t, "... (r two) -> ... (two r)", two=2) if cfg.rope_interleave else t, cos, sin)

    q = nn.linear(x, a["wq"]) if "wq" in a else \
        nn.linear(nn.rms_norm(nn.linear(x, a["wq_a"]), a["q_a_norm"], LATENT_EPS), a["wq_b"])
    q_nope, q_rot = heads(q, n + r).split([n, r], dim=-1)                         # [B, S, H_local, n | r]
    latent, k_rot = nn.linear(x, a["wkv_a"]).split([cfg.kv_lora_rank, r], dim=-1)  # [B, S, C], [B, S, r]
    latent, k_rot = nn.rms_norm(latent, a["kv_a_norm"], LATENT_EPS), nn.shared_by_heads(k_rot, a["wkv_b"])
    q_rot, k_rot = rope(q_rot), rope(k_rot[:, :, None])[:, :, 0]                  # k_rot: [B, S, r], all heads'
    if entry is not None:  # the cache holds the latent and the rope key, not per-head K/V
        entry, (latent, k_rot) = nn.cache.write(entry, step, latent=latent, k_rot=k_rot)
    k_nope, val = heads(nn.linear(latent, a["wkv_b"]), n + v).split([n, v], dim=-1)  # [B, Sk, H_local, n | v]
    k_rot = k_rot[:, :, None].expand(-1, -1, k_nope.shape[2], -1)
    k = torch.cat([k_nope, k_rot], dim=-1)                                       # [B, Sk, H_local, n + r]
    o = nn.attention(torch.cat([q_nope, q_rot], dim=-1), k, val, causal=True, scale=softmax_scale(cfg),
                     key_mask=step.key_mask, cp=ctx.cp)                          # [B, S, H_local, v]
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"]), entry


def block(layer: dict, x: torch.Tensor, i: int, ctx: kit.Context, entry: Optional[dict]) -> tuple:
    """Decoder layer ``i``: ``x [B, S, D] -> (x, aux of its MoE block or None, cache entry)``; its
    FSDP-split weights are gathered here, so remat kind "layer" gathers them again in backward."""
    layer, eps = fmoe.unshard_layer(layer), ctx.cfg.rms_norm_eps
    a, entry = attention(layer["attn"], nn.rms_norm(x, layer["attn_norm"], eps), ctx, entry)
    h = x + a
    x = nn.rms_norm(h, layer["mlp_norm"], eps)
    if "moe" not in layer:                                   # the first first_k_dense_replace layers
        return h + kit.mlp(layer["mlp"], x), None, entry
    y, aux = nn.remat.call("moe", kit.moe, layer["moe"], x, ctx, i)  # routed + shared experts
    return h + y, aux, entry


def default_router(cfg: Config, biased: bool = True):
    """transformers' ``noaux_tc`` routing: :func:`fmoe.routing.sigmoid_topk` with group limits
    (its selection reads ``expert_bias`` already, so ``biased`` changes nothing)."""
    return fmoe.routing.sigmoid_topk(cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob,
                                     scale=cfg.routed_scaling_factor, num_groups=cfg.n_group,
                                     topk_groups=cfg.topk_group, group_top=2)


def forward(params: dict, tokens: torch.Tensor, cfg: Config, mesh: Optional[fmoe.Mesh] = None, *,
            impl: str = "auto", return_aux: bool = False, router: Optional[Any] = None, cache: Optional[dict] = None,
            positions: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple]:
    """Logits ``[B, S, V]`` of the causal language model, full on every rank; ``(logits, cache)``
    with a ``cache`` (:func:`init_cache`); ``{"moe": [aux of each MoE layer]}`` last with
    ``return_aux``. ``router`` replaces the ``noaux_tc`` router of every MoE layer (it receives
    ``expert_bias``); the other arguments as :func:`fmoe.model.start` takes them."""
    x, ctx, out = kit.start(params, tokens, cfg, mesh, cache, positions, rope_dim=cfg.qk_rope_head_dim, impl=impl,
                           router=router or default_router(cfg), hidden=hidden)  # x: [B, S, D]
    for i, layer in out.layers(params["layers"]):  # all (a pipeline stage: its own)
        x = out.keep(*nn.remat.call("layer", block, layer, x, i, ctx, out.entry(i)))
    if out.hands_on(params):  # a pipeline stage before the last: x [B, S, D] goes on to the next stage
        return out.result(x, return_aux)
    logits = nn.linear(nn.rms_norm(x, params["norm"], cfg.rms_norm_eps), kit.lm_head(params, cfg), gather=True)
    return out.result(logits, return_aux)  # logits: [B, S, V], full on every rank


def plan(cfg: Config) -> Plan:
    """Default plan (non-strict; unnamed leaves replicated): MLA split by heads (``wq`` or ``wq_b``,
    ``wkv_b`` colwise, ``wo`` rowwise; the low-rank and latent projections replicated), experts on
    ``ep``, shared experts and dense MLPs packed colwise / rowwise, embedding vocab-parallel."""
    q = "layers.*.attn.wq" if cfg.q_lora_rank is None else "layers.*.attn.wq_b"
    sparse = [cfg.is_sparse(i) for i in range(cfg.num_hidden_layers)]
    return Plan({
        "embed": "vocab", q: "colwise", "layers.*.attn.wkv_b": "colwise", "layers.*.attn.wo": "rowwise",
        "layers.*.attn.*": "replicate",
        **({} if not any(sparse) else {
            "layers.*.moe.router": "replicate", "layers.*.moe.expert_bias": "replicate", "layers.*.moe.w_*": "expert",
            "layers.*.moe.shared.w_gate_up": "packed_colwise", "layers.*.moe.shared.w_down": "rowwise"}),
        **({} if all(sparse) else {"layers.*.mlp.w_gate_up": "packed_colwise", "layers.*.mlp.w_down": "rowwise"}),
        **({} if cfg.tie_word_embeddings else {"lm_head": "colwise_gather"}),
    }, default=P(), strict=False)


# ---------------------------------------------------------------------------- checkpoint name map
HF_LAYER = {  # parameter of layer N -> its key(s) after "model.layers.N." (a list: concatenated on dim 0)
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight", "attn.wq_a": "self_attn.q_a_proj.weight",
    "attn.q_a_norm": "self_attn.q_a_layernorm.weight", "attn.wq_b": "self_attn.q_b_proj.weight",
    "attn.wkv_a": "self_attn.kv_a_proj_with_mqa.weight", "attn.kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b": "self_attn.kv_b_proj.weight", "attn.wo": "self_attn.o_proj.weight",
    "mlp.w_gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.w_down": "mlp.down_proj.weight",
    "moe.router": "mlp.gate.weight", "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.w_gate_up": kit.Experts("mlp.experts.", "gate_proj", "up_proj"),  # one key per expert, stacked
    "moe.w_down": kit.Experts("mlp.experts.", "down_proj"),
    "moe.shared.w_gate_up": ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"],
    "moe.shared.w_down": "mlp.shared_experts.down_proj.weight",
}
HF_FUSED = {"moe.w_gate_up": "mlp.experts.gate_up_proj", "moe.w_down": "mlp.experts.down_proj"}


def hf_specs(cfg: Config, keys: Optional[Sequence[str]] = None) -> dict[str, Spec]:
    """Every parameter path -> how it is made of checkpoint tensors: :data:`HF_LAYER` over
    :func:`shapes`, or :data:`HF_FUSED` in the layers where ``keys`` hold the fused names."""
    return kit.hf_specs(shapes(cfg), HF_LAYER, keys, fused=HF_FUSED)


MODEL = kit.Model("deepseek_v3", Config, init, forward, plan, hf_specs, tp_fields=kit.TP_FIELDS,
                  context_parallel=True,
              init_cache=init_cache, width_fields={"E": "n_routed_experts", "G": None, "hd": None},
              hf_router=("sigmoid_topk", {"k": "num_experts_per_tok", "normalize": "norm_topk_prob",
                                          "scale": "routed_scaling_factor", "num_groups": "n_group",
                                          "topk_groups": "topk_group"}, {"group_top": 2}),
              router=default_router, router_scores="sigmoid", hf_expert_bias=True, balance="bias")


def __getattr__(name: str) -> Any:  # load_hf, save_hf, shard, check_plan: MODEL's methods
    return MODEL.attribute(__name__, name)
