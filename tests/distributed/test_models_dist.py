"""The MoE models distributed: every mesh of the reference gives single-process numbers.

Each rank loads a checkpoint with ``load_hf(path, mesh=mesh)`` (reading only its own slices; the
result must equal ``shard`` of the full parameters bitwise), feeds its own batch (chosen by
``mesh.batch_index``), and runs forward + backward of a cross-entropy loss. The single-process
reference, computed once in the test process, is the same model on each batch. Compared:

- logits (training pass with ``impl="auto"`` = all_to_all, and an inference pass under
  ``no_grad``, which takes all_reduce when ``ep == tp``) against the rank's own batch;
- tokens per expert of every MoE layer against the rank's own batch;
- gathered gradients: every leaf's gathered gradient is the SUM over all distinct batches (honest
  placements: a leaf replicated over a data axis has a ``Partial`` gradient there, which
  ``fmoe.gather`` sums; one split over fsdp is reduce-scattered in backward; an expert sums its
  EP group's batches in the dispatch backward and the rest through ``Partial``).

In the 4-rank test ``save_hf`` of the sharded parameters must write back the very checkpoint they
were loaded from. fp32 throughout; rtol 1e-5, with an atol of 1e-6 of each tensor's scale for entries that cancel
to about zero (sums taken in another order across ranks).
"""

import os

import pytest
import torch
from safetensors.torch import load_file

import fmoe
import fmoe.nn as nn
from fmoe import P
from fmoe.models import gpt_oss, mixtral, qwen3_moe
from helpers import close, on_ranks

B, S = 2, 8
MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "gpt_oss": gpt_oss}
CFGS = {  # initializer_range 0.2: routing far from uniform, so every expert sees a different load
    "qwen3_moe": qwen3_moe.Config.tiny(initializer_range=0.2),
    "qwen3_moe-kv8": qwen3_moe.Config.tiny(initializer_range=0.2, num_key_value_heads=8),  # tp=8 divides
    "mixtral": mixtral.Config.tiny(initializer_range=0.2, sliding_window=5),
    "gpt_oss": gpt_oss.Config.tiny(initializer_range=0.2, swiglu_limit=1.0),
}
# A user override merged over the default plan: layer 1's q/k/v colwise with gathered output (so
# every rank computes all heads) and its o projection replicated, the embedding split on D
# instead of the vocabulary, and the routers split over fsdp (gathered for compute).
OVERRIDE = {"layers.1.attn.w[qkv]": "colwise_gather", "layers.1.attn.wo": "replicate",
            "embed": P(None, "tp"), "layers.*.moe.router": P("fsdp", None)}


def tokens_of(cfg, b: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(100 + b))


def write_checkpoint(name: str, directory: str) -> str:
    """A checkpoint of random parameters (biases and sinks non-zero, norms near one)."""
    model, cfg = MODELS[name.split("-")[0]], CFGS[name]
    g = torch.Generator().manual_seed(7)
    params = fmoe.tree.map_with_path(lambda _, t: t + 0.1 * torch.randn(t.shape, generator=g), model.init(cfg, 0))
    path = os.path.join(directory, name)
    model.save_hf(params, cfg, path)
    return path


