"""float64 stays float64, and ``torch.autograd.gradcheck`` passes in float64 (one process) on
``fmoe.moe`` with every router family, ``nn.attention`` (fused, masked and sink paths), the norms,
the loss and a whole tiny model of each of the five families.

The precision rule is "at least float32" (:mod:`fmoe.precision`): a float64 input is computed in
float64, so central differences at ``eps=1e-6`` agree with the analytic gradient to ~1e-9.
Routing decisions are piecewise constant: the tiny inputs below keep every logit gap far above
``eps`` (random normal logits), so no finite-difference step crosses a decision.
"""

import pytest
import torch
from torch.autograd import gradcheck

import fmoe
import fmoe.nn as nn
from fmoe.models import deepseek_v3, gpt_oss, llama, mixtral, qwen3_moe

F64 = torch.float64
ROUTERS = {
    "topk": lambda: fmoe.routing.topk(2),
    "topk_unnormalized": lambda: fmoe.routing.topk(2, normalize=False),
    "topk_softmax": lambda: fmoe.routing.topk_softmax(2),
    "sigmoid_topk": lambda: fmoe.routing.sigmoid_topk(2),
    "group_topk": lambda: fmoe.routing.group_topk(2, num_groups=2, topk_groups=1),
    "switch": lambda: fmoe.routing.switch(capacity_factor=2.0),
    "expert_choice": lambda: fmoe.routing.expert_choice(capacity_factor=1.0),
    "hash": lambda: fmoe.routing.hash_router(2, gate=True),
    "balanced": lambda: fmoe.routing.balanced(2),
    "with_losses": lambda: fmoe.routing.with_losses(fmoe.routing.topk(2), load_balance=0.1, z=0.01),
}
MODELS = [qwen3_moe, mixtral, gpt_oss, llama, deepseek_v3]


