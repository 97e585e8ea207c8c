"""The transform matrix: every transform x setting x model cell equals an independent reference
or raises its documented error. The table of ``docs/transforms.md`` is generated from ``CELLS`` below
(``python tests/distributed/test_transform_matrix.py`` prints it; a test checks the page holds it verbatim).

References (each independent of the transform under test):
- one process, float64: central differences (``grad``, ``vjp``, ``jvp``, both HVPs along a random
  direction), ``jacrev`` (``jacfwd``), a Python loop (the ``vmap`` cells), eager (the compiled cells,
  fp32 / fp64 for the whole step);
- meshes (4 gloo ranks, fp32): the one-process result on full parameters (gradients: of the sum
  of the distinct batches' losses), eager for the compiled cells.

A cell's outcome is ``"equal"`` or ``(ExceptionType, regex)``. The distributed cells run in one
spawn per mesh (all models and transforms of that mesh in one set of ranks).
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable

import pytest
import torch
from torch.func import grad, grad_and_value, jacfwd, jacrev, jvp, vjp, vmap

import fmoe
import fmoe.nn as nn
from fmoe.models import deepseek_v3, gpt_oss, llama, mixtral, qwen3_moe
from fmoe.optim import adamw
from helpers import close

MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "gpt_oss": gpt_oss, "llama": llama, "deepseek_v3": deepseek_v3}
ONE, MESHES = "one process", ["tp1/ep4", "tp2/ep2", "fsdp (tp2/ep2, fsdp2)"]
SETTINGS = [ONE] + MESHES
B, S = 3, 5

NESTED = (NotImplementedError, "inside another torch.func transform .* not supported on a mesh")
VMAP_EP = (NotImplementedError, r"vmap over fmoe.moe with expert parallelism .* not supported")
REMAT = (NotImplementedError, r"remat policy under a torch.func transform .* not supported on a mesh")
STACKED = (NotImplementedError, r"vmap over stacked sharded \(DTensor\) parameter trees .* not supported on a mesh")
TANGENTS = (NotImplementedError, r"jacfwd \(or vmap over torch.func.jvp tangents\) of sharded .* not supported on a mesh")
# Dynamo wraps the error the layer raises while tracing (its text is kept in the message)
COMPILED = (torch._dynamo.exc.Unsupported, r"compile of a torch.func transform .* on a mesh .* not supported")
#: The compile cells run Dynamo + AOTAutograd (``backend="aot_eager"``: where fmoe's own tracing
#: bugs live); Inductor (code generation, the C++ compiler: most of a compiled cell's time) runs
#: for one model per compiled transform, here (the others are listed in docs/transforms.md).
#: Cold Inductor compiles of each cell alone (2026-12-05, load ~4): compiled step qwen3_moe 114 s,
#: llama 40 s; compile(grad) deepseek_v3 59 s, qwen3_moe 31 s: the MoE model's grad (its grouped
#: operators' backward) and the dense model's optimizer step, at a third of the cost. The MoE
#: train step is compiled by Inductor in test_compile.py (the job's step, fp32).
INDUCTOR = {"compile(forward)": "llama", "compile(grad)": "qwen3_moe", "compiled step": "llama"}


def backend(transform: str, model: str) -> str:
    """The ``torch.compile`` backend of a one-process compile cell."""
    return "inductor" if INDUCTOR.get(transform) == model else "aot_eager"


#: torch.compile on a mesh costs 7-17 s of Dynamo tracing per model and mesh on 2 cores (4 ranks), so
#: compile(forward) runs for one MoE and one dense model on meshes (the cells list them). It runs
#: under ``fmoe.transforms.symbolic_splits()``, with ``fullgraph=True`` on the tp/ep meshes: one graph, the
#: exchange's split sizes traced as unbacked ints (without it Dynamo breaks the graph there:
#: test_transforms.py). On the fsdp mesh Dynamo breaks at the FSDP gather (``fmoe.fsdp._GatherLayer``: its
#: traced forward gets a list where the DTensor leaves should be), so that cell is not fullgraph
COMPILED_ON_MESH = {"tp1/ep4": ("qwen3_moe",), "tp2/ep2": ("qwen3_moe", "llama"), "fsdp (tp2/ep2, fsdp2)": ("llama",)}


def outcome(transform: str, setting: str, model: str) -> Any:
    """The documented outcome of one cell."""
    if setting == ONE:
        return "equal"
    if model != "llama" and (transform == "vmap(grad)" or (transform in ("vmap(forward)", "jacfwd") and setting == "tp1/ep4")):
        return VMAP_EP      # the all_to_all dispatch refuses first (tp2/ep2's forward runs all_reduce)
    if transform in ("vmap(grad)", "hvp rev-over-rev", "hvp fwd-over-rev"):
        return NESTED
    return {"vmap ensemble": STACKED, "jacfwd": TANGENTS, "compile(grad)": COMPILED,
            "compiled step": COMPILED, "remat under grad": REMAT}.get(transform, "equal")


ONE_PROCESS = ["grad", "vjp", "jvp", "jacfwd", "hvp fwd-over-rev", "hvp rev-over-rev", "vmap(forward)",
               "vmap(grad)", "vmap ensemble", "compile(forward)", "compile(grad)", "compiled step",
               "remat under grad"]
ON_MESH = ["grad", "vjp", "jvp", "jacfwd", "hvp fwd-over-rev", "grad arithmetic", "hvp rev-over-rev",
           "vmap(forward)", "vmap(grad)", "vmap ensemble", "compile(forward)", "compile(grad)",
           "compiled step", "remat under grad"]
TRANSFORMS = list(dict.fromkeys(ONE_PROCESS + ON_MESH))
CELLS = [(t, s, m) for t in TRANSFORMS for s in SETTINGS for m in MODELS
         if t in (ONE_PROCESS if s == ONE else ON_MESH)
         and (s == ONE or t != "compile(forward)" or m in COMPILED_ON_MESH[s])]


# ------------------------------------------------------------------------------ helpers
def tokens(cfg, seed=0, b=B):
    return torch.randint(0, cfg.vocab_size, (b, S), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, cfg, toks, mesh=None):
    return lambda p: nn.cross_entropy(model.forward(p, toks, cfg, mesh)[:, :-1], toks[:, 1:])


def tmap(fn, *trees):
    return fmoe.tree.map_with_path(lambda _, *xs: fn(*xs), *trees)


def dot(a, b) -> torch.Tensor:
    fa, fb = fmoe.tree.flatten(a), fmoe.tree.flatten(b)
    return sum((fa[k] * fb[k]).sum() for k in fa)


def close_trees(got, want, what, rtol):
    """Every leaf of ``got`` equals ``want``'s (tensors or trees of them) by ``helpers.close`` at
    ``rtol``, an element that cancels allowed ``rtol`` of the leaf's scale."""
    fg, fw = fmoe.tree.flatten(got) if isinstance(got, dict) else {"": got}, \
        fmoe.tree.flatten(want) if isinstance(want, dict) else {"": want}
    assert set(fg) == set(fw), what
    for k in fw:
        close(fg[k], fw[k], f"{what} {k}", rtol=rtol, atol=rtol)


