"""Shared pieces of the balancing tests (imported by spawned ranks): one run of the trainer's
step with the balancing settings the CLI resolves, on a mesh or on one process."""

import argparse
import importlib

import torch

import fmoe
from fmoe.fsdp import data_parallel_plan
from fmoe.model import model_of
from fmoe.models import SHIPPED
from fmoe.training import balancing
from fmoe.optim import AdamWConfig, lr_at
from fmoe.optim.adamw import init as adamw_init
from fmoe.training.step import StepConfig, train_step
from train_cases import corpus

B, S, LR = 2, 16, 3e-3


def settings(model, balance, **flags):
    """The resolved balancing flags of a run (as ``fmoe train`` resolves them)."""
    args = argparse.Namespace(model=model, balance=balance, aux_weight=flags.get("aux_weight", 0.05),
                              z_weight=flags.get("z_weight"), bias_rate=flags.get("bias_rate"),
                              bias_update=flags.get("bias_update"), router=flags.get("router"), seq=S,
                              export_hf=None, explicit=set(flags) | {"balance"})

    def error(msg):
        raise ValueError(msg)

    balancing.resolve(args, error, dict(SHIPPED))
    return args


def run(name, args, mesh, steps=2, grad_accum=1, num_batches=None, rows=B):
    """Train ``steps`` steps of ``rows`` rows per batch in ``grad_accum`` micro-batches; ``mesh=None``:
    one process on the union of ``num_batches`` batches. Returns (losses incl. aux terms, grad
    norms, gathered params, metrics)."""

    model = importlib.import_module(f"fmoe.models.{name}")
    cfg = model_of(model).with_aux_loss(model_of(model).preset("tiny", 2), 0.0)
    full = balancing.with_expert_bias(model.init(cfg, seed=0), args)
    full = fmoe.tree.map_with_path(lambda p, t: t.detach().requires_grad_(not p.endswith("expert_bias")), full)
    mesh_ = fmoe.Mesh() if mesh is None else mesh
    params = full if mesh is None else fmoe.shard(full, data_parallel_plan(model.plan(cfg), full, mesh), mesh)
    step_cfg = StepConfig(opt=AdamWConfig(weight_decay=0.1, max_grad_norm=0.5),
                          grad_accum=grad_accum,
                          **balancing.step_options(args, cfg, {}, model_of(model)))
    state = adamw_init(params)
    data = corpus()
    losses, norms, metrics = [], [], []
    for step in range(1, steps + 1):
        if mesh is None:
            parts = [data.batch(step, b, rows, S, seed=0) for b in range(num_batches)]
            batch = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        else:
            batch = data.batch(step, mesh.batch_index, rows, S, seed=0)
        params, state, m = train_step(model, cfg, params, state, batch, mesh=mesh_, step_cfg=step_cfg,
                                      lr=lr_at(step, LR, 1, steps))
        losses.append(m["loss"] + sum(v for k, v in m.items() if k.endswith("_loss")))
        norms.append(m["grad_norm"])
        metrics.append(m)
    return losses, norms, {k: v.detach() for k, v in fmoe.tree.flatten(fmoe.gather(params)).items()}, metrics
