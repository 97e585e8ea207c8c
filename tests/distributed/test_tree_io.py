"""fmoe.save / fmoe.load: any tree of plain or DTensor leaves, pickle-free, resharded on load.

One process: a nested tree (digit keys stay dict keys, lists stay lists, 0-dim and bf16 leaves)
round-trips bitwise; ``like`` gives dtypes; bad leaves, missing paths and wrong shapes raise
before anything is returned; the files are safetensors (no pickle). Four gloo ranks: params and
AdamW state sharded on tp2/ep2 are saved, loaded onto tp1/ep4 and onto one process (and by a
Plan), and equal the gathered originals bitwise.
"""

import json
import os

import pytest
import safetensors.torch
import torch

import fmoe
from fmoe.models import qwen3_moe
from fmoe.optim import adamw
from helpers import on_ranks


def test_round_trip_of_a_nested_tree_is_bitwise(tmp_path):
    tree = {"layers": {"0": {"w": torch.randn(3, 2)}, "10": {"w": torch.randn(3, 2)}},
            "stack": [torch.arange(4), torch.randn(2).to(torch.bfloat16)],
            "step": torch.tensor(7), "f64": torch.randn(2, dtype=torch.float64)}
    fmoe.save(tree, tmp_path / "t")
    back = fmoe.load(tmp_path / "t")
    assert isinstance(back["layers"], dict) and isinstance(back["stack"], list)
    for k, v in fmoe.tree.flatten(tree).items():
        got = fmoe.tree.flatten(back)[k]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    files = sorted(os.listdir(tmp_path / "t"))
    assert files == ["config.json", "model.safetensors"]
    assert set(safetensors.torch.load_file(str(tmp_path / "t" / "model.safetensors"))) == set(fmoe.tree.paths(tree))
    like = fmoe.tree.map_with_path(lambda _, t: t.float() if t.is_floating_point() else t, tree)
    assert fmoe.load(tmp_path / "t", like=like)["stack"][1].dtype == torch.float32


def test_bad_input_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"'n': 'int'"):
        fmoe.save({"w": torch.ones(1), "n": 3}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    fmoe.save({"w": torch.ones(2)}, tmp_path / "t")
    with pytest.raises(ValueError, match=r"has no \['v'\]"):
        fmoe.load(tmp_path / "t", like={"w": torch.ones(2), "v": torch.ones(2)})
    with pytest.raises(ValueError, match=r"'w' has shape \(2,\).*like holds \(3,\)"):
        fmoe.load(tmp_path / "t", like={"w": torch.ones(3)})
    (tmp_path / "hf").mkdir()
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump({"model_type": "llama"}, f)
    safetensors.torch.save_file({"x": torch.ones(1)}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match="is not an fmoe.save directory"):
        fmoe.load(tmp_path / "hf")


def _reshard(rank, world, path):
    cfg = qwen3_moe.Config.tiny()
    full = qwen3_moe.init(cfg, seed=0)
    fails = []
    src = fmoe.Mesh(tp=2, ep=2)
    params = qwen3_moe.shard(full, cfg, src)
    state = adamw.init(params)
    g = fmoe.tree.map_with_path(lambda _, p: fmoe.sharding.placed_like(torch.ones_like(p.to_local()), p), params)
    params, state = adamw.update(g, state, params, lr=0.1)
    tree = {"params": params, "opt": state}
    want = fmoe.tree.flatten(fmoe.gather(tree))
    fmoe.save(tree, path)
    dst = fmoe.Mesh(tp=1, ep=4)
    like = {"params": qwen3_moe.shard(full, cfg, dst), "opt": adamw.init(qwen3_moe.shard(full, cfg, dst))}
    for how, got in (("tp1/ep4", fmoe.load(path, like=like, mesh=dst)),
                     ("one process", fmoe.load(path)),
                     ("plan", {"params": fmoe.load(path, like=qwen3_moe.plan(cfg), mesh=dst)["params"]})):
        flat = fmoe.tree.flatten(got)
        if how == "tp1/ep4":
            for k, v in flat.items():
                ref = fmoe.tree.flatten(like)[k]
                if isinstance(ref, torch.distributed.tensor.DTensor) and v.placements != ref.placements:
                    fails.append(f"{how} {k}: placements {v.placements} != {ref.placements}")
        full_got = fmoe.tree.flatten(fmoe.gather(got))
        for k, v in full_got.items():
            if not torch.equal(v, want[k]):
                fails.append(f"{how} {k}: values differ")
    return fails


def test_save_on_tp2_ep2_load_on_tp1_ep4_and_one_process(tmp_path):
    for rank, fails in enumerate(on_ranks(_reshard, 4, str(tmp_path / "tree"), timeout=600)):
        assert fails == [], f"rank {rank}: {fails[:5]}"
