"""Every tensor-parallel style, numerically: 4 gloo ranks (tp=4) against one process.

One spawn runs a set of small "cases" (each a function of parameters and replicated inputs that
returns a full, replicated output) with the parameters sharded by one plan that uses every style;
the single-process reference runs the same functions on the full tensors. Compared: outputs,
gradients of the inputs (on every rank), gathered gradients of every parameter.
"""

import torch
from einops import rearrange

import fmoe
import fmoe.nn as nn
from fmoe import P, Plan
from helpers import close, on_ranks

TP = 4
D, HQ, HKV, HD, I, V = 8, 8, 4, 2, 8, 16  # per rank: 2 query heads, 1 KV head, I/4 per half, V/4 rows
B, S = 2, 5


def make_params() -> dict:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731

    def attn():
        return {"wq": r(HQ * HD, D), "wk": r(HKV * HD, D), "wv": r(HKV * HD, D), "wo": r(D, HQ * HD),
                "q_norm": 1 + 0.1 * r(HD), "k_norm": 1 + 0.1 * r(HD), "sinks": r(HQ)}

    return {
        "pair": {"w1": r(12, D), "b1": r(12), "w2": r(D, 12), "b2": r(D)},
        "gath": {"w": r(12, D), "b": r(12)},
        "rowrep": {"w": r(D, 12), "b": r(D)},
        "colrep": {"w1": r(12, D), "b1": r(12), "w2": r(D, 12)},
        "mlp": {"w_gate_up": r(2 * I, D), "b_gate_up": r(2 * I), "w_down": r(D, I)},
        "packed": {"w_in": r(2 * I, D), "w_out": r(D, 2 * I)},
        "packed_rep": {"w": r(D, 2 * I)},
        "packed_gather": {"w": r(2 * I, D)},
        "embed": r(V, D), "embed_d": r(V, D),
        "attn": attn(), "attn_rep": attn(),
    }


PLAN = Plan({
    "pair.w1": "colwise", "pair.b1": "colwise", "pair.w2": "rowwise", "pair.b2": "rowwise",
    "gath.w": "colwise_gather", "gath.b": "colwise",
    "rowrep.*": "rowwise",                                   # fed a replicated full-width input
    "colrep.w1": "colwise", "colrep.b1": "replicate", "colrep.w2": "rowwise",
    "mlp.w_gate_up": "packed_colwise", "mlp.b_gate_up": "packed_colwise", "mlp.w_down": "rowwise",
    "packed.w_in": "packed_colwise", "packed.w_out": "packed_rowwise",
    "packed_rep.w": "packed_rowwise",                        # fed a replicated full [g | u] input
    "packed_gather.w": P("tp", None, packed=2, gather=True),
    "embed": "vocab", "embed_d": P(None, "tp"),
    "attn.w[qkv]": "colwise", "attn.wo": "rowwise", "attn.sinks": "local", "attn.*_norm": "replicate",
    "attn_rep.*": "replicate",                               # heads not sharded: q/k norm grads complete
})


def make_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(B, S, D, generator=g), "x12": torch.randn(B, S, 12, generator=g),
            "x2i": torch.randn(B, S, 2 * I, generator=g), "tokens": torch.randint(0, V, (B, S), generator=g)}


