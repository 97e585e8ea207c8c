"""Shared pieces of the training tests (imported by spawned ranks)."""


import torch

import fmoe
from fmoe.data import TokenStream
from fmoe.fsdp import data_parallel_plan
from fmoe.optim import AdamWConfig, lr_at
from fmoe.optim.adamw import init as adamw_init
from fmoe.training.step import StepConfig, train_step

B, S, STEPS, LR = 2, 16, 3, 3e-3
STEP_CFG = StepConfig(opt=AdamWConfig(weight_decay=0.1, max_grad_norm=0.5))   # clipping active


def corpus():
    return TokenStream.stdlib(max_bytes=200_000)


def model_and_cfg(name, tp=8):
    """The model and the config the CLI uses for ``--preset tiny`` (valid up to tp=8)."""
    from fmoe.models import get
    model = get(name)                                                    # the declared Model
    cfg = model.with_aux_loss(model.preset("tiny", tp), 0.05)           # global load-balance loss on
    return model, cfg


def sharded_for_training(model, cfg, mesh, seed=0):
    """``(params, plan, packed)``: ``model.init(cfg, seed)`` placed by the trainer's plan (model
    plan + data-parallel splits), expert biases frozen, as the main job does."""
    from fmoe.checkpoint.training import packed_layout

    full = fmoe.tree.map_with_path(lambda p, t: t.detach().requires_grad_(not p.endswith("expert_bias")),
                                   model.init(cfg, seed=seed))
    plan = data_parallel_plan(model.plan(cfg), full, mesh)
    return fmoe.shard(full, plan, mesh), plan, packed_layout(plan, full)


def train(name, mesh, steps=STEPS, num_batches=None, cfg=None):
    """Train ``steps`` steps; with ``mesh=None`` one process trains on the union of
    ``num_batches`` batches. Returns (losses, grad norms, gathered params). ``cfg`` replaces
    the preset config."""
    model, preset = model_and_cfg(name)
    cfg = cfg or preset
    full = {k: v for k, v in model.init(cfg, seed=0).items()}
    full = fmoe.tree.map_with_path(lambda p, t: t.detach().requires_grad_(not p.endswith("expert_bias")), full)
    data = corpus()
    if mesh is None:
        mesh_ = fmoe.Mesh()
        params = full
    else:
        mesh_ = mesh
        params = fmoe.shard(full, data_parallel_plan(model.plan(cfg), full, mesh), mesh)
    state = adamw_init(params)
    losses, norms = [], []
    for step in range(1, steps + 1):
        if mesh is None:
            parts = [data.batch(step, b, B, S, seed=0) for b in range(num_batches)]
            batch = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        else:
            batch = data.batch(step, mesh.batch_index, B, S, seed=0)
        params, state, m = train_step(model, cfg, params, state, batch, mesh=mesh_, step_cfg=STEP_CFG,
                                      lr=lr_at(step, LR, 1, steps))
        losses.append(m["loss"] + m.get("load_balance_loss", 0.0))
        norms.append(m["grad_norm"])
    return losses, norms, {k: v.detach() for k, v in fmoe.tree.flatten(fmoe.gather(params)).items()}


def train_cli(*args, env=None, check=True, timeout=900):
    """``fmoe train *args``: in this process (the program's own ``main``: its parser, its exit codes,
    its one-line errors), or with ``env`` (added to the environment) in a ``python -m fmoe train``
    subprocess; with ``check`` the run must succeed. Returns ``returncode``, ``stdout``, ``stderr``."""
    import contextlib
    import io
    import os
    import subprocess
    import sys
    import types

    if env is not None:
        out = subprocess.run([sys.executable, "-m", "fmoe", "train", *args], capture_output=True, text=True,
                             timeout=timeout, env={**os.environ, **env})
    else:
        from fmoe.cli.train import main

        threads, stdout, stderr = torch.get_num_threads(), io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as e:          # a usage error
                code = e.code
            finally:
                torch.set_num_threads(threads)    # the job sets its own; the test process keeps its
        out = types.SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())
    if check:
        assert out.returncode == 0, out.stderr[-4000:]
    return out


def read_log(out_dir):
    """The rows of ``OUT/log.jsonl``."""
    import json
    import os

    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]
