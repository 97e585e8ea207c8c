"""Uneven shards (DTensor's ``torch.chunk`` sizes) wherever the math allows.

A vocabulary of 97 (or 101) over tp=2 splits the embedding and lm_head 49/48 (51/50); a hidden
size of 50 over fsdp=4 (or 2) splits norms and projections 13/13/13/11 (25/25). On 4 ranks:

- ``load_hf(path, mesh)`` reads exactly each rank's uneven block (``Checkpoint.bytes_read`` =
  the bytes of its slices) and equals ``shard`` of the full tree bitwise; logits and gathered
  gradients equal one process (the checks of :mod:`test_models_dist`), also with a user plan
  splitting the embedding's 97 rows over fsdp;
- three training steps (vocabulary 257 on tp=2: 129/128) with the default data-parallel plans (fsdp added on a dim it does not
  divide) equal one process; a training checkpoint saved on one mesh resumes on another and in
  one process with the same values.

Splits that must be whole keep their errors: heads over tp, experts over ep, packed gate/up halves.
"""

import pytest
import torch

import fmoe
from fmoe import P
from fmoe.models import mixtral, qwen3_moe
from fmoe.sharding import chunk_range, chunk_sizes
from helpers import on_ranks

UNEVEN = {"qwen3_moe-v97": (qwen3_moe, qwen3_moe.Config.tiny(initializer_range=0.2, vocab_size=97)),
          "mixtral-v101": (mixtral, mixtral.Config.tiny(initializer_range=0.2, vocab_size=101, sliding_window=5))}
# byte corpus: vocab >= 256; D=50 and I=33 divide by neither fsdp=4 nor efsdp=4
TRAIN_CFG = qwen3_moe.Config.tiny(vocab_size=257, hidden_size=50, intermediate_size=36, moe_intermediate_size=33)


def test_chunk_sizes_are_torch_chunk_sizes():
    for size in (0, 1, 5, 48, 97, 101):
        for parts in (1, 2, 3, 4, 8):
            want = [len(c) for c in torch.arange(size).chunk(parts)] if size else []
            want += [0] * (parts - len(want))
            assert chunk_sizes(size, parts) == want, (size, parts)
            assert [chunk_range(size, parts, i)[0] for i in range(parts)] == [sum(want[:i]) for i in range(parts)]


def _tmd():
    import test_models_dist as tmd

    for name, (model, cfg) in UNEVEN.items():
        tmd.MODELS[name.split("-")[0]] = model
        tmd.CFGS[name] = cfg
    return tmd


def _load_ranks(rank, world, cases):
    from fmoe.checkpoint import Checkpoint, load_hf

    tmd = _tmd()
    out = tmd._ranks(rank, world, cases)
    reads = []
    for name, path, tp, ep, plan, *_ in cases:
        model, cfg = UNEVEN[name]
        with Checkpoint(path) as ck:
            params, _ = load_hf(model, ck, fmoe.Mesh(tp=tp, ep=ep), model.check_plan(cfg, plan, tp))
            local = sum(fmoe.to_local(t).numel() * 4 for t in fmoe.tree.leaves(params))
            reads.append((ck.bytes_read, local, tuple(fmoe.to_local(params["embed"]).shape)))
    return out, reads


