"""The dense llama model: parity with transformers, tensor/fsdp parallel parity, plan checks."""

from dataclasses import replace

import pytest
import torch

import fmoe
import fmoe.nn as nn
from fmoe import P
from fmoe.models import llama
from helpers import close, on_ranks

LLAMA3 = tuple(sorted({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}.items()))
BIASED_TIED = replace(llama.Config.tiny(), attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                      rope_scaling=LLAMA3)


def with_grad(params: dict) -> dict:
    return fmoe.tree.map_with_path(lambda _, t: t.detach().clone().requires_grad_(), params)


def from_hf_state(state: dict, cfg: llama.Config) -> dict:
    """fmoe params from a transformers state_dict, by the documented hf_names fusion rule."""
    return fmoe.tree.unflatten({path: torch.cat([state[k] for k in keys], 0)
                                for path, keys in llama.hf_names(cfg).items()})


def loss_and_grads(params: dict, tokens: torch.Tensor, cfg: llama.Config):
    logits = llama.forward(params, tokens, cfg)
    nn.cross_entropy(logits[:, :-1], tokens[:, 1:]).backward()
    return logits.detach(), fmoe.tree.flatten(fmoe.tree.map_with_path(lambda _, t: t.grad, params))


@pytest.mark.parametrize("cfg", [llama.Config.tiny(), BIASED_TIED], ids=["tiny", "bias-tied-llama3rope"])
def test_matches_transformers_logits_and_every_gradient(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**cfg.to_hf(), attn_implementation="eager")).float()
    with torch.no_grad():
        for p in hf.parameters():  # larger than the init, and non-zero biases / norms
            p.normal_(0, 0.2)
    params = with_grad(from_hf_state(hf.state_dict(), cfg))
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    ref = hf(tokens).logits
    nn.cross_entropy(ref[:, :-1], tokens[:, 1:]).backward()
    logits, grads = loss_and_grads(params, tokens, cfg)
    close(logits, ref.detach(), "logits")
    close(nn.cross_entropy(logits[:, :-1], tokens[:, 1:]), hf(tokens, labels=tokens).loss.detach(), "loss")
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    for path, keys in llama.hf_names(cfg).items():
        close(grads[path], torch.cat([hf_grads[k] for k in keys], 0), f"grad {path}")


