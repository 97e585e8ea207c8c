"""llama checkpoints: transformers' save_pretrained <-> fmoe load_hf/save_hf, sharded reads."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fmoe
from fmoe.models import llama
from helpers import on_ranks


def _hf_dir(tmp_path):
    cfg = llama.Config.tiny()
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**cfg.to_hf(), attn_implementation="eager")).eval()
    hf.save_pretrained(tmp_path / "hf")
    return cfg, hf, str(tmp_path / "hf")


def test_load_and_save_round_trip(tmp_path):
    cfg, hf, path = _hf_dir(tmp_path)
    params, cfg2 = llama.load_hf(path)
    assert cfg2 == cfg
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        torch.testing.assert_close(llama.forward(params, tokens, cfg), want, rtol=1e-5, atol=1e-6)
        llama.save_hf(params, cfg, tmp_path / "out")
        again = LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
        assert torch.equal(again(tokens).logits, want)


def _sharded(rank, world, path):
    mesh = fmoe.Mesh(tp=2)
    params, cfg = llama.load_hf(path, mesh=mesh)
    full, _ = llama.load_hf(path)
    ref = llama.shard(full, cfg, mesh)
    return all(torch.equal(fmoe.to_local(a), fmoe.to_local(b)) and fmoe.placement_of(a) == fmoe.placement_of(b)
               for a, b in zip(fmoe.tree.leaves(params), fmoe.tree.leaves(ref)))


def test_sharded_load_equals_shard(tmp_path):
    _, _, path = _hf_dir(tmp_path)
    assert on_ranks(_sharded, 2, path) == [True, True]
