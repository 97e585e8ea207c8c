"""Faults: a rank that raises or dies (before a collective, inside dispatch, inside backward)
ends the whole job with that rank's error in bounded time; killed checkpoint saves lose nothing;
same seed and mesh give bitwise-identical runs."""

import json
import os
import signal
import time

import pytest
import torch

import fmoe
from fmoe import P, Plan
from fmoe.testing import spawn
from moe_cases import batch, full_params


def _moe_fault(rank, world, where):
    from fmoe import ep

    mesh = fmoe.Mesh(tp=1, ep=world)
    p = fmoe.shard({k: v.requires_grad_(True) for k, v in full_params().items()},
                   Plan({"w_*": P("ep", None, None)}, default=P()), mesh)
    x, _ = batch(rank, 4)

    def exploding(x, w, ids, experts, mesh):          # raises on rank 1 after the first exchange
        y = ep.ALL_TO_ALL(x, w, ids, experts, mesh)
        if rank == 1:
            raise RuntimeError("expert rank 1 lost its weights mid-dispatch")
        return y

    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(t):
            return t.clone()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            if rank == 1:
                raise FloatingPointError("rank 1 saw a NaN gradient")
            return g

    ep.register("exploding", exploding)
    if where == "before" and rank == 1:
        raise ValueError("rank 1 failed before any collective")
    if where == "killed" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    impl = "exploding" if where == "dispatch" else "all_to_all"
    y, _ = fmoe.moe(p, BadGrad.apply(x.requires_grad_(True)), router=fmoe.routing.topk(2), mesh=mesh, impl=impl)
    y.sum().backward()
    return True


@pytest.mark.parametrize("where,exc,match", [
    ("before", ValueError, r"\[rank 1\] rank 1 failed before any collective"),
    ("dispatch", RuntimeError, r"\[rank 1\] expert rank 1 lost its weights mid-dispatch"),
    ("backward", FloatingPointError, r"\[rank 1\] rank 1 saw a NaN gradient"),
    ("killed", RuntimeError, r"rank 1 died with exit code -9"),
])
def test_failing_rank_ends_the_job_with_its_error(where, exc, match):
    t0 = time.monotonic()
    with pytest.raises(exc, match=match):
        spawn(_moe_fault, 4, where, timeout=120)
    assert time.monotonic() - t0 < 60


def _hang(rank, world):
    import torch.distributed as dist
    if rank == 1:
        time.sleep(120)                                # alive but never joins the collective
    dist.all_reduce(torch.ones(1))


def test_survivors_time_out_on_their_own():
    """The collective timeout bounds the wait even when no rank fails loudly."""
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        spawn(_hang, 2, timeout=100, collective_timeout=5)
    assert time.monotonic() - t0 < 40
    assert "rank 0" in str(info.value) or getattr(info.value, "rank", None) == 0


def _save_then_die(rank, world, out):
    import torch.distributed.checkpoint as dcp

    from fmoe.checkpoint import training as ckpt
    from fmoe.optim.adamw import init as adamw_init
    mesh = fmoe.Mesh(tp=2)
    params = fmoe.shard({"w": torch.arange(16.0).view(4, 4), "v": torch.ones(4)},
                        Plan({"w": P("tp", None, packed=2)}, default=P()), mesh)
    layout = {"w": (2, 0)}
    ckpt.save(out, 1, params, adamw_init(params), {"note": "good"}, layout)
    real = dcp.save

    def dying_save(*a, **k):                            # the shards are written, the rename never happens
        real(*a, **k)
        os._exit(9)

    dcp.save = dying_save
    ckpt.save(out, 2, fmoe.shard({"w": torch.zeros(4, 4), "v": torch.zeros(4)},
                                  Plan({"w": P("tp", None, packed=2)}, default=P()), mesh),
              adamw_init(params), {"note": "bad"}, layout)


def _load_latest(rank, world, out):
    from fmoe.checkpoint import training as ckpt
    from fmoe.optim.adamw import init as adamw_init
    path = ckpt.latest(out)
    params = {"w": torch.zeros(4, 4), "v": torch.zeros(4)}
    meta = ckpt.load(path, params, adamw_init(params), {"w": (2, 0)})
    return os.path.basename(path), meta["note"], params


def test_killed_save_keeps_the_previous_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="died with exit code 9"):
        spawn(_save_then_die, 2, out, timeout=120)
    partial = [n for n in os.listdir(out) if n.startswith(".step-2.tmp-")]
    assert len(partial) == 1                                            # the partial save, hidden
    assert not os.path.exists(os.path.join(out, "step-2"))
    name, note, params = spawn(_load_latest, 1, out)[0]                 # --resume OUT picks step-1
    assert (name, note) == ("step-1", "good")
    assert torch.equal(params["w"], torch.arange(16.0).view(4, 4)) and torch.equal(params["v"], torch.ones(4))
    from fmoe.checkpoint.atomic import remove_stale
    from fmoe.training.outdir import remove_temporaries
    assert remove_stale(os.path.join(out, "step-2")) == partial          # its process is gone: a new save cleans it
    os.makedirs(os.path.join(out, ".step-2.tmp"))                       # the old layout's leftover
    assert remove_temporaries(out) == [".step-2.tmp"]                   # what the next job does under the lock
    assert sorted(os.listdir(out)) == ["step-1"]


def test_same_seed_and_mesh_are_bitwise_reproducible(tmp_path):
    """Two runs of the same job (each on freshly started ranks; the program in this process)."""
    from train_cases import train_cli
    logs = []
    for run in "ab":
        out = str(tmp_path / run)
        train_cli("--model", "qwen3_moe", "--nproc", "2", "--ep", "2", "--steps", "3", "--batch", "2", "--seq", "16",
                  "--out", out, "--quiet")
        with open(os.path.join(out, "log.jsonl")) as f:
            logs.append([(r["loss"], r["grad_norm"], r["expert_load"]) for r in map(json.loads, f)])
        shards = sorted(n for n in os.listdir(os.path.join(out, "step-3")) if n.endswith(".distcp"))
        logs[-1].append([open(os.path.join(out, "step-3", n), "rb").read() for n in shards])
    assert logs[0] == logs[1]
