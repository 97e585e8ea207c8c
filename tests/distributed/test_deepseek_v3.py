"""DeepSeek-V3: config, routing bias and presets; distributed against one process.

Against transformers' ``DeepseekV3ForCausalLM`` (with and without the q LoRA, ``n_group > 1``
with ``topk_group < n_group``, one dense first layer, shared experts, a non-zero random
``e_score_correction_bias``, YaRN with ``mscale``/``mscale_all_dim`` and both rope layouts:
logits, every gradient, ``save_hf`` both ways, greedy generation) the configs are the
conformance suite's (``tests/distributed/test_conformance.py``). On 4 ranks (tp2/ep4, tp1/ep4) sharded loading,
logits and gathered gradients equal one process (:mod:`test_models_dist`'s checks), and three
training steps match one process training on the union of the batches.
"""

import json

import pytest
import torch

import fmoe
from fmoe.models import deepseek_v3 as ds
from helpers import close, hf_model, on_ranks, read_all

transformers = pytest.importorskip("transformers")

YARN = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 4.0), ("mscale", 0.8), ("mscale_all_dim", 1.0),
        ("original_max_position_embeddings", 64), ("rope_type", "yarn"))
PLAIN_Q = ds.Config.tiny(q_lora_rank=None, rope_scaling=YARN, n_shared_experts=2, norm_topk_prob=False,
                         routed_scaling_factor=2.5, rope_interleave=False, n_group=2, topk_group=1)


def test_bias_selects_presets_round_trip_and_config_errors():
    for c in (ds.Config.tiny(), ds.Config.small(), ds.Config(), PLAIN_Q):
        assert ds.Config.from_hf(json.loads(json.dumps(c.to_hf()))) == c
        ds.check_plan(c, tp=8)
    assert sorted(fmoe.tree.flatten(ds.init(ds.Config.tiny()))) == sorted(ds.hf_specs(ds.Config.tiny()))
    cfg = ds.Config.tiny(first_k_dense_replace=0, num_hidden_layers=1, n_group=1, topk_group=1)
    params = ds.init(cfg)
    tokens = torch.arange(10).reshape(2, 5)
    params["layers"][0]["moe"]["expert_bias"] = torch.tensor([0.0] * 7 + [10.0])  # expert 7 always chosen
    _, aux = ds.forward(params, tokens, cfg, return_aux=True)
    assert int(aux["moe"][0]["tokens_per_expert"][7]) == 10
    assert ds.softmax_scale(cfg) == cfg.qk_head_dim ** -0.5
    for bad, field in ((dict(n_group=3), "n_group"), (dict(topk_group=5), "topk_group"),
                       (dict(q_lora_rank=0), "q_lora_rank"), (dict(first_k_dense_replace=-1), "first_k_dense_replace")):
        with pytest.raises(ValueError, match=field):
            ds.Config.tiny(**bad)
    with pytest.raises(ValueError, match="num_attention_heads=6"):
        ds.check_plan(ds.Config.tiny(num_attention_heads=6), tp=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ds.Config.from_hf({**cfg.to_hf(), "num_key_value_heads": 2})


# ---- distributed: reuse the checks of test_models_dist on DeepSeek-V3 --------------------------------

def _dist_cases(tmp_path):
    import test_models_dist as tmd

    tmd.MODELS["deepseek_v3"] = ds
    tmd.CFGS["deepseek_v3"] = ds.Config.tiny(initializer_range=0.2)
    tmd.CFGS["deepseek_v3-plain_q"] = ds.Config.tiny(initializer_range=0.1, q_lora_rank=None, rope_interleave=False)
    return tmd


def _dist_ranks(rank, world, cases):
    tmd = _dist_cases(None)
    return tmd._ranks(rank, world, cases)


def test_four_ranks_tp2_ep4_and_tp1_ep4_match_one_process(tmp_path):
    tmd = _dist_cases(tmp_path)
    paths = {n: tmd.write_checkpoint(n, str(tmp_path)) for n in ("deepseek_v3", "deepseek_v3-plain_q")}
    cases = [("deepseek_v3", paths["deepseek_v3"], 2, 4, None, str(tmp_path / "saved")),
             ("deepseek_v3", paths["deepseek_v3"], 1, 4, None),
             ("deepseek_v3-plain_q", paths["deepseek_v3-plain_q"], 2, 4, None)]
    results = on_ranks(_dist_ranks, 4, cases, timeout=600)
    tmd.check(cases, results)
    a, b = read_all(paths["deepseek_v3"]), read_all(str(tmp_path / "saved"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    placed = results[0][0]["placed"]
    assert placed["layers.1.attn.wkv_b"] == fmoe.P("tp", None) and placed["layers.1.attn.wkv_a"] == fmoe.P()
    assert placed["layers.1.moe.shared.w_gate_up"] == fmoe.P("tp", None, packed=2)


def _train(rank, world, meshes):
    from test_train import _train_meshes
    return _train_meshes(rank, world, "deepseek_v3", meshes)


def test_training_matches_single_process_on_four_ranks():
    """Three AdamW steps with the expert-bias update (split over fsdp on tp1/ep4)."""
    from test_train import compare
    meshes = [dict(tp=1, ep=4), dict(tp=2, ep=4)]
    compare(on_ranks(_train, 4, meshes, timeout=900)[0], "deepseek_v3")


def test_main_job_from_a_transformers_checkpoint(tmp_path):
    """``fmoe train --model deepseek_v3 --init-hf DIR`` trains on 2 ranks (tp1/ep2) and
    exports a checkpoint transformers loads."""
    from fmoe.cli.train import main
    cfg = ds.Config.tiny(vocab_size=256)
    hf_model(cfg, "DeepseekV3ForCausalLM").save_pretrained(tmp_path / "hf")
    argv = ["--model", "deepseek_v3", "--init-hf", str(tmp_path / "hf"), "--nproc", "2", "--ep", "2", "--steps", "2",
            "--batch", "2", "--seq", "16", "--out", str(tmp_path / "run"), "--export-hf", str(tmp_path / "out"),
            "--quiet"]
    assert main(argv) == 0
    lines = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert len(lines) == 2
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    params, _ = ds.load_hf(tmp_path / "out")
    tokens = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        close(ds.forward(params, tokens, cfg), back(tokens).logits, "exported checkpoint logits")