def _rank_case(name: str, path: str, tp: int, ep: int, plan, save_to=None) -> dict:
    """One configuration on this rank: load sharded, forward + backward, gather the gradients
    (and, with ``save_to``, save the sharded parameters back as a checkpoint)."""
    model, cfg = MODELS[name.split("-")[0]], CFGS[name]
    mesh = fmoe.Mesh(tp=tp, ep=ep)
    params, loaded_cfg = model.load_hf(path, mesh=mesh, plan=plan)
    assert loaded_cfg == cfg
    want = model.shard(model.load_hf(path)[0], cfg, mesh, plan)
    for (k, a), (_, b) in zip(sorted(fmoe.tree.flatten(params).items()), sorted(fmoe.tree.flatten(want).items())):
        assert fmoe.placement_of(a) == fmoe.placement_of(b), k
        assert torch.equal(fmoe.to_local(a), fmoe.to_local(b)), f"{k}: sliced read differs from shard"
    if save_to is not None:
        model.save_hf(params, cfg, save_to)
    params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), params)
    tokens = tokens_of(cfg, mesh.batch_index)
    with pytest.raises(ValueError, match="mesh is None but the experts are sharded over ep"):
        model.forward(params, tokens, cfg)   # raised before any communication
    layer = next(layer["moe"] for layer in params["layers"] if "moe" in layer)   # a forward without the kit's start
    with pytest.raises(ValueError, match=r"experts on this rank, expected \d+ .*: pass mesh="):
        fmoe.moe({k: layer[k] for k in ("router", "w_gate_up", "w_down")}, torch.zeros(2, cfg.hidden_size),
                 router=fmoe.routing.topk(1))
    logits, aux = model.forward(params, tokens, cfg, mesh, return_aux=True)
    nn.cross_entropy(logits[:, :-1], tokens[:, 1:]).backward()
    with torch.no_grad():
        inference = model.forward(params, tokens, cfg, mesh)
    return {"batch": mesh.batch_index, "ep_batches": sorted({r // tp for r in mesh.ranks("ep")}),
            "num_batches": mesh.num_batches, "logits": logits.detach(), "inference": inference,
            "tokens_per_expert": [a["tokens_per_expert"] for a in aux["moe"]],
            "grads": fmoe.tree.flatten(fmoe.gather(fmoe.tree.map_with_path(lambda _, t: t.grad, params))),
            "placed": {k: fmoe.placement_of(t) for k, t in fmoe.tree.flatten(params).items()}}


def _ranks(rank: int, world: int, cases: list) -> list:
    return [_rank_case(*case) for case in cases]


def reference(name: str, path: str, b: int):
    model, cfg = MODELS[name.split("-")[0]], CFGS[name]
    params = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(), model.load_hf(path)[0])
    tokens = tokens_of(cfg, b)
    logits, aux = model.forward(params, tokens, cfg, return_aux=True)
    nn.cross_entropy(logits[:, :-1], tokens[:, 1:]).backward()
    grads = fmoe.tree.flatten(fmoe.tree.map_with_path(lambda _, t: t.grad, params))
    return logits.detach(), [a["tokens_per_expert"] for a in aux["moe"]], grads


def check(cases: list, results: list) -> None:
    refs = {}
    for i, (name, path, tp, ep, *_) in enumerate(cases):
        for rank, per_case in enumerate(results):
            r, what = per_case[i], f"{name} tp={tp} ep={ep} rank {rank}"
            for b in range(r["num_batches"]):
                if (name, b) not in refs:
                    refs[name, b] = reference(name, path, b)
            logits, tpe, grads = refs[name, r["batch"]]
            close(r["logits"], logits, f"{what} logits")
            close(r["inference"], logits, f"{what} inference logits")
            assert all(torch.equal(a, b) for a, b in zip(r["tokens_per_expert"], tpe)), f"{what} tokens per expert"
            assert sorted(r["grads"]) == sorted(grads)
            for path_, g in r["grads"].items():     # honest placements: every leaf sums all batches
                want = sum(refs[name, b][2][path_] for b in range(r["num_batches"]))
                # summed over the batches by all-reduces in another order: 2e-6 of the scale
                close(g, want, f"{what} grad {path_} ({r['placed'][path_]})", atol=2e-6)


def test_four_ranks_tp2_ep4_user_override_gpt_oss_and_mixtral(tmp_path):
    paths = {n: write_checkpoint(n, str(tmp_path)) for n in ("qwen3_moe", "mixtral", "gpt_oss")}
    saved = {n: str(tmp_path / f"saved-{n}") for n in paths}
    cases = [("qwen3_moe", paths["qwen3_moe"], 2, 4, None, saved["qwen3_moe"]),
             ("qwen3_moe", paths["qwen3_moe"], 2, 4, OVERRIDE),
             ("gpt_oss", paths["gpt_oss"], 2, 4, None, saved["gpt_oss"]),
             ("mixtral", paths["mixtral"], 4, 4, None, saved["mixtral"])]
    results = on_ranks(_ranks, 4, cases, timeout=600)
    check(cases, results)
    for n, path in paths.items():  # save_hf of sharded params gathers them back into the same checkpoint
        a, b = load_file(os.path.join(path, "model.safetensors")), load_file(os.path.join(saved[n], "model.safetensors"))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), n
    placed = results[0][1]["placed"]
    assert placed["layers.1.attn.wq"] == P("tp", None, gather=True) and placed["layers.0.attn.wq"] == P("tp", None)
    assert placed["embed"] == P(None, "tp") and placed["layers.0.moe.router"] == P("fsdp", None)
    gp = results[0][2]["placed"]
    assert gp["layers.0.attn.sinks"] == P("tp") and gp["layers.0.moe.b_gate_up"] == P("ep", None)


@pytest.mark.slow
def test_eight_ranks_the_four_reference_meshes(tmp_path):
    paths = {n: write_checkpoint(n, str(tmp_path)) for n in ("qwen3_moe", "qwen3_moe-kv8")}
    cases = [("qwen3_moe", paths["qwen3_moe"], 4, 4, None),      # tp4, fsdp2, ep4
             ("qwen3_moe", paths["qwen3_moe"], 1, 4, None),      # tp1, fsdp8, ep4
             ("qwen3_moe", paths["qwen3_moe"], 2, 4, None),      # tp2, fsdp4, ep4
             ("qwen3_moe-kv8", paths["qwen3_moe-kv8"], 8, 8, None)]  # tp8, ep8
    results = on_ranks(_ranks, 8, cases, timeout=900)
    assert [r[1]["ep_batches"] for r in results] == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
    check(cases, results)