def moe_inputs(e=4, d=6, i=3, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = {"router": torch.randn(e, d, generator=g, dtype=F64),
         "w_gate_up": torch.randn(e, 2 * i, d, generator=g, dtype=F64) / d ** 0.5,
         "w_down": torch.randn(e, d, i, generator=g, dtype=F64) / i ** 0.5}
    return p, torch.randn(t, d, generator=g, dtype=F64)


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_moe_gradcheck_float64_every_router(name):
    p, x = moe_inputs()
    router = ROUTERS[name]()
    keys = sorted(p)

    def f(x, *leaves):
        inputs = {"token_ids": torch.arange(x.shape[0])} if name == "hash" else None
        y, aux = fmoe.moe(dict(zip(keys, leaves)), x, router=router, router_inputs=inputs)
        return y if "loss" not in aux else (y, aux["loss"])

    out = f(x, *[p[k] for k in keys])
    for o in (out if isinstance(out, tuple) else (out,)):
        assert o.dtype == F64, (name, o.dtype)
    inputs = [t.clone().requires_grad_() for t in (x, *[p[k] for k in keys])]
    assert gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("kind", ["fused_causal", "window_masked", "sinks", "gqa_noncausal"])
def test_attention_gradcheck_float64(kind):
    g = torch.Generator().manual_seed(1)
    hq, hkv = (4, 2) if kind == "gqa_noncausal" else (2, 2)
    q = torch.randn(1, 4, hq, 3, generator=g, dtype=F64)
    k = torch.randn(1, 4, hkv, 3, generator=g, dtype=F64)
    v = torch.randn(1, 4, hkv, 3, generator=g, dtype=F64)
    kw = {"fused_causal": {}, "window_masked": {"window": 2}, "gqa_noncausal": {"causal": False},
          "sinks": {"sinks": torch.randn(hq, generator=g, dtype=F64)}}[kind]
    assert nn.attention(q, k, v, **kw).dtype == F64
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    assert gradcheck(lambda q, k, v: nn.attention(q, k, v, **kw), inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_norms_and_loss_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 8, generator=g, dtype=F64), torch.randn(8, generator=g, dtype=F64)
    hw = torch.randn(4, generator=g, dtype=F64)
    xh = x.reshape(3, 2, 4)                                                       # [T, H, hd]
    assert nn.rms_norm(x, w).dtype == F64 and nn.head_rms_norm(xh, hw, 1e-6, 2).dtype == F64
    assert gradcheck(lambda x, w: nn.rms_norm(x, w), [x.clone().requires_grad_(), w.clone().requires_grad_()])
    assert gradcheck(lambda x, w: nn.head_rms_norm(x, w, 1e-6, 2), [xh.clone().requires_grad_(), hw.clone().requires_grad_()])
    targets = torch.tensor([1, 5, 7])
    assert nn.cross_entropy(x, targets).dtype == F64
    assert gradcheck(lambda x: nn.cross_entropy(x, targets), [x.clone().requires_grad_()])


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__.split(".")[-1])
def test_whole_tiny_model_gradcheck_float64(model):
    """Every leaf at once, by gradcheck's fast mode (a random projection of the Jacobian:
    ``u^T J v`` by central differences against the analytic one)."""
    cfg = model.Config.tiny()
    params = fmoe.tree.map_with_path(lambda _, t: t.double(), model.init(cfg, seed=0))
    tokens = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    paths = fmoe.tree.paths(params)
    flat = fmoe.tree.flatten(params)

    def loss(*leaves):
        p = fmoe.tree.unflatten(dict(zip(paths, leaves)), like=params)
        return nn.cross_entropy(model.forward(p, tokens, cfg)[:, :-1], tokens[:, 1:])

    leaves = [flat[k].clone().requires_grad_() for k in paths]
    assert model.forward(params, tokens, cfg).dtype == F64 and loss(*leaves).dtype == F64
    assert gradcheck(loss, leaves, fast_mode=True, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_still_computes_in_float32(dtype):
    """The rule is "at least float32": bf16 / fp16 norms, losses and routers compute in fp32."""
    x = torch.randn(3, 8).to(dtype)
    ref = nn.rms_norm(x.float(), torch.ones(8)).to(dtype)
    assert torch.equal(nn.rms_norm(x, torch.ones(8, dtype=dtype)), ref)
    assert nn.cross_entropy(x, torch.tensor([0, 1, 2])).dtype == torch.float32
    w = fmoe.routing.topk(2)(x).weights
    assert w.dtype == torch.float32


def test_rope_chunked_loss_biased_routers_and_replay_stay_float64():
    """The places that once computed in float32 whatever came in: rope tables (a float32 cos
    differs from float64 by ~1e-7, which made compiled and eager float64 gradients disagree at
    that level), the chunked loss, the biased routers and replay."""
    from fmoe.routing.balance import biased_topk, biased_topk_softmax
    from fmoe.routing.record import replay
    inv_freq, _ = nn.rope_frequencies(8, 10000.0)
    pos = torch.arange(50)
    cos, sin = nn.rope_cos_sin(pos, inv_freq, dtype=F64)
    angles = pos[:, None].double() * inv_freq.double()
    want = torch.cat((angles, angles), dim=-1)
    assert cos.dtype == F64 and (cos - want.cos()).abs().max() < 1e-14 and (sin - want.sin()).abs().max() < 1e-14
    c32, _ = nn.rope_cos_sin(pos, inv_freq)                    # fp32 tables keep transformers' arithmetic
    assert c32.dtype == torch.float32 and torch.equal(c32, (pos[:, None].float() * inv_freq).repeat(1, 2).cos())
    g = torch.Generator().manual_seed(4)
    logits, targets = torch.randn(6, 11, generator=g, dtype=F64), torch.randint(0, 11, (6,), generator=g)
    from fmoe.nn.chunked_loss import chunked_cross_entropy
    loss = chunked_cross_entropy(logits, targets, 3)
    assert loss.dtype == F64 and abs(loss.item() - nn.cross_entropy(logits, targets).item()) < 1e-14
    x, bias = torch.randn(5, 4, generator=g, dtype=F64), torch.tensor([0.0, 0.5, 0.0, 0.0])
    for router in (biased_topk(2), biased_topk_softmax(2)):
        assert router(x, expert_bias=bias).weights.dtype == F64 and router(x).weights.dtype == F64
    ids = torch.topk(x, 2, dim=-1).indices
    assert replay([ids])(x).weights.dtype == F64
