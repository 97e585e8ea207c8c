"""fmoe.memory.plan against what training really holds, per rank, on several meshes.

Measured on each rank of a real (gloo) job laid out as ``fmoe train`` lays it out:
parameter, gradient and optimizer bytes are the local slices' ``nbytes`` (the plan must equal
them exactly); activations are the distinct storages autograd saves for backward during one
forward + loss (FSDP-gathered weights, which the trainer re-gathers in backward instead of
saving, and the parameters themselves excluded) — the activation peak, which is reached at the
end of forward. The plan's estimate must be within 25% of it.
"""

import json

import pytest
import torch

import fmoe
import fmoe.models
from helpers import on_ranks, program
from fmoe.memory.plan import format_plan, memory_plan

MESHES = [(1, 1, 1, 1), (4, 1, 4, 1), (4, 2, 4, 1), (4, 1, 2, 2)]   # nproc, tp, ep, dp_replicate


def _local_bytes(tree) -> int:
    return sum((t._local_tensor if hasattr(t, "_local_tensor") else t).nbytes for t in fmoe.tree.leaves(tree))


def _measure(rank, world, preset, tp, ep, dpr, batch, seq, dtype):
    import dataclasses

    from fmoe.data import TokenStream
    from fmoe.memory.plan import memory_plan
    from fmoe.models import qwen3_moe
    from fmoe.fsdp import _RECIPE, _root, data_parallel_plan, regather_in_backward
    from fmoe.training.grads import reduce_grads
    from fmoe.optim.adamw import init as adamw_init
    from fmoe.training import router_aux
    from fmoe.training.forward import autocast, forward_with_aux
    cfg = dataclasses.replace(qwen3_moe.MODEL.preset(preset, tp), output_router_logits=True)
    mesh = fmoe.Mesh(tp=tp, ep=ep, dp_replicate=dpr)
    full = fmoe.tree.map_with_path(lambda _, t: t.requires_grad_(True), qwen3_moe.init(cfg, seed=0))
    params = fmoe.shard(full, data_parallel_plan(qwen3_moe.check_plan(cfg, None, tp), full, mesh), mesh)
    state = adamw_init(params)
    x, y = TokenStream.stdlib(300_000).batch(1, mesh.batch_index, batch, seq, 0, num_batches=mesh.num_batches)
    own = {(t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage().data_ptr()
           for t in fmoe.tree.leaves(params)}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own and st.data_ptr() not in seen and getattr(_root(t), _RECIPE, None) is None:
            seen[st.data_ptr()] = st.nbytes()
        return t

    flat = fmoe.tree.flatten(params)
    with regather_in_backward(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast(dtype, x.device):
            logits, aux = forward_with_aux(qwen3_moe, params, x, cfg, mesh)
        loss = fmoe.nn.cross_entropy(logits.float(), y) + mesh.num_batches * router_aux.losses(aux)[0]
    keys = [k for k, t in flat.items() if t.requires_grad]
    grads = torch.autograd.grad(loss, [flat[k] for k in keys])
    grads = reduce_grads(dict(zip(keys, grads)), {k: flat[k] for k in keys}, mesh, inplace=True)
    measured = {"params_bytes": _local_bytes(params), "grads_bytes": _local_bytes(grads),
                "optimizer_bytes": _local_bytes(state), "activations_bytes": sum(seen.values())}
    plan = memory_plan(qwen3_moe, cfg, nproc=world, tp=tp, ep=ep, dp_replicate=dpr, batch=batch, seq=seq,
                       dtype=dtype)["ranks"][rank]
    return measured, plan


def _measure_all(rank, world, tp, ep, dpr, cases):
    return [_measure(rank, world, preset, tp, ep, dpr, batch, seq, dtype) for preset, batch, seq, dtype in cases]


def _check(results, tol=0.25):
    ratios = []
    for measured, plan in results:
        for k in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert plan[k] == measured[k], (k, plan[k], measured[k])
        ratios.append(plan["activations_bytes"] / measured["activations_bytes"])
        assert abs(ratios[-1] - 1) <= tol, (plan["activations_bytes"], measured["activations_bytes"])
    return ratios


CASES = [("tiny", 2, 32, "fp32"), ("small", 2, 64, "fp32")]
BF16 = ("small", 2, 64, "bf16")       # also measured on the ep=4 mesh: masters, grads, moments stay fp32


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "n{}tp{}ep{}r{}".format(*m))
def test_plan_matches_measured_bytes(mesh):
    nproc, tp, ep, dpr = mesh
    cases = CASES + [BF16] * (mesh == (4, 1, 4, 1))
    if nproc == 1:
        per_rank = [_measure_all(0, 1, tp, ep, dpr, cases)]
    else:
        per_rank = on_ranks(_measure_all, nproc, tp, ep, dpr, cases, timeout=300)
    for i, case in enumerate(cases):
        print(case, mesh, [round(r, 3) for r in _check([r[i] for r in per_rank])])


def test_plan_command_json_text_and_warning(capsys):
    def run(*flags):            # fmoe memory in this process (test_commands.py starts it as a process)
        from fmoe.cli.memory import main
        return program(main, capsys, *flags)
    flags = ["--model", "qwen3_moe", "--preset", "small", "--nproc", "4", "--tp", "2", "--ep", "4", "--batch", "2",
             "--seq", "64", "--dtype", "bf16", "--remat", "layer"]
    r = run(*flags, "--json", "--memory-gb", "0.05")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    from fmoe.models import qwen3_moe
    want = memory_plan(qwen3_moe, qwen3_moe.MODEL.preset("small", 2), nproc=4, tp=2, ep=4, batch=2, seq=64,
                       dtype="bf16", remat="layer")
    assert got["ranks"] == want["ranks"] and len(got["ranks"]) == 4 and got["fits"] is False
    assert set(got["ranks"][0]) >= {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes"}
    r = run(*flags, "--memory-gb", "0.05")
    assert r.returncode == 0 and "WARNING" in r.stdout and "exceeds --memory-gb 0.05" in r.stdout
    assert "memory plan: qwen3_moe on 4 ranks (tp=2 ep=4 fsdp=2" in r.stdout
    assert "WARNING" not in run(*flags, "--memory-gb", "100").stdout
    r = run("--nproc", "4", "--tp", "3")
    assert r.returncode == 2 and "--tp * --dp-replicate = 3" in r.stderr and "must be a whole number" in r.stderr
    assert format_plan(want).count("\n") >= 3


@pytest.mark.parametrize("name", list(fmoe.models.SHIPPED))
def test_declared_widths_remat_blocks_and_presets_agree_with_the_model(name):
    """What a model declares on its ``Model`` (the memory plan's ``widths``, ``remat_blocks``,
    the job's ``preset``) agrees with the parameters its ``init`` builds."""
    model = fmoe.models.get(name)
    cfg = model.preset("small", 1)
    with torch.device("meta"):
        flat = fmoe.tree.flatten(model.init(cfg))
    w = model.widths(cfg)
    layers = {int(p.split(".")[1]) for p in flat if p.startswith("layers.")}
    assert (w.V, w.D, w.L) == (*flat["embed"].shape, len(layers))
    routed = [p[: -len(".router")] for p in flat if p.endswith("moe.router")]
    assert bool(routed) == model.routed == ("moe" in model.remat_blocks) and "layer" in model.remat_blocks
    if routed:
        assert (w.E, w.I) == (flat[routed[0] + ".router"].shape[0], flat[routed[0] + ".w_down"].shape[2])
        assert 1 <= w.K <= w.E
    else:
        assert (w.E, w.K, w.I) == (0, 0, 0)
    dense = [p for p in flat if p.endswith(".mlp.w_down")]
    if dense:
        assert w.Id == flat[dense[0]].shape[1]
    if "layers.0.attn.wk" in flat:                                   # grouped-query attention
        assert (w.H * w.hd, w.G * w.hd) == (flat["layers.0.attn.wq"].shape[0], flat["layers.0.attn.wk"].shape[0])
    assert w.V >= 256 and model.preset("tiny").vocab_size >= 256      # byte tokens fit
    for tp in (2, 4, 8):
        if w.H % tp == 0:                                            # KV heads widened to split over tp
            assert model.widths(model.preset("small", tp)).G % tp == 0
    with pytest.raises(ValueError, match="preset: name must be one of"):
        model.preset("huge")
