"""The public model kit (``fmoe.model``) the models share: one shape table per model
feeds both ``init`` and the checkpoint name map, the config checks come from the field
annotations, and the fused in-memory expert layout is read where a checkpoint holds it."""

import dataclasses
import typing

import pytest
import torch

import fmoe
from fmoe import model as kit
from fmoe.models import deepseek_v3, gpt_oss, llama, mixtral, olmoe, qwen3_moe

CONFIGS = [
    (qwen3_moe, qwen3_moe.Config.tiny()),
    (qwen3_moe, qwen3_moe.Config.tiny(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,),
                                      tie_word_embeddings=True)),
    (mixtral, mixtral.Config.tiny()),
    (gpt_oss, gpt_oss.Config.tiny()),
    (gpt_oss, gpt_oss.Config.tiny(attention_bias=False, tie_word_embeddings=True)),
    (llama, llama.Config.tiny()),
    (llama, dataclasses.replace(llama.Config.tiny(), attention_bias=True, mlp_bias=True)),
    (deepseek_v3, deepseek_v3.Config.tiny()),
    (deepseek_v3, deepseek_v3.Config.tiny(q_lora_rank=None, first_k_dense_replace=0)),
]
ids = [f"{m.__name__.rpartition('.')[2]}-{i}" for i, (m, _) in enumerate(CONFIGS)]


@pytest.mark.parametrize("model,cfg", CONFIGS, ids=ids)
def test_one_shape_table_feeds_init_and_the_name_map(model, cfg):
    shapes = model.shapes(cfg)
    assert {p: tuple(s.shape) for p, s in model.hf_specs(cfg).items()} == shapes
    params = fmoe.tree.flatten(model.init(cfg, seed=1))
    assert {p: tuple(t.shape) for p, t in params.items()} == shapes
    keys = [k.name for s in model.hf_specs(cfg).values() for k in s.leaves()]
    assert len(keys) == len(set(keys))                                   # no checkpoint key read twice
    assert all(bool((t == 1).all()) for p, t in params.items() if p.endswith("norm"))


@pytest.mark.parametrize("model", [qwen3_moe, mixtral, deepseek_v3])
def test_fused_expert_keys_are_read_where_the_checkpoint_holds_them(model):
    cfg = model.Config.tiny()
    moe = [i for i in range(cfg.num_hidden_layers) if f"layers.{i}.moe.w_down" in model.shapes(cfg)]
    fused = [f"model.layers.{moe[0]}.mlp.experts.gate_up_proj"]           # one layer fused, the others per expert
    specs = model.hf_specs(cfg, fused)
    first, rest = f"layers.{moe[0]}.moe.", f"layers.{moe[1]}.moe."
    assert [k.name for k in specs[first + "w_gate_up"].leaves()] == fused
    assert [k.name for k in specs[first + "w_down"].leaves()] == [f"model.layers.{moe[0]}.mlp.experts.down_proj"]
    assert len(specs[rest + "w_gate_up"].leaves()) == 2 * cfg.num_experts
    assert specs[first + "w_gate_up"].shape == specs[rest + "w_gate_up"].shape
    router = specs[first + "router"].leaves()[0].name                   # mixtral's router moves with the layout
    assert router == f"model.layers.{moe[0]}.mlp.gate.weight"


@pytest.mark.parametrize("model", [qwen3_moe, mixtral, gpt_oss, llama, deepseek_v3, olmoe])
def test_config_checks_follow_the_field_annotations(model):
    tiny = model.Config.tiny()
    hints = typing.get_type_hints(model.Config)
    for f in dataclasses.fields(tiny):
        if hints[f.name] is int:
            low = 0 if f.name == "first_k_dense_replace" else 1
            for bad in (low - 1, True, 2.0):
                with pytest.raises(ValueError, match=f"{f.name} must be an int >= {low}, got {bad!r}"):
                    dataclasses.replace(tiny, **{f.name: bad})
        elif hints[f.name] == typing.Optional[int]:
            low = 0 if f.name == "pad_token_id" else 1      # a token id may be 0
            with pytest.raises(ValueError, match=f"{f.name} must be None or an int >= {low}, got {low - 1}"):
                dataclasses.replace(tiny, **{f.name: low - 1})
        elif hints[f.name] is tuple:
            with pytest.raises(TypeError, match=f"{f.name} must be a tuple, got \\[\\]"):
                dataclasses.replace(tiny, **{f.name: []})


@pytest.mark.parametrize("model", [qwen3_moe, mixtral, gpt_oss, llama, deepseek_v3, olmoe])
def test_pad_token_id_is_a_token_id_and_read_and_written_through_config_json(model):
    cfg = model.Config.tiny(pad_token_id=0)
    assert cfg.to_hf()["pad_token_id"] == 0 and model.Config.from_hf(cfg.to_hf()) == cfg
    assert model.Config.from_hf(model.Config.tiny().to_hf()).pad_token_id == model.Config.pad_token_id  # None; OLMoE 1
    with pytest.raises(ValueError, match=f"pad_token_id={cfg.vocab_size} must be None or a token id below"):
        model.Config.tiny(pad_token_id=cfg.vocab_size)


def test_the_router_loss_switch_adds_the_weighted_loss_to_every_moe_layer():
    cfg = mixtral.Config.tiny(output_router_logits=True, router_aux_loss_coef=0.5)
    params, tokens = mixtral.init(cfg), torch.randint(0, cfg.vocab_size, (2, 6))
    _, aux = mixtral.forward(params, tokens, cfg, return_aux=True)
    _, off = mixtral.forward(params, tokens, dataclasses.replace(cfg, output_router_logits=False), return_aux=True)
    assert all("load_balance_loss" in a for a in aux["moe"]) and not any("load_balance_loss" in a for a in off["moe"])
    half = mixtral.forward(params, tokens, dataclasses.replace(cfg, router_aux_loss_coef=0.25), return_aux=True)[1]
    for a, b in zip(aux["moe"], half["moe"]):
        torch.testing.assert_close(a["load_balance_loss"], 2 * b["load_balance_loss"])
    router = fmoe.routing.topk(2)
    assert kit.with_aux_loss(router, mixtral.Config.tiny()) is router          # switch off: the router itself


def test_remat_policies_leave_logits_and_gradients_unchanged():
    cfg = qwen3_moe.Config.tiny(initializer_range=0.2)
    params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), qwen3_moe.init(cfg))
    tokens = torch.randint(0, cfg.vocab_size, (2, 5))
    runs = {}
    for policy in fmoe.nn.remat.POLICIES:
        with fmoe.nn.remat.policy(policy):
            loss = qwen3_moe.forward(params, tokens, cfg).logsumexp(-1).mean()
            runs[policy] = (loss.detach(), torch.autograd.grad(loss, list(fmoe.tree.flatten(params).values())))
    for policy in ("layer", "moe"):
        assert torch.equal(runs[policy][0], runs["none"][0])
        for a, b in zip(runs[policy][1], runs["none"][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
