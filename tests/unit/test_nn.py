"""fmoe.nn layer functions in one process: parity with transformers' modules and plain torch,
and input validation. (Tensor-parallel behaviour: tests/distributed/test_tp_styles.py.)"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

import fmoe.nn as nn
from helpers import close


def rnd(*shape, seed=0, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_() if grad else t


def test_linear_embedding_mlp_match_torch():
    x, w, b = rnd(2, 3, 8, seed=1), rnd(6, 8, seed=2), rnd(6, seed=3)
    assert torch.equal(nn.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(nn.linear(x, w), x @ w.T)
    table, tokens = rnd(10, 4), torch.tensor([[0, 9, 3], [3, 3, 1]])
    assert torch.equal(nn.embedding(tokens, table), table[tokens])
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=5, num_attention_heads=2, mlp_bias=True))
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    b_gate_up = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
    out = nn.swiglu_mlp(x, w_gate_up, mlp.down_proj.weight, b_gate_up, mlp.down_proj.bias)
    close(out, mlp(x).detach(), "swiglu_mlp")
    assert torch.equal(nn.swiglu(w[0], w[1]), F.silu(w[0]) * w[1])


def test_norms_match_transformers_bitwise():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = rnd(2, 5, 4, 8) * 3
    norm = LlamaRMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    assert torch.equal(nn.rms_norm(x, norm.weight, 1e-5), norm(x))
    # q/k norm: the same weight on every head (Qwen3's q_norm applied to [B, S, H, hd])
    assert torch.equal(nn.head_rms_norm(x, norm.weight, 1e-5, num_heads=4), norm(x))
    xb = x.to(torch.bfloat16)
    assert torch.equal(nn.rms_norm(xb, norm.weight.to(torch.bfloat16), 1e-5),
                       norm.to(torch.bfloat16)(xb))


def _hf_cfg(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=4096, **kw)


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
             "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                    "original_max_position_embeddings": 1024},
}


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_matches_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    scaling = ROPES[name]
    cfg = _hf_cfg(rope_parameters={"rope_theta": 50000.0, **(scaling or {"rope_type": "default"})})
    inv_freq, att = nn.rope_frequencies(16, 50000.0, scaling, max_position_embeddings=4096)
    if scaling is None:
        ref_inv, ref_att = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref_inv, ref_att = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg)
    assert torch.equal(inv_freq, ref_inv) and att == ref_att
    positions = torch.arange(7)[None].expand(2, 7)
    cos, sin = nn.rope_cos_sin(positions, inv_freq, att)
    ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1), positions)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    q, k = rnd(2, 7, 4, 16, seed=1), rnd(2, 7, 2, 16, seed=2)  # [B, S, H, hd]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert torch.equal(nn.apply_rope(q, cos, sin), ref_q.transpose(1, 2))
    assert torch.equal(nn.apply_rope(k, cos[0], sin[0]), ref_k.transpose(1, 2))  # [S, hd] tables broadcast


def _hf_attention(q, k, v, window=None, sinks=None):
    """transformers' eager attention (llama, or gpt-oss with sinks) with its own mask functions."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    if sinks is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    s = q.shape[1]
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    allowed = fn(0, 0, torch.arange(s)[:, None], torch.arange(s)[None, :])
    mask = torch.zeros(s, s).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    module = SimpleNamespace(num_key_value_groups=q.shape[2] // k.shape[2], training=False, sinks=sinks)
    t = lambda x: rearrange(x, "b s h d -> b h s d")  # noqa: E731
    out, _ = eager_attention_forward(module, t(q), t(k), t(v), mask, scaling=q.shape[-1] ** -0.5)
    return out  # [B, S, H, hd]


@pytest.mark.parametrize("window,with_sinks", [(None, False), (3, False), (None, True), (2, True)])
def test_attention_matches_transformers_outputs_and_gradients(window, with_sinks):
    q, k, v = rnd(2, 6, 4, 8, seed=1, grad=True), rnd(2, 6, 2, 8, seed=2, grad=True), rnd(2, 6, 2, 8, seed=3, grad=True)
    sinks = rnd(4, seed=4, grad=True) if with_sinks else None
    out = nn.attention(q, k, v, window=window, sinks=sinks, num_kv_groups=2)
    ref = _hf_attention(q, k, v, window, sinks)
    close(out, ref, "attention")
    coef = rnd(*out.shape, seed=5)
    inputs = [q, k, v] + ([sinks] if with_sinks else [])
    mine = torch.autograd.grad((out * coef).sum(), inputs)
    theirs = torch.autograd.grad((ref * coef).sum(), inputs)
    for name, a, b in zip("qkvs", mine, theirs):
        close(a, b, f"d{name}")


def test_bf16_attention_on_cpu_computes_its_core_in_fp32():
    """bf16 q/k/v on CPU: the fused core runs in fp32 (its bf16 backward is ~3x slower there), so
    output and gradients equal the fp32 core on the same bf16 values up to the final rounding."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, h, 8, generator=g).to(torch.bfloat16).requires_grad_() for h in (4, 2, 2))
    out = nn.attention(q, k, v)
    assert out.dtype == torch.bfloat16
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = nn.attention(q32, k32, v32)
    assert torch.equal(out, ref.to(torch.bfloat16))
    gy = torch.randn(out.shape, generator=g)
    out.backward(gy.to(torch.bfloat16))
    ref.backward(gy.to(torch.bfloat16).float())
    for a, b in zip((q, k, v), (q32, k32, v32)):
        assert torch.equal(a.grad, b.grad.to(torch.bfloat16))


def test_window_convention_and_queries_after_a_prefix():
    # transformers: key j visible from query i iff j <= i and i - j < window
    assert nn.visible(4, 4, window=2).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert nn.visible(2, 4, causal=True).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    q, k, v = rnd(1, 6, 2, 4, seed=1), rnd(1, 6, 2, 4, seed=2), rnd(1, 6, 2, 4, seed=3)
    # the last 2 queries against all 6 keys = the last 2 rows of the full computation
    close(nn.attention(q[:, 4:], k, v, window=3), nn.attention(q, k, v, window=3)[:, 4:], "prefix")
    full = nn.attention(q, k, v, causal=False)
    close(full, _softmax_reference(q, k, v), "non-causal")


def _softmax_reference(q, k, v):
    scores = torch.einsum("bshd,bthd->bhst", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)


def test_cross_entropy_matches_torch_and_ignores_index():
    logits, targets = rnd(2, 5, 7), torch.tensor([[1, 2, -100, 6, 0], [3, -100, 4, 5, 5]])
    ref = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), ignore_index=-100)
    assert torch.equal(nn.cross_entropy(logits, targets), ref)
    assert torch.equal(nn.cross_entropy(logits.to(torch.bfloat16), targets),
                       F.cross_entropy(logits.to(torch.bfloat16).float().reshape(-1, 7), targets.reshape(-1)))


def test_bad_inputs_raise_naming_the_argument():
    x, w = rnd(2, 8), rnd(6, 8)
    cases = [
        (lambda: nn.linear(rnd(2, 5), w), ValueError, "x has 5 features but w (6, 8) expects 8"),
        (lambda: nn.linear(x, rnd(6, 8, 2)), ValueError, "w must have 2 dims"),
        (lambda: nn.linear(x, w, rnd(5)), ValueError, "b has shape (5,) but w has 6 output features"),
        (lambda: nn.linear([1.0], w), TypeError, "x must be a torch.Tensor, got list"),
        (lambda: nn.embedding(torch.tensor([0, 10]), rnd(10, 4)), ValueError, "token ids must lie in [0, 10), got min 0, max 10"),
        (lambda: nn.embedding(torch.tensor([0.0]), rnd(10, 4)), TypeError, "tokens must be an integer tensor"),
        (lambda: nn.rms_norm(x, rnd(7)), ValueError, "x has last dim 8 but w has 7 entries"),
        (lambda: nn.rms_norm(x, rnd(8), eps=-1.0), ValueError, "eps must be a number >= 0, got -1.0"),
        (lambda: nn.head_rms_norm(rnd(2, 3, 4), rnd(4), 1e-6, num_heads=4), ValueError, "num_heads=4 must be a positive multiple of the 3 heads"),
        (lambda: nn.rope_frequencies(7, 1e4), ValueError, "head_dim must be an even int >= 2, got 7"),
        (lambda: nn.rope_frequencies(8, 1e4, {"rope_type": "ntk"}), ValueError, "rope_type 'ntk' is not supported"),
        (lambda: nn.apply_rope(rnd(1, 3, 2, 4), rnd(4, 4), rnd(4, 4)), ValueError, "apply_rope: x must be [B, S, H, hd]"),
        (lambda: nn.attention(rnd(1, 3, 3, 4), rnd(1, 3, 2, 4), rnd(1, 3, 2, 4)), ValueError, "q has 3 heads, not a multiple of the 2 k/v heads"),
        (lambda: nn.attention(rnd(1, 3, 4, 4), rnd(1, 3, 1, 4), rnd(1, 3, 1, 4), num_kv_groups=2), ValueError, "num_kv_groups=2"),
        (lambda: nn.attention(rnd(1, 3, 2, 4), rnd(1, 3, 2, 4), rnd(1, 3, 2, 4), window=0), ValueError, "window must be None or an int >= 1, got 0"),
        (lambda: nn.attention(rnd(1, 3, 2, 4), rnd(1, 3, 2, 4), rnd(1, 3, 2, 4), sinks=rnd(4)), ValueError, "sinks has 4 local entries but q has 2 heads"),
        (lambda: nn.swiglu(rnd(2, 3), rnd(2, 4)), ValueError, "gate (2, 3) and up (2, 4)"),
        (lambda: nn.cross_entropy(rnd(2, 5), torch.tensor([0, 1, 2])), ValueError, "logits (2, 5) must be targets (3,) + [V]"),
        (lambda: nn.cross_entropy(rnd(2, 5), torch.tensor([0, 5])), ValueError, "targets must lie in [0, 5) or equal ignore_index=-100"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc) as info:
            call()
        assert msg in str(info.value), (msg, str(info.value))


def test_rope_tables_are_one_operator_in_a_compiled_forward():
    """The fast path of the compiled step (RESULTS.md, issue 33): the rotary tables are one
    ``fmoe::rope_tables`` call per forward, so Inductor reads them as buffers instead of inlining
    cos / sin into every layer's q and k kernels; no cos or sin op is left in the traced graphs."""
    from fmoe.models import qwen3_moe

    cfg = qwen3_moe.Config.tiny()
    params, graphs = qwen3_moe.init(cfg), []

    def record(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda p, t: qwen3_moe.forward(p, t, cfg), backend=record)(params, torch.zeros(2, 5, dtype=torch.long))
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op in ("call_function", "call_method")]
    assert sum("rope_tables" in t for t in targets) == 1, targets
    assert not [t for t in targets if t.rsplit(".", 1)[-1] in ("cos", "sin") or t in ("cos", "sin")], targets
    torch._dynamo.reset()
