"""The MoE models against transformers: logits, every gradient, and checkpoints both ways.

For each model a tiny random transformers model (fp32, eager attention; weights redrawn larger
than the init so that biases, norms, sinks and the SwiGLU clamp all matter) is saved with
``save_pretrained``. fmoe's ``load_hf`` + ``forward`` must give transformers' logits, and the
gradient of the same cross-entropy loss must equal transformers' gradient for every parameter.
Gradients are compared in the checkpoint layout: transformers writes its gradients with
``save_pretrained`` (its own conversion from fused in-memory tensors to checkpoint keys) and fmoe
writes its gradient tree with ``save_hf``; the two files must hold the same keys and values.
Finally transformers loads what fmoe's ``save_hf`` wrote and gives the same logits.

Tolerance: rtol 1e-5 as everywhere; the atol (1e-6 of each tensor's largest entry) only covers
elements that cancel to about zero, where fp32 sums taken in another order differ absolutely.
"""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import fmoe
import fmoe.nn as nn
from fmoe.models import gpt_oss, mixtral, qwen3_moe
from helpers import check_grads_and_save_hf, close, hf_model

transformers = pytest.importorskip("transformers")

B, S = 2, 12  # S above every sliding window below, so the windows matter


CASES = {  # id -> (model module, fmoe config, transformers class name)
    "qwen3_moe": (qwen3_moe, qwen3_moe.Config.tiny(num_hidden_layers=3, mlp_only_layers=(1,), sliding_window=5),
                  "Qwen3MoeForCausalLM"),
    "qwen3_moe-tied-unnormalised-step2": (qwen3_moe, qwen3_moe.Config.tiny(
        tie_word_embeddings=True, norm_topk_prob=False, decoder_sparse_step=2, num_experts_per_tok=3,
        rope_theta=500000.0), "Qwen3MoeForCausalLM"),
    "mixtral": (mixtral, mixtral.Config.tiny(sliding_window=5), "MixtralForCausalLM"),
    "mixtral-no-window": (mixtral, mixtral.Config.tiny(), "MixtralForCausalLM"),
    "gpt_oss": (gpt_oss, gpt_oss.Config.tiny(swiglu_limit=1.0), "GptOssForCausalLM"),
    "gpt_oss-plain-rope": (gpt_oss, gpt_oss.Config.tiny(rope_scaling=(), layer_types=("full_attention",
                                                                                      "sliding_attention")),
                           "GptOssForCausalLM"),
}


def hf_logits_and_grads(model, tokens: torch.Tensor):
    logits = model(tokens).logits
    nn.cross_entropy(logits[:, :-1], tokens[:, 1:]).backward()
    return logits.detach()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_every_gradient_and_checkpoints_match_transformers(case, tmp_path):
    model_mod, cfg, cls_name = CASES[case]
    hf = hf_model(cfg, cls_name)
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))

    params, loaded_cfg = model_mod.load_hf(tmp_path / "hf")
    assert loaded_cfg == cfg
    params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), params)
    logits, aux = model_mod.forward(params, tokens, cfg, return_aux=True)
    nn.cross_entropy(logits[:, :-1], tokens[:, 1:]).backward()
    ref = hf_logits_and_grads(hf, tokens)
    close(logits.detach(), ref, f"{case} logits")
    n_moe = sum(1 for layer in params["layers"] if "moe" in layer)
    assert len(aux["moe"]) == n_moe and all(int(a["tokens_per_expert"].sum()) == B * S * cfg.num_experts_per_tok
                                            for a in aux["moe"])

    # every gradient, in the checkpoint layout each library writes; save_hf writes what
    # save_pretrained writes, and transformers loads it
    check_grads_and_save_hf(model_mod, hf, fmoe.tree.map_with_path(lambda _, t: t.grad, params), params, logits,
                            tokens, cfg, tmp_path, case)


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
