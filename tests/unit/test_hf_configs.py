"""Every model family loads the ``config.json`` that transformers itself writes.

For each family, transformers' own config class is built with its defaults and with the
hyper-parameters of the public checkpoint (Qwen3-30B-A3B, Mixtral-8x7B-v0.1, gpt-oss-20b,
Meta-Llama-3-8B, DeepSeek-V3, as their hub ``config.json`` states them), written with
``save_pretrained`` and read by fmoe's ``read_config`` (the path ``load_hf`` takes). A null that
transformers writes for "derive it" (Mixtral's ``head_dim``) loads as transformers derives it;
``to_hf`` round-trips through transformers' class; what is really invalid (negative, absurd,
wrong type, a null without meaning) is one error naming the file and the field.
"""

import json
import os

import pytest

from fmoe.checkpoint.config_check import read_config
from fmoe.models import deepseek_v3, gpt_oss, llama, mixtral, qwen3_moe

transformers = pytest.importorskip("transformers")

YARN_GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}

#: family -> (model module, transformers config class, the public checkpoint's hyper-parameters,
#: fields fmoe must read from them: {field: value})
PUBLIC = {
    "qwen3_moe": (qwen3_moe, "Qwen3MoeConfig", dict(  # Qwen/Qwen3-30B-A3B
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, sliding_window=None,
        use_sliding_window=False, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
        dict(head_dim=128, num_hidden_layers=48, rope_theta=1e6, sliding_window=None, mlp_only_layers=())),
    "mixtral": (mixtral, "MixtralConfig", dict(  # mistralai/Mixtral-8x7B-v0.1: no head_dim in its config
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5, num_local_experts=8,
        num_experts_per_tok=2, router_aux_loss_coef=0.02, sliding_window=None, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=1, eos_token_id=2),
        dict(head_dim=128, num_key_value_heads=8, sliding_window=None, router_aux_loss_coef=0.02)),
    "gpt_oss": (gpt_oss, "GptOssConfig", dict(  # openai/gpt-oss-20b
        num_hidden_layers=24, num_local_experts=32, vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128, num_experts_per_tok=4,
        max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0, router_aux_loss_coef=0.9,
        rope_parameters={**YARN_GPT_OSS, "rope_theta": 150000.0}, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"] * 12, eos_token_id=200002, pad_token_id=199999),
        dict(num_local_experts=32, sliding_window=128, layer_types=("sliding_attention", "full_attention") * 12,
             rope_scaling=tuple(sorted(YARN_GPT_OSS.items())))),
    "llama": (llama, "LlamaConfig", dict(  # meta-llama/Meta-Llama-3-8B
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, bos_token_id=128000, eos_token_id=128001),
        dict(head_dim=128, num_key_value_heads=8, rope_theta=500000.0, vocab_size=128256)),
    "deepseek_v3": (deepseek_v3, "DeepseekV3Config", dict(  # deepseek-ai/DeepSeek-V3
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096},
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1),
        dict(q_lora_rank=1536, n_group=8, max_position_embeddings=163840, rope_theta=10000.0)),
}


def written(tmp_path, cls_name: str, **values) -> str:
    """The ``config.json`` transformers writes for its class ``cls_name`` built with ``values``."""
    getattr(transformers, cls_name)(**values).save_pretrained(tmp_path)
    return os.path.join(tmp_path, "config.json")


@pytest.mark.parametrize("family", list(PUBLIC))
def test_transformers_defaults_load_as_its_own_defaults(family, tmp_path):
    model, cls_name, _, _ = PUBLIC[family]
    cfg = read_config(model.MODEL, written(tmp_path, cls_name))
    hf = getattr(transformers, cls_name)()
    H = hf.num_attention_heads
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, H) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, H)
    if hasattr(cfg, "head_dim"):       # Mixtral writes "head_dim": null, Qwen3-MoE none: hidden // heads
        assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // H)
        assert cfg.num_key_value_heads == (hf.num_key_value_heads or H)


@pytest.mark.parametrize("family", list(PUBLIC))
def test_the_public_checkpoints_config_loads(family, tmp_path):
    model, cls_name, values, expect = PUBLIC[family]
    cfg = read_config(model.MODEL, written(tmp_path, cls_name, **values))
    assert {k: getattr(cfg, k) for k in expect} == expect
    for k, v in values.items():         # every hyper-parameter fmoe has a field for, as written
        if hasattr(cfg, k) and not isinstance(v, (list, dict)):
            assert getattr(cfg, k) == v, k


@pytest.mark.parametrize("family", list(PUBLIC))
def test_to_hf_round_trips_through_transformers(family, tmp_path):
    """fmoe config -> ``to_hf`` -> transformers' class -> ``save_pretrained`` -> fmoe: equal."""
    model, cls_name, values, _ = PUBLIC[family]
    for i, cfg in enumerate((model.Config.tiny(), read_config(model.MODEL, written(tmp_path / "a", cls_name,
                                                                                   **values)))):
        hf = getattr(transformers, cls_name).from_dict(cfg.to_hf())
        assert read_config(model.MODEL, written(tmp_path / str(i), cls_name, **hf.to_dict())) == cfg


def test_gpt_oss_null_sliding_window_is_refused(tmp_path):
    """transformers' ``GptOssConfig`` stores ``sliding_window: null`` but its model cannot run it
    ("Could not find a `sliding_window` argument in the config"); fmoe refuses it when loading
    (it used to replace it by the default 128 silently)."""
    path = written(tmp_path, "GptOssConfig", sliding_window=None, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"config.json: .*sliding_window must be an int >= 1, got None"):
        read_config(gpt_oss.MODEL, path)


@pytest.mark.parametrize("family, field, value, message", [
    ("mixtral", "head_dim", -8, "'head_dim' must be an integer in [0, 2**24), got -8"),
    ("mixtral", "head_dim", 4_000_000_000, "'head_dim' must be an integer in [0, 2**24)"),
    ("llama", "num_key_value_heads", "8", "'num_key_value_heads' must be an integer"),
    ("llama", "rms_norm_eps", None, "'rms_norm_eps' must be a finite number, got None"),
    ("qwen3_moe", "norm_topk_prob", None, "'norm_topk_prob' must be true or false, got None"),
    ("qwen3_moe", "num_experts_per_tok", None, "num_experts_per_tok must be an int >= 1, got None"),
    ("gpt_oss", "num_hidden_layers", 2.5, "'num_hidden_layers' must be an integer"),
    ("deepseek_v3", "kv_lora_rank", None, "kv_lora_rank must be an int >= 1, got None"),
])
def test_what_is_really_invalid_is_refused_naming_file_and_field(family, field, value, message, tmp_path):
    model = PUBLIC[family][0]
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**model.Config.tiny().to_hf(), field: value}))
    with pytest.raises(ValueError) as e:
        read_config(model.MODEL, str(path))
    assert str(e.value).startswith(str(path)) and message in str(e.value), str(e.value)
