"""llama checkpoints: a sharded read equals shard of the full read (the save_pretrained <-> load_hf /
save_hf round trip is the conformance suite's "hf" check: tests/distributed/test_conformance.py)."""

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