def _attn(a: dict, x: torch.Tensor) -> torch.Tensor:
    heads = lambda t: rearrange(t, "b s (h d) -> b s h d", d=HD)  # noqa: E731
    q = nn.head_rms_norm(heads(nn.linear(x, a["wq"])), a["q_norm"], 1e-6, num_heads=HQ)
    k = nn.head_rms_norm(heads(nn.linear(x, a["wk"])), a["k_norm"], 1e-6, num_heads=HKV)
    v = heads(nn.linear(x, a["wv"]))
    cos, sin = nn.rope_cos_sin(torch.arange(S), *nn.rope_frequencies(HD, 10000.0))
    o = nn.attention(nn.apply_rope(q, cos, sin), nn.apply_rope(k, cos, sin), v, window=3, sinks=a["sinks"],
                     num_kv_groups=HQ // HKV)
    return nn.linear(rearrange(o, "b s h d -> b s (h d)"), a["wo"])


def cases(p: dict, inp: dict) -> dict:
    """Each case returns a full output (replicated over tp)."""
    x = inp["x"]
    return {
        "pair": nn.linear(nn.linear(x, p["pair"]["w1"], p["pair"]["b1"]), p["pair"]["w2"], p["pair"]["b2"]),
        "gath": nn.linear(x, p["gath"]["w"], p["gath"]["b"]),
        "rowrep": nn.linear(inp["x12"], p["rowrep"]["w"], p["rowrep"]["b"]),
        "colrep": nn.linear(nn.linear(x, p["colrep"]["w1"], p["colrep"]["b1"]), p["colrep"]["w2"]),
        "mlp": nn.swiglu_mlp(x, p["mlp"]["w_gate_up"], p["mlp"]["w_down"], p["mlp"]["b_gate_up"]),
        "packed": nn.linear(nn.linear(x, p["packed"]["w_in"]), p["packed"]["w_out"]),
        "packed_rep": nn.linear(inp["x2i"], p["packed_rep"]["w"]),
        "packed_gather": nn.linear(x, p["packed_gather"]["w"]),
        "embed": nn.embedding(inp["tokens"], p["embed"]),
        "embed_d": nn.embedding(inp["tokens"], p["embed_d"]),
        "attn": _attn(p["attn"], x),
        "attn_rep": _attn(p["attn_rep"], x),
    }


def run(params: dict, inp: dict) -> tuple[dict, dict, dict]:
    """Outputs, input gradients and parameter gradients (gathered) of sum(out * coef)."""
    inp = {k: (v.clone().requires_grad_() if v.is_floating_point() else v) for k, v in inp.items()}
    out = cases(params, inp)
    g = torch.Generator().manual_seed(2)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for _, o in sorted(out.items()))
    loss.backward()
    dx = {k: v.grad for k, v in inp.items() if v.is_floating_point()}
    grads = fmoe.gather(fmoe.tree.map_with_path(lambda _, t: t.grad, params))
    return {k: o.detach() for k, o in out.items()}, dx, grads


def _ranks(rank, world):
    mesh = fmoe.Mesh(tp=TP, ep=TP)  # Mesh requires ep to be a multiple of tp
    full = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), make_params())
    sharded = fmoe.shard(full, PLAN, mesh)
    local = {k: tuple(fmoe.to_local(t).shape) for k, t in fmoe.tree.flatten(sharded).items()}
    try:  # a rowwise weight fed a width that is neither local nor full: ValueError, no collective
        nn.linear(torch.ones(2, 5), sharded["pair"]["w2"])
        bad = None
    except ValueError as e:
        bad = str(e)
    unpacked = fmoe.shard({"w": torch.ones(2 * I, D)}, {"w": "colwise"}, mesh)["w"]  # gate|up split as one block
    try:
        nn.swiglu_mlp(torch.ones(2, D), unpacked, sharded["mlp"]["w_down"])
    except ValueError as e:
        bad += " | " + str(e)
    return run(sharded, make_inputs()), local, bad


def test_every_tp_style_matches_single_process():
    params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), make_params())
    ref_out, ref_dx, ref_grads = run(params, make_inputs())
    results = on_ranks(_ranks, TP, timeout=180)
    for rank, ((out, dx, grads), local, bad) in enumerate(results):
        for k in ref_out:
            close(out[k], ref_out[k], f"rank {rank} output {k}")
        for k in ref_dx:
            close(dx[k], ref_dx[k], f"rank {rank} d{k}")
        for path, g in fmoe.tree.flatten(ref_grads).items():
            close(fmoe.tree.flatten(grads)[path], g, f"rank {rank} grad {path}")
        # the plan really sharded: local slices are a quarter of the split dim
        assert local["pair.w1"] == (3, D) and local["pair.w2"] == (D, 3) and local["pair.b2"] == (D,)
        assert local["mlp.w_gate_up"] == (2 * I // TP, D) and local["packed.w_out"] == (D, 2 * I // TP)
        assert local["embed"] == (V // TP, D) and local["embed_d"] == (V, D // TP)
        assert local["attn.sinks"] == (HQ // TP,) and local["attn.wk"] == (HKV * HD // TP, D)
        assert local["attn_rep.wq"] == (HQ * HD, D) and local["attn.q_norm"] == (HD,)
        assert "takes x with 3 (local slice) or 12 (full) features, got 5" in bad
        assert "must be split per half: use style 'packed_colwise'" in bad
    # the q/k norm gradient of sharded heads is a real sum over ranks, not one rank's share
    assert fmoe.tree.flatten(ref_grads)["attn.q_norm"].abs().sum() > 0
