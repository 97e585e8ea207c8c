"""Checkpoints with transformers' fused in-memory expert tensors load like the per-expert layout.

(Logits, every gradient and ``save_hf`` -> ``from_pretrained`` against transformers, for every
family and its variant configs, are the conformance suite's ``"hf"`` check:
``tests/distributed/test_conformance.py``.)
"""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import fmoe
from fmoe.models import mixtral, qwen3_moe
from helpers import hf_model

transformers = pytest.importorskip("transformers")

CASES = {  # id -> (model module, fmoe config, transformers class name)
    "qwen3_moe": (qwen3_moe, qwen3_moe.Config.tiny(num_hidden_layers=3, mlp_only_layers=(1,), sliding_window=5),
                  "Qwen3MoeForCausalLM"),
    "mixtral": (mixtral, mixtral.Config.tiny(sliding_window=5), "MixtralForCausalLM"),
}


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_fused_expert_keys_load_like_per_expert_keys(case, tmp_path):
    """A checkpoint holding transformers' fused in-memory tensors (``mlp.experts.gate_up_proj``)
    loads to the same parameters as the per-expert layout ``save_pretrained`` writes."""
    model_mod, cfg, cls_name = CASES[case]
    hf = hf_model(cfg, cls_name)
    hf.save_pretrained(tmp_path / "per_expert")
    os.makedirs(tmp_path / "fused")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "fused" / "model.safetensors")
    with open(tmp_path / "fused" / "config.json", "w") as f:
        json.dump(cfg.to_hf(), f)
    a, _ = model_mod.load_hf(tmp_path / "per_expert")
    b, _ = model_mod.load_hf(tmp_path / "fused")
    fa, fb = fmoe.tree.flatten(a), fmoe.tree.flatten(b)
    assert sorted(fa) == sorted(fb)
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