def fd(f, p, t, h=1e-6):
    """Central difference of ``f`` (tensor or tree valued) at ``p`` along ``t`` (float64)."""
    hi, lo = f(tmap(lambda a, b: a + h * b, p, t)), f(tmap(lambda a, b: a - h * b, p, t))
    return tmap(lambda a, b: (a - b) / (2 * h), hi, lo) if isinstance(hi, dict) else (hi - lo) / (2 * h)


def _check(cell, fn):
    """Run one cell; ``None`` when it meets its documented outcome, else a message."""
    want = outcome(*cell)
    try:
        fn()
    except Exception as e:                                   # noqa: BLE001  (the outcome decides)
        if want != "equal" and isinstance(e, want[0]) and re.search(want[1], str(e)):
            return None
        return f"{cell}: expected {want}, raised {type(e).__name__}: {str(e)[:300]}"
    return None if want == "equal" else f"{cell}: expected {want[0].__name__}, returned normally"


# ------------------------------------------------------------------------------ one process
def one_process_cell(transform: str, name: str) -> Callable[[], None]:
    model = MODELS[name]
    cfg = model.Config.tiny()
    p64 = tmap(lambda t: t.double(), model.init(cfg, seed=0))
    toks = tokens(cfg)
    loss = lm_loss(model, cfg, toks)
    tan = tmap(lambda t: torch.randn(t.shape, dtype=t.dtype, generator=torch.Generator().manual_seed(t.numel())), p64)

    def run():
        if transform == "grad":
            close_trees(dot(grad(loss)(p64), tan), fd(loss, p64, tan), "grad . t vs central differences", 1e-6)
        elif transform == "vjp":
            _, fn = vjp(loss, p64)
            close_trees(dot(fn(torch.ones((), dtype=torch.float64))[0], tan), fd(loss, p64, tan), "vjp", 1e-6)
        elif transform == "jvp":
            close_trees(jvp(loss, (p64,), (tan,))[1], fd(loss, p64, tan), "jvp vs central differences", 1e-6)
        elif transform == "jacfwd":
            f = lambda w: model.forward({**p64, "norm": w}, toks, cfg)[0, -1]  # noqa: E731  [V] of [D]
            close_trees(jacfwd(f)(p64["norm"]), jacrev(f)(p64["norm"]), "jacfwd vs jacrev", 1e-9)
        elif transform == "hvp fwd-over-rev":
            close_trees(jvp(grad(loss), (p64,), (tan,))[1], fd(grad(loss), p64, tan), "jvp(grad) vs differences of grad", 1e-4)
        elif transform == "hvp rev-over-rev":
            hv = grad(lambda q: dot(grad(loss)(q), tan))(p64)
            close_trees(hv, fd(grad(loss), p64, tan), "grad(grad . t) vs differences of grad", 1e-4)
        elif transform == "vmap(forward)":
            fwd = lambda t: model.forward(p64, t[None], cfg)[0]  # noqa: E731
            close_trees(vmap(fwd)(toks), torch.stack([fwd(t) for t in toks]), "vmap(forward) vs a loop", 1e-10)
        elif transform == "vmap(grad)":
            per = grad(lambda p, t: lm_loss(model, cfg, t[None])(p))
            got = vmap(per, in_dims=(None, 0))(p64, toks)
            want = [per(p64, t) for t in toks]
            close_trees(got, tmap(lambda *xs: torch.stack(xs), *want), "vmap(grad) vs a loop", 1e-10)
        elif transform == "vmap ensemble":
            trees = [p64, tmap(lambda a, b: a + 0.01 * b, p64, tan)]
            stacked = tmap(lambda *xs: torch.stack(xs), *trees)
            fwd = lambda p: model.forward(p, toks, cfg)  # noqa: E731
            close_trees(vmap(fwd)(stacked), torch.stack([fwd(t) for t in trees]), "ensemble vs a loop", 1e-10)
        elif transform == "compile(forward)":
            torch._dynamo.reset()
            p32 = model.init(cfg, seed=0)
            fwd = lambda p: model.forward(p, toks, cfg)  # noqa: E731
            close_trees(torch.compile(fwd, fullgraph=True, backend=backend(transform, name))(p32), fwd(p32),
                  "compiled forward vs eager", 1e-5)
        elif transform == "compile(grad)":
            torch._dynamo.reset()
            p32 = model.init(cfg, seed=0)
            close_trees(torch.compile(grad(loss), fullgraph=True, backend=backend(transform, name))(p32), grad(loss)(p32),
                  "compiled grad vs eager", 1e-5)
        elif transform == "compiled step":
            torch._dynamo.reset()

            def step(p, s):
                g, value = grad_and_value(loss)(p)
                p, s = adamw.update(g, s, p, lr=1e-2)
                return p, s, value

            def train(f):
                p, s = p64, adamw.init(p64)
                for _ in range(3):
                    p, s, _ = f(p, s)
                return p
            # float64 end to end (rope tables included), so compiled and eager gradients differ in the
            # last bits only (measured 2e-15 relative); Adam's per-entry normalisation
            # lr m / (sqrt(v) + eps) amplifies a relative gradient error d by at most
            # lr / eps * |g| d ~ 1e6 * 1e-2 * 1e-15 = 1e-11 per step; the bug this cell guards
            # (zero expert gradients) was 1e-1, a float32 rope table was 1e-4
            got, want = train(torch.compile(step, fullgraph=True, backend=backend(transform, name))), train(step)
            start = fmoe.tree.flatten(p64)          # every trained leaf moves (expert_bias has no gradient)
            moved = {k: (w - start[k]).abs().max().item() for k, w in fmoe.tree.flatten(want).items()
                     if not k.endswith("expert_bias")}
            assert min(moved.values()) > 1e-3, f"a leaf did not move (zero gradient?): {moved}"
            close_trees(got, want, "compiled AdamW step vs eager", 1e-8)
        elif transform == "remat under grad":      # recomputed by torch.func.vjp in backward
            with fmoe.nn.remat.policy("layer"):
                got = grad(loss)(p64)
            close_trees(got, grad(loss)(p64), "grad with remat vs without", 1e-10)
    return run


