"""The MoE model modules' contract, single process: configs, presets, plans and their errors."""

import json
import os
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

import fmoe
from fmoe.models import gpt_oss, mixtral, qwen3_moe

MODELS = [qwen3_moe, mixtral, gpt_oss]
ids = [m.__name__.rsplit(".", 1)[-1] for m in MODELS]


@pytest.mark.parametrize("model", MODELS, ids=ids)
def test_presets_round_trip_through_the_hf_config_and_fit_tp4_ep8(model):
    for cfg in (model.Config.tiny(), model.Config.small(), model.Config.tiny(num_key_value_heads=8), model.Config()):
        assert model.Config.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg
    tiny = model.Config.tiny()
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.num_experts) == (64, 8, 8)
    model.check_plan(tiny, tp=4)
    model.check_plan(model.Config.tiny(num_key_value_heads=8), tp=8)
    assert tiny.num_experts % 8 == 0
    params = model.init(tiny, seed=3)
    assert sorted(fmoe.tree.flatten(params)) == sorted(model.hf_specs(tiny))
    assert all(torch.equal(a, b) for a, b in zip(fmoe.tree.leaves(params), fmoe.tree.leaves(model.init(tiny, 3))))
    tokens = torch.randint(0, tiny.vocab_size, (2, 6))
    logits, aux = model.forward(params, tokens, tiny, return_aux=True)
    assert logits.shape == (2, 6, tiny.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(model.forward(params, tokens, tiny), logits)
    assert len(aux["moe"]) == tiny.num_hidden_layers
    assert [int(a["tokens_per_expert"].sum()) for a in aux["moe"]] == [12 * tiny.num_experts_per_tok] * 2


@pytest.mark.parametrize("model", MODELS, ids=ids)
def test_bad_configs_and_inputs_raise_naming_the_field(model):
    tiny = model.Config.tiny()
    with pytest.raises(ValueError, match="num_attention_heads=6 must be a multiple of num_key_value_heads=4"):
        replace(tiny, num_attention_heads=6)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds"):
        replace(tiny, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="hidden_size must be an int >= 1, got 0"):
        replace(tiny, hidden_size=0)
    with pytest.raises(ValueError, match="model_type must be"):
        model.Config.from_hf({**tiny.to_hf(), "model_type": "llama"})
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        model.Config.from_hf({**tiny.to_hf(), "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="tokens must be a"):
        model.forward(model.init(tiny), torch.zeros(5, dtype=torch.long), tiny)


@pytest.mark.parametrize("model", MODELS, ids=ids)
def test_plans_check_heads_and_user_rules(model):
    tiny = model.Config.tiny()
    with pytest.raises(ValueError, match="tp=8 does not divide num_key_value_heads=4"):
        model.check_plan(tiny, tp=8)
    heads = replace(tiny, num_attention_heads=12, num_key_value_heads=12)   # wq rows 96 divide by 8, heads do not
    biased = model is gpt_oss
    kv_replicated = {"layers.*.attn.w[kv]": "replicate", **({"layers.*.attn.b[kv]": "replicate"} if biased else {})}
    with pytest.raises(ValueError, match="tp=8 does not divide num_attention_heads=12"):
        model.check_plan(heads, kv_replicated, tp=8)
    replicated = {"layers.*.attn.w[qkv]": "replicate", "layers.*.attn.wo": "replicate",
                  **({"layers.*.attn.[wb][qkv]": "replicate", "layers.*.attn.sinks": "replicate"} if biased else {})}
    model.check_plan(heads, replicated, tp=8)                               # heads not split: any tp
    with pytest.raises(ValueError, match="matches no parameter"):
        model.check_plan(tiny, {"layers.*.attn.w_nope": "colwise"})
    with pytest.raises(ValueError, match="unknown sharding style 'columnwise'"):
        model.check_plan(tiny, {"layers.*.attn.wq": "columnwise"})
    pl = model.check_plan(tiny, {"layers.0.attn.wq": "colwise_gather"})
    assert pl.match("layers.0.attn.wq") == ("layers.0.attn.wq", "colwise_gather")
    assert pl.match("layers.1.attn.wq")[1] == "colwise"
    assert pl.match("layers.1.moe.w_down")[1] == "expert" and pl.match("layers.1.moe.router")[1] == "replicate"


def test_qwen3_dense_layers_and_their_packed_plan():
    cfg = qwen3_moe.Config.tiny(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [cfg.is_sparse(i) for i in range(4)] == [False, True, False, False]
    params = qwen3_moe.init(cfg)
    assert "mlp" in params["layers"][0] and "moe" in params["layers"][1] and "mlp" in params["layers"][3]
    assert params["layers"][0]["mlp"]["w_gate_up"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    _, aux = qwen3_moe.forward(params, torch.zeros(1, 3, dtype=torch.long), cfg, return_aux=True)
    assert len(aux["moe"]) == 1
    with pytest.raises(ValueError, match="must be split per half"):
        qwen3_moe.check_plan(cfg, {"layers.*.mlp.w_gate_up": "colwise"}, tp=2)
    with pytest.raises(ValueError, match="tp=8 does not divide intermediate_size=36"):
        qwen3_moe.check_plan(replace(cfg, num_key_value_heads=8, intermediate_size=36), tp=8)  # each half: 36 rows


def test_gpt_oss_layer_types_and_rope_defaults():
    cfg = gpt_oss.Config.tiny(num_hidden_layers=3)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    with pytest.raises(ValueError, match="layer_types must list one of"):
        gpt_oss.Config.tiny(layer_types=("full_attention",))
    hf = {k: v for k, v in cfg.to_hf().items() if k not in ("rope_parameters", "layer_types")}
    assert gpt_oss.Config.from_hf(hf) == cfg                               # missing rope: gpt-oss's YaRN
    plain = gpt_oss.Config.from_hf({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling == () and plain.rope_theta == 1e4


def test_load_hf_checks_the_plan_first_ignores_inv_freq_and_names_missing_keys(tmp_path):
    cfg = mixtral.Config.tiny()
    mixtral.save_hf(mixtral.init(cfg), cfg, tmp_path / "ok")
    with pytest.raises(ValueError, match="matches no parameter"):
        mixtral.load_hf(tmp_path / "ok", mesh=fmoe.Mesh(), plan={"layers.*.nope": "colwise"})
    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)   # old checkpoints carry it
    save_file(tensors, tmp_path / "ok" / "model.safetensors")
    params, _ = mixtral.load_hf(tmp_path / "ok")
    assert torch.equal(params["layers"][1]["moe"]["w_down"], mixtral.init(cfg)["layers"][1]["moe"]["w_down"])
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    os.makedirs(tmp_path / "bad")
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    (tmp_path / "bad" / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(ValueError, match="model.layers.1.block_sparse_moe.experts.5.w3.weight"):
        mixtral.load_hf(tmp_path / "bad")


def test_the_aux_loss_switch_is_declared_not_probed():
    """The trainer turns a model's router load-balance loss on through ``Model.with_aux_loss``
    (the fields each model declares), and leaves models without such a switch unchanged."""
    from fmoe.model import model_of
    from fmoe.models import deepseek_v3, gpt_oss, llama, mixtral, qwen3_moe

    for module in (qwen3_moe, mixtral, gpt_oss):
        cfg = module.Config.tiny()
        on = model_of(module).with_aux_loss(cfg, 0.02)
        assert on.output_router_logits is True and on.router_aux_loss_coef == 0.02
        assert model_of(module).with_aux_loss(on, 0.0).output_router_logits is False
    for module in (llama, deepseek_v3):
        cfg = module.Config.tiny()
        assert model_of(module).with_aux_loss(cfg, 0.02) == cfg