def test_hf_names_cover_the_state_dict_and_config_round_trips():
    from transformers import LlamaConfig, LlamaForCausalLM

    for cfg in (llama.Config.tiny(), BIASED_TIED):
        hf = LlamaForCausalLM(LlamaConfig(**cfg.to_hf()))
        keys = [k for keys in llama.hf_names(cfg).values() for k in keys]
        state = set(hf.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
        assert sorted(keys) == sorted(state)
        assert llama.Config.from_hf(hf.config.to_dict()) == cfg
        assert fmoe.tree.paths(llama.init(cfg)) == sorted(llama.hf_names(cfg), key=fmoe.tree.paths(llama.init(cfg)).index)
    old_style = {**llama.Config.tiny().to_hf(), "rope_theta": 500000.0, "rope_parameters": None,
                 "rope_scaling": dict(LLAMA3)}
    assert llama.Config.from_hf(old_style) == replace(llama.Config.tiny(), rope_theta=500000.0, rope_scaling=LLAMA3)
    assert torch.equal(llama.init(llama.Config.tiny(), 3)["embed"], llama.init(llama.Config.tiny(), 3)["embed"])


def test_config_and_plan_validation_name_the_field():
    with pytest.raises(ValueError, match="num_attention_heads=6 must be a multiple of num_key_value_heads=4"):
        replace(llama.Config.tiny(), num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        llama.Config.from_hf({**llama.Config.tiny().to_hf(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        replace(llama.Config.tiny(), rope_scaling=(("factor", 2.0), ("rope_type", "dynamic")))
    heads = replace(llama.Config.tiny(), num_attention_heads=6, num_key_value_heads=6, head_dim=8)  # wq 48 rows
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_attention_heads=6 \(layers.0.attn.w[qo].*num_key_value_heads=6"):
        llama.check_plan(heads, tp=4)
    with pytest.raises(ValueError, match="tp=4 does not divide num_key_value_heads=2"):
        llama.check_plan(llama.Config.tiny(), tp=4)
    # each packed half must divide: 2I = 72 divides by tp=8, but each half I = 36 does not
    ffn = replace(llama.Config.tiny(), intermediate_size=36, num_attention_heads=8, num_key_value_heads=8)
    down_replicated = llama.plan(ffn).override({"layers.*.mlp.w_down": "replicate"})
    with pytest.raises(ValueError, match=r"tp=8 does not divide intermediate_size=36 \(layers.0.mlp.w_gate_up"):
        llama.check_plan(ffn, down_replicated, tp=8)
    unpacked = llama.plan(llama.Config.tiny()).override({"layers.*.mlp.w_gate_up": "colwise"})
    with pytest.raises(ValueError, match="must be split per half"):
        llama.check_plan(llama.Config.tiny(), unpacked, tp=2)
    llama.check_plan(llama.Config.tiny(), tp=2)  # the default plan fits tp=2
    replicated = llama.plan(llama.Config.tiny()).override({"layers.*.attn.w[qkvo]": "replicate"})
    with pytest.warns(UserWarning, match="matches no parameter"):  # the default attention rules are unused
        llama.check_plan(llama.Config.tiny(), replicated, tp=4)  # heads not split: any tp is fine for them
    with pytest.raises(ValueError, match="tokens must be a"):
        llama.forward(llama.init(llama.Config.tiny()), torch.zeros(5, dtype=torch.long), llama.Config.tiny())


# ---------------------------------------------------------------- distributed
CFG = llama.Config.tiny()
# A user override: layer 0's attention replicated, the fused gate/up gathered to full width (so
# the rowwise down projection slices its own part of a replicated input), lm_head plain colwise.
OVERRIDE = {"layers.0.attn.w*": "replicate", "layers.*.mlp.w_gate_up": P("tp", None, packed=2, gather=True),
            "lm_head": "colwise"}
# FSDP on top of TP: every non-packed weight also splits its other dim over fsdp.
FSDP = {"embed": P("tp", "fsdp"), "layers.*.attn.w[qkv]": P("tp", "fsdp"), "layers.*.attn.wo": P("fsdp", "tp"),
        "layers.*.mlp.w_down": P("fsdp", "tp"), "lm_head": P("tp", "fsdp", gather=True),
        "layers.*.attn_norm": P("fsdp"), "layers.*.mlp_norm": P("fsdp"), "norm": P("fsdp")}


def batches() -> list:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CFG.vocab_size, (2, 8), generator=g) for _ in range(2)]


def _ranks(rank, world, plans):
    mesh = fmoe.Mesh(tp=2, ep=2)  # fsdp = world / 2; each TP pair gets batch mesh.batch_index
    out = []
    for rules in plans:
        sharded = llama.shard(with_grad(llama.init(CFG, seed=0)), CFG, mesh, plan=rules)
        tokens = batches()[mesh.batch_index]
        logits = llama.forward(sharded, tokens, CFG, mesh)
        nn.cross_entropy(logits[:, :-1], tokens[:, 1:]).backward()
        grads = fmoe.tree.flatten(fmoe.gather(fmoe.tree.map_with_path(lambda _, t: t.grad, sharded)))
        placed = {k: fmoe.placement_of(t) for k, t in fmoe.tree.flatten(sharded).items()}
        out.append((mesh.batch_index, logits.detach(), grads, placed))
    return out


def check_against_single_process(results) -> None:
    ref = [loss_and_grads(with_grad(llama.init(CFG, seed=0)), b, CFG) for b in batches()]
    used = sorted({batch for per_plan in results for batch, *_ in per_plan})   # distinct batches of the run
    for rank, per_plan in enumerate(results):
        for batch, logits, grads, placed in per_plan:
            close(logits, ref[batch][0], f"rank {rank} logits")
            for path, g in grads.items():
                # Honest gradient placements: a leaf is Partial over every data axis whose batches
                # are not summed yet, so the gathered gradient of EVERY leaf (fsdp-split or
                # replicated) is the gradient of the sum of the distinct batches' losses.
                want = sum(ref[b][1][path] for b in used)
                close(g, want, f"rank {rank} grad {path} ({placed[path]})")


def test_tp2_default_plan_and_user_override_match_single_process():
    results = on_ranks(_ranks, 2, [None, OVERRIDE], timeout=180)
    check_against_single_process(results)
    placed = results[0][1][3]
    assert placed["layers.0.attn.wq"] == P() and placed["layers.1.attn.wq"] == P("tp", None)
    assert placed["layers.1.mlp.w_gate_up"] == P("tp", None, packed=2, gather=True)
    assert results[0][0][3]["embed"] == P("tp", None)


def test_tp2_fsdp2_matches_sum_of_single_process_gradients():
    results = on_ranks(_ranks, 4, [FSDP], timeout=180)
    assert [r[0][0] for r in results] == [0, 0, 1, 1]
    check_against_single_process(results)
    assert results[0][0][3]["layers.1.attn.wo"] == P("fsdp", "tp")