@pytest.mark.parametrize("transform,name", [(t, m) for (t, s, m) in CELLS if s == ONE])
def test_one_process_cell(transform, name):
    failure = _check((transform, ONE, name), one_process_cell(transform, name))
    assert failure is None, failure


# ------------------------------------------------------------------------------ meshes
def _mesh_of(setting):
    if setting == "tp1/ep4":
        return fmoe.Mesh(tp=1, ep=4), False
    return fmoe.Mesh(tp=2, ep=2), setting.startswith("fsdp")


def _mesh_cells(rank, world, setting):
    from fmoe.fsdp import data_parallel_plan
    mesh, fsdp = _mesh_of(setting)
    fails = []
    for name, model in MODELS.items():
        cfg = model.Config.tiny()
        full = model.init(cfg, seed=0)
        plan = model.plan(cfg)
        pl = data_parallel_plan(plan, full, mesh) if fsdp else plan
        sh = fmoe.shard(full, pl, mesh)
        nb = mesh.num_batches
        mine = tokens(cfg, seed=10 + mesh.batch_index, b=2)
        loss = lm_loss(model, cfg, mine, mesh)
        every = [tokens(cfg, seed=10 + b, b=2) for b in range(nb)]
        ref_grad = grad(lambda p: sum(lm_loss(model, cfg, t)(p) for t in every))(full)

        def run(transform):
            if transform == "grad":
                close_trees(fmoe.gather(grad(loss)(sh)), ref_grad, "gathered grad vs one process", 1e-4)
            elif transform == "vjp":
                _, fn = vjp(loss, sh)
                close_trees(fmoe.gather(fn(torch.ones(()))[0]), ref_grad, "gathered vjp vs one process", 1e-4)
            elif transform == "jvp":
                t_full = tmap(lambda t: torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())), full)
                got = jvp(loss, (sh,), (fmoe.shard(t_full, pl, mesh),))
                close_trees(torch.stack(got), torch.stack(jvp(lm_loss(model, cfg, mine), (full,), (t_full,))),
                      "jvp (this rank's loss and its tangent) vs one process", 1e-5)
            elif transform == "jacfwd":
                jacfwd(lambda w: model.forward({**sh, "norm": w}, mine, cfg, mesh)[0, -1])(sh["norm"])
            elif transform == "hvp fwd-over-rev":
                jvp(grad(loss), (sh,), (sh,))
            elif transform == "vmap ensemble":
                vmap(lambda p: model.forward(p, mine, cfg, mesh))(tmap(lambda *xs: torch.stack(xs), sh, sh))
            elif transform == "compile(forward)":      # one graph: the split sizes traced as unbacked ints
                torch._dynamo.reset()                  # (fsdp: Dynamo breaks at the FSDP gather's autograd Function)
                fwd = lambda p: model.forward(p, mine, cfg, mesh)  # noqa: E731
                with fmoe.transforms.symbolic_splits():
                    got = torch.compile(fwd, fullgraph=not fsdp, backend="aot_eager")(sh)
                close_trees(got, fwd(sh), "compiled forward vs eager on the mesh", 1e-5)
            elif transform == "compile(grad)":
                torch._dynamo.reset()
                torch.compile(grad(loss), fullgraph=True, backend="aot_eager")(sh)
            elif transform == "compiled step":
                torch._dynamo.reset()
                torch.compile(lambda p, s: adamw.update(grad(loss)(p), s, p, lr=1e-2), fullgraph=True,
                              backend="aot_eager")(sh, adamw.init(sh))
            elif transform == "grad arithmetic":
                g = grad(loss)(sh)
                new = tmap(lambda p, g: p - 0.1 * g + (g + g) * 0.0, sh, g)
                close_trees(fmoe.gather(new), tmap(lambda p, g: p - 0.1 * g, full, ref_grad), "SGD on sharded grads", 1e-4)
            elif transform == "hvp rev-over-rev":
                grad(lambda q: sum((g.to_local() if hasattr(g, "to_local") else g).sum()
                                   for g in fmoe.tree.leaves(grad(loss)(q))))(sh)
            elif transform == "vmap(forward)":
                seqs = tokens(cfg, seed=20 + mesh.batch_index, b=2)
                got = vmap(lambda t: model.forward(sh, t[None], cfg, mesh)[0])(seqs)
                close_trees(got, model.forward(full, seqs, cfg), "vmap(forward) vs one process", 1e-4)
            elif transform == "vmap(grad)":
                vmap(grad(lambda p, t: lm_loss(model, cfg, t[None], mesh)(p)), in_dims=(None, 0))(sh, mine)
            elif transform == "remat under grad":
                with fmoe.nn.remat.policy("layer"):
                    grad(loss)(sh)

        for transform in [t for t in ON_MESH if (t, setting, name) in CELLS]:
            f = _check((transform, setting, name), lambda: run(transform))
            if f:
                fails.append(f)
    return fails


