"""Interop with a real tiny transformers Qwen3-MoE: specs rebuild its fused expert tensors, and
transformers loads what save_hf writes.

transformers 5.24 keeps the experts fused in memory (``mlp.experts.gate_up_proj [E, 2I, D]``,
gate rows first, ``mlp.experts.down_proj [E, D, I]``) but ``save_pretrained`` writes per-expert
keys (``mlp.experts.{e}.gate_proj.weight``); the specs below map one to the other.
"""

import os

import pytest
import torch
from safetensors import safe_open

import fmoe
from fmoe.checkpoint import Cat, Checkpoint, Key, Stack, load_hf, save_hf

transformers = pytest.importorskip("transformers")


class QwenConfig:
    """config.json passed through unchanged (the test needs no parsed fields beyond the sizes)."""

    def __init__(self, d):
        self.d = dict(d)

    @classmethod
    def from_hf(cls, d):
        return cls(d)

    def to_hf(self):
        return dict(self.d)


def qwen_specs(cfg, keys=None):
    """fmoe paths = the transformers in-memory parameter names."""
    c = cfg.d
    V, D, I = c["vocab_size"], c["hidden_size"], c["moe_intermediate_size"]
    E = c["num_local_experts"]             # transformers 5.24 writes num_experts under this name
    H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    specs = {"model.embed_tokens.weight": Key("model.embed_tokens.weight", (V, D)),
             "model.norm.weight": Key("model.norm.weight", (D,)), "lm_head.weight": Key("lm_head.weight", (V, D))}
    for i in range(c["num_hidden_layers"]):
        L = f"model.layers.{i}"
        for name, shape in ((f"{L}.self_attn.q_proj.weight", (H * hd, D)), (f"{L}.self_attn.k_proj.weight", (KV * hd, D)),
                            (f"{L}.self_attn.v_proj.weight", (KV * hd, D)), (f"{L}.self_attn.o_proj.weight", (D, H * hd)),
                            (f"{L}.self_attn.q_norm.weight", (hd,)), (f"{L}.self_attn.k_norm.weight", (hd,)),
                            (f"{L}.input_layernorm.weight", (D,)), (f"{L}.post_attention_layernorm.weight", (D,)),
                            (f"{L}.mlp.gate.weight", (E, D))):
            specs[name] = Key(name, shape)
        ex = lambda n, s: Stack([Key(f"{L}.mlp.experts.{e}.{n}.weight", s) for e in range(E)])  # noqa: E731
        specs[f"{L}.mlp.experts.gate_up_proj"] = Cat([ex("gate_proj", (I, D)), ex("up_proj", (I, D))], dim=1)
        specs[f"{L}.mlp.experts.down_proj"] = ex("down_proj", (D, I))
    return specs


qwen = type("qwen_like", (), {"Config": QwenConfig, "hf_specs": staticmethod(qwen_specs)})


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    d = str(tmp_path_factory.mktemp("qwen3moe"))
    model.save_pretrained(d)
    return model, d


def test_specs_rebuild_transformers_fused_experts_and_save_round_trips(hf_model_dir, tmp_path):
    model, d = hf_model_dir
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 16, 16)     # fused in memory
    with Checkpoint(d) as ck:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in ck                     # per-expert on disk
        params, cfg = load_hf(qwen, ck)
    flat = fmoe.tree.flatten(params)
    assert sorted(flat) == sorted(state)
    for k, v in state.items():
        assert torch.equal(flat[k], v), k

    out = str(tmp_path / "fmoe_saved")
    save_hf(qwen, params, cfg, out)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(out, "model.safetensors"), "pt") as b:      # same keys and shapes as save_pretrained
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(a.get_slice(k).get_shape() == b.get_slice(k).get_shape() for k in a.keys())
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(out).eval()
    back_state = back.state_dict()
    assert sorted(back_state) == sorted(state)
    for k, v in state.items():
        assert torch.equal(back_state[k], v), k
    tokens = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, model(tokens).logits)


def test_gpt_oss_interleaved_gate_up_maps_to_fmoe_layout(tmp_path):
    """gpt-oss: HF ``gate_up_proj [E, D, 2I]`` (x @ W, gate = [..., ::2], up = [..., 1::2]) and bias
    ``[E, 2I]`` read as fmoe ``w_gate_up [E, 2I, D]`` (gate rows first) give the same gate and up."""
    from fmoe.checkpoint import Deinterleave, Transpose

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(cfg)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj_bias.normal_()          # initialised to zero: make the bias layout visible
    model.save_pretrained(str(tmp_path))
    E, D, I, key = 4, 16, 8, "model.layers.0.mlp.experts.gate_up_proj"
    with Checkpoint(str(tmp_path)) as ck:
        w = Transpose(Deinterleave(Key(key, (E, D, 2 * I)), dim=2), 1, 2).bind(ck).read()
        b = Deinterleave(Key(key + "_bias", (E, 2 * I)), dim=1).bind(ck).read()
    x = torch.randn(3, D)
    for e in range(E):
        hf = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]          # transformers' expert
        gate, up = (x @ w[e].T + b[e]).chunk(2, dim=-1)                          # fmoe's fused layout
        # same products and sums; a matmul over a transposed weight may pick another summation order
        torch.testing.assert_close(gate, hf[..., ::2].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(up, hf[..., 1::2].detach(), rtol=1e-5, atol=1e-6)