def test_vocab_97_and_101_on_tp2_load_sharded_and_match_one_process(tmp_path):
    tmd = _tmd()
    paths = {n: tmd.write_checkpoint(n, str(tmp_path)) for n in UNEVEN}
    cases = [("qwen3_moe-v97", paths["qwen3_moe-v97"], 2, 4, None),
             ("qwen3_moe-v97", paths["qwen3_moe-v97"], 2, 4, {"embed": P("fsdp", None)}),
             ("mixtral-v101", paths["mixtral-v101"], 2, 2, None)]
    results = on_ranks(_load_ranks, 4, cases, timeout=600)
    tmd.check(cases, [r[0] for r in results])
    for rank, (_, reads) in enumerate(results):
        for (name, _, tp, _, plan), (read, local, embed) in zip(cases, reads):
            assert read == local, (name, rank, read, local)     # exactly this rank's bytes, nothing more
            V = UNEVEN[name][1].vocab_size
            split = chunk_sizes(V, 2)[(rank // 2) if plan else (rank % 2)]   # fsdp rank or tp rank
            assert embed == (split, 64), (name, rank, embed)
    assert results[0][1][0][2] == (49, 64) and results[1][1][0][2] == (48, 64)


def _train_ranks(rank, world, meshes, ck_dir):
    from test_train import _train_meshes

    return _train_meshes(rank, world, "qwen3_moe", meshes, cfg=TRAIN_CFG)


def test_training_with_uneven_fsdp_and_vocab_matches_one_process():
    from test_train import compare

    meshes = [dict(tp=2, ep=4), dict(tp=1, ep=2), dict(tp=1, ep=1)]   # the last: efsdp=4 on uneven expert dims
    results = on_ranks(_train_ranks, 4, meshes, None, timeout=900)[0]
    import types

    from fmoe.fsdp import data_parallel_plan
    sizes = {"tp": 1, "ep": 1, "fsdp": 4, "efsdp": 4, "dp_replicate": 1}
    mesh = types.SimpleNamespace(fsdp=4, efsdp=4, size=sizes.get, rank_in=lambda a: 0)
    full = qwen3_moe.init(TRAIN_CFG)
    placed = fmoe.tree.flatten(data_parallel_plan(qwen3_moe.plan(TRAIN_CFG), full, mesh).resolve(full, mesh))
    assert placed["layers.0.moe.w_down"] == P("ep", "efsdp") and placed["norm"] == P("fsdp"), placed
    compare(results, "qwen3_moe", cfg=TRAIN_CFG)


def _resume_ranks(rank, world, ck_dir):
    from fmoe.checkpoint import training as ckpt
    from fmoe.optim.adamw import init as adamw_init
    from train_cases import sharded_for_training

    out = {}
    for kw, name in ((dict(tp=2, ep=4), "a"), (dict(tp=1, ep=2), "b")):
        mesh = fmoe.Mesh(**kw)
        params, plan, packed = sharded_for_training(qwen3_moe, TRAIN_CFG, mesh, seed=0 if name == "a" else 5)
        placed = {k: fmoe.placement_of(v) for k, v in fmoe.tree.flatten(params).items()}
        state = adamw_init(params)
        if name == "a":
            ckpt.save(ck_dir, 1, params, state, {"model": "qwen3_moe"}, packed)
        else:
            ckpt.load(ckpt.latest(ck_dir), params, state, packed)
        out[name] = (fmoe.tree.flatten(fmoe.gather(params)), placed)
    return out


def test_checkpoint_of_uneven_shards_resumes_on_another_mesh(tmp_path):
    from fmoe.checkpoint import training as ckpt
    from fmoe.optim.adamw import init as adamw_init

    results = on_ranks(_resume_ranks, 4, str(tmp_path / "ck"), timeout=600)
    want = fmoe.tree.flatten(qwen3_moe.init(TRAIN_CFG, seed=0))
    for res in results:
        for name in ("a", "b"):
            got, _ = res[name]
            assert all(torch.equal(got[k], want[k]) for k in want), name
    placed = results[0]["b"][1]          # tp1/ep2: fsdp=4 splits D=50 13/13/13/11
    assert placed["norm"] == P("fsdp") and placed["layers.0.attn.wq"] == P("tp", "fsdp")
    single = fmoe.tree.map_with_path(lambda _, t: torch.zeros_like(t), qwen3_moe.init(TRAIN_CFG))
    ckpt.load(ckpt.latest(str(tmp_path / "ck")), single, adamw_init(single))   # and into one process
    assert all(torch.equal(fmoe.tree.flatten(single)[k], want[k]) for k in want)


def test_splits_that_must_be_whole_keep_their_errors():
    import types
    mesh = types.SimpleNamespace(size=lambda a: {"tp": 2, "ep": 3, "fsdp": 1}.get(a, 1), rank_in=lambda a: 0)
    with pytest.raises(ValueError, match="experts must split evenly over ep"):
        fmoe.Plan({"w": P("ep", None)}).resolve({"w": torch.zeros(8, 2)}, mesh)
    with pytest.raises(ValueError, match="each packed block must split evenly"):
        fmoe.Plan({"w": P("tp", None, packed=2)}).resolve({"w": torch.zeros(6, 2)}, mesh)
    fmoe.Plan({"w": P("tp", None)}).resolve({"w": torch.zeros(97, 2)}, mesh)                 # uneven: fine
    with pytest.raises(ValueError, match="tp=2 does not divide num_key_value_heads=3"):
        qwen3_moe.check_plan(qwen3_moe.Config.tiny(num_attention_heads=6, num_key_value_heads=3), tp=2)
    with pytest.raises(ValueError, match="tp=2 does not divide num_attention_heads"):
        qwen3_moe.check_plan(qwen3_moe.Config.tiny(num_attention_heads=3, num_key_value_heads=1), tp=2)