@pytest.mark.parametrize("setting", MESHES)
def test_mesh_cells(setting):
    from helpers import on_ranks
    for rank, fails in enumerate(on_ranks(_mesh_cells, 4, setting, timeout=1500)):
        assert fails == [], f"rank {rank}: " + "\n".join(fails)


# ------------------------------------------------------------------------------ README table
def _mark(o) -> str:
    return "equal" if o == "equal" else f"raises {o[0].__name__}"


def readme_table() -> str:
    """The README's "Transforms" matrix: one row per transform, one column per setting (the cell
    holds for all five models unless it names them)."""
    lines = ["| transform | " + " | ".join(SETTINGS) + " |", "|---|" + "---|" * len(SETTINGS)]
    for t in TRANSFORMS:
        row = []
        for s in SETTINGS:
            per = {m: _mark(outcome(t, s, m)) for m in MODELS if (t, s, m) in CELLS}
            if not per:
                row.append("not run")
                continue
            kinds = sorted(set(per.values()), key=list(per.values()).index)
            if len(kinds) == 1 and len(per) < len(MODELS):
                row.append(f"{kinds[0]} ({', '.join(per)}; the others not run)")
                continue
            row.append(kinds[0] if len(kinds) == 1 else
                       "; ".join(f"{k} ({', '.join(m for m, v in per.items() if v == k)})" for k in kinds))
        lines.append(f"| {t} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def test_readme_transforms_table_is_the_generated_matrix():
    import pathlib
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "transforms.md").read_text()
    assert readme_table() in page, "docs/transforms.md's table is stale: run python tests/distributed/test_transform_matrix.py"


if __name__ == "__main__":
    sys.stdout.write(readme_table() + "\n")
