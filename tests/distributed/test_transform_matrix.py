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
#: train step is compiled by Inductor in test_compile.py (the job's step, fp32). compile(forward) has no
#: Inductor cell here: Inductor compiles a forward in every cell above (the forward inside grad and the
#: step) and test_transforms.py's bf16 compile(forward) of Qwen3-MoE (27 s of the suite saved).
INDUCTOR = {"compile(grad)": "qwen3_moe", "compiled step": "llama"}


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
           "compile(grad), no fullgraph", "compiled step", "compiled step, no fullgraph", "remat under grad"]
TRANSFORMS = list(dict.fromkeys(ONE_PROCESS + ON_MESH))
#: mesh cells run for some models only (the refusal and its eager fallback happen in the decoder's
#: ``start``, before any layer: model-independent; the MoE model runs on every mesh, the dense one on fsdp)
SOME_MODELS = {"compile(forward)": COMPILED_ON_MESH,
               "compile(grad), no fullgraph": {"tp1/ep4": ("qwen3_moe",), "tp2/ep2": ("qwen3_moe",),
                                               "fsdp (tp2/ep2, fsdp2)": ("qwen3_moe", "llama")},
               "compiled step, no fullgraph": {"tp1/ep4": ("qwen3_moe",), "tp2/ep2": (), "fsdp (tp2/ep2, fsdp2)": ("llama",)}}
CELLS = [(t, s, m) for t in TRANSFORMS for s in SETTINGS for m in MODELS
         if t in (ONE_PROCESS if s == ONE else ON_MESH)
         and (s == ONE or t not in SOME_MODELS or m in SOME_MODELS[t][s])]
#: forced routings of tp1/ep4's qwen3_moe compile cells (:func:`forced_table`): the rows each expert rank
#: receives send each grouped-operator kernel path down on some rank: aligned rows (torch._grouped_mm),
#: unaligned rows (the loop), no rows (empty expert slices), every row on one rank
FORCED = ("skewed", "one rank")
FORCED_MODEL, FORCED_MESH = "qwen3_moe", "tp1/ep4"


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


def _outcome(cell, fn) -> tuple[str, Any]:
    """Run one cell: ``(kind, None)`` when it meets its documented outcome, else ``(kind, message)``;
    the kind (``"as documented"``, ``"raised <type>"``, ``"returned normally"``) is what ranks vote on."""
    want = outcome(*cell)
    try:
        fn()
    except Exception as e:                                   # noqa: BLE001  (the outcome decides)
        if want != "equal" and isinstance(e, want[0]) and re.search(want[1], str(e)):
            return "as documented", None
        return f"raised {type(e).__name__}", f"{cell}: expected {want}, raised {type(e).__name__}: {str(e)[:300]}"
    if want == "equal":
        return "as documented", None
    return "returned normally", f"{cell}: expected {want[0].__name__}, returned normally"


def _check(cell, fn):
    """Run one cell; ``None`` when it meets its documented outcome, else a message."""
    return _outcome(cell, fn)[1]


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
def forced_table(kind: str, source: int, t: int = 2 * S) -> torch.Tensor:
    """Expert ids ``[t, 2]`` of the tokens of batch (rank) ``source`` under a forced routing, 8 experts
    on 4 expert ranks (2 each). ``"one rank"``: every slot on rank 0's experts (rank 0 receives all
    80 assignments, the others none). ``"skewed"``: slot 0 on expert 0, slot 1 on expert 2 for the first
    ``source + 1`` tokens, on expert 6 for the rest: ranks 0..3 receive 40 (aligned), 10 and 30
    (unaligned) and 0 (empty slices) assignments (:func:`received`)."""
    ids = torch.zeros(t, 2, dtype=torch.long)
    ids[:, 1] = 1 if kind == "one rank" else torch.where(torch.arange(t) <= source, 2, 6)
    return ids


def received(kind: str, ranks: int = 4, local: int = 2) -> list[int]:
    """Assignments each expert rank receives under the forced routing ``kind``."""
    ids = torch.cat([forced_table(kind, q) for q in range(ranks)]).flatten()
    return torch.bincount(torch.div(ids, local, rounding_mode="floor"), minlength=ranks).tolist()


def forced_router(cfg, table: torch.Tensor, use: torch.Tensor):
    """The model's router, or (``use``, a 0-dim bool tensor) the ids of ``table`` with the softmax
    weights of those experts: one compiled graph serves the free and every forced routing (the
    tensors are inputs of the graph, changed in place between calls)."""
    from fmoe.routing import Routing
    free = MODELS[FORCED_MODEL].default_router(cfg)

    def router(logits):
        r = free(logits)
        ids = torch.where(use, table, r.expert_ids)
        w = torch.where(use, torch.softmax(logits.float(), -1).gather(-1, ids).to(r.weights.dtype), r.weights)
        return Routing(w, ids, r.aux)
    return router


#: seconds a rank waits for the others' votes on a cell, beyond twice its own time on the cell
VOTE_WAIT = 10.0


def vote(index: int, cell: tuple, outcome: str, seconds: float, base: float = VOTE_WAIT) -> None:
    """Every rank's outcome of ``cell`` must be this rank's ``outcome`` (``kind|detail``: the kinds
    are compared). The ranks vote through the default group's store, not a collective, so a rank
    stuck in a collective that its peer left cannot hang the vote: AssertionError naming the cell
    and every rank's outcome when the kinds differ, or when a rank has not ended the cell within
    ``base + 2 * seconds`` (``seconds``: this rank's time on the cell). ``index``: the cell's
    position in the call (every rank runs the same cells in the same order)."""
    import datetime

    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = [f"vote/{index}/{r}" for r in range(world)]
    store.set(keys[rank], outcome)
    wait = base + 2 * seconds
    try:
        store.wait(keys, datetime.timedelta(seconds=wait))
    except RuntimeError:                                      # DistStoreError: a rank did not vote in time
        ended = {r: store.get(k).decode() for r, k in enumerate(keys) if store.check([k])}
        late = [r for r in range(world) if r not in ended]
        raise AssertionError(f"{cell}: ranks {late} did not end the cell within {wait:.0f} s of rank {rank} "
                             f"(stuck in a collective?); " + "; ".join(f"rank {r} ended: {v}" for r, v in ended.items())
                             ) from None
    votes = [store.get(k).decode() for k in keys]
    if len({v.split("|")[0] for v in votes}) > 1:
        raise AssertionError(f"{cell}: the ranks ended differently: " + "; ".join(f"rank {r}: {v}" for r, v in enumerate(votes)))


def _voted(index: int, cell: tuple, fn: Callable[[], None], base: float = VOTE_WAIT) -> Any:
    """:func:`_outcome` of ``cell`` on this rank, then :func:`vote` on its outcome; the failure message or None."""
    import time
    start = time.monotonic()
    kind, failure = _outcome(cell, fn)
    vote(index, cell, f"{kind}|{failure or ''}"[:2000], time.monotonic() - start, base)
    return failure


def _mesh_of(setting):
    if setting == "tp1/ep4":
        return fmoe.Mesh(tp=1, ep=4), False
    return fmoe.Mesh(tp=2, ep=2), setting.startswith("fsdp")


def _mesh_cells(rank, world, setting):
    import itertools

    from fmoe.fsdp import data_parallel_plan
    mesh, fsdp = _mesh_of(setting)
    fails, index = [], itertools.count()
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
        forced = name == FORCED_MODEL and setting == FORCED_MESH

        def routed_grad(kind):
            """Under the forced routing ``kind``: the gathered gradient of ``torch.compile(grad)`` on the
            mesh (the eager fallback) and the one-process gradient of the summed batches, each batch
            routed as its rank routes it."""
            def f(p, toks, source=None):
                r = forced_router(cfg, forced_table(kind, mesh.batch_index if source is None else source), torch.tensor(True))
                logits = model.forward(p, toks, cfg, mesh if source is None else None, router=r)
                return nn.cross_entropy(logits[:, :-1], toks[:, 1:])
            got = fmoe.gather(torch.compile(grad(lambda p: f(p, mine)), backend="aot_eager")(sh))
            return got, grad(lambda p: sum(f(p, t, b) for b, t in enumerate(every)))(full)

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
            elif transform == "compile(forward)" and forced:   # one graph, every routing (no recompile)
                from torch._dynamo.utils import counters
                torch._dynamo.reset()
                counters.clear()
                table, use = forced_table("skewed", mesh.batch_index), torch.tensor(False)   # graph inputs
                router = forced_router(cfg, table, use)
                fwd = lambda p: model.forward(p, mine, cfg, mesh, router=router)  # noqa: E731
                compiled = torch.compile(fwd, fullgraph=True, backend="aot_eager")
                for kind in ("free", *FORCED):
                    use.fill_(kind != "free")
                    table.copy_(forced_table(kind if kind != "free" else "skewed", mesh.batch_index))
                    with fmoe.transforms.symbolic_splits():
                        got = compiled(sh)
                    close_trees(got, fwd(sh), f"compiled forward vs eager on the mesh, {kind} routing", 1e-5)
                assert counters["stats"]["unique_graphs"] == 1, f"graphs: {dict(counters['stats'])} (one per rank)"
            elif transform == "compile(forward)":      # one graph: the split sizes traced as unbacked ints
                torch._dynamo.reset()                  # (fsdp: Dynamo breaks at the FSDP gather's autograd Function)
                fwd = lambda p: model.forward(p, mine, cfg, mesh)  # noqa: E731
                with fmoe.transforms.symbolic_splits():
                    got = torch.compile(fwd, fullgraph=not fsdp, backend="aot_eager")(sh)
                close_trees(got, fwd(sh), "compiled forward vs eager on the mesh", 1e-5)
            elif transform == "compile(grad)":
                torch._dynamo.reset()
                torch.compile(grad(loss), fullgraph=True, backend="aot_eager")(sh)
            elif transform == "compile(grad), no fullgraph":   # the eager fallback: = the one-process gradient
                torch._dynamo.reset()
                for kind in FORCED if forced else ("free",):
                    got, want = routed_grad(kind) if forced else (
                        fmoe.gather(torch.compile(grad(loss), backend="aot_eager")(sh)), ref_grad)
                    close_trees(got, want, f"compiled grad (eager fallback) vs one process, {kind} routing", 1e-4)
            elif transform in ("compiled step", "compiled step, no fullgraph"):
                torch._dynamo.reset()
                step = lambda p, s: adamw.update(grad(loss)(p), s, p, lr=1e-2)  # noqa: E731
                got = torch.compile(step, fullgraph=transform == "compiled step", backend="aot_eager")(sh, adamw.init(sh))
                close_trees(fmoe.gather(got[0]), fmoe.gather(step(sh, adamw.init(sh))[0]),
                            "compiled step (eager fallback) vs eager on the mesh", 1e-5)
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
            f = _voted(next(index), (transform, setting, name), lambda: run(transform))
            if f:
                fails.append(f)
    return fails


@pytest.mark.parametrize("setting", MESHES)
def test_mesh_cells(setting):
    from helpers import on_ranks
    for rank, fails in enumerate(on_ranks(_mesh_cells, 4, setting, timeout=1500)):
        assert fails == [], f"rank {rank}: " + "\n".join(fails)


def _issue_snippet(rank, world):
    """Issue 46's snippet, as a new user wrote it (Inductor, the default backend), then with
    ``fullgraph=True``; each ends with a vote."""
    from fmoe.models import qwen3_moe as Q
    cfg = Q.Config.tiny(initializer_range=0.2)
    full = Q.init(cfg, 0)
    T = [torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(100 + b)) for b in range(4)]
    mesh = fmoe.Mesh(tp=1, ep=4)
    sh = Q.shard(full, cfg, mesh)
    t = T[mesh.batch_index]
    loss = lambda q: nn.cross_entropy(Q.forward(q, t, cfg, mesh)[:, :-1], t[:, 1:])  # noqa: E731
    ref = grad(lambda p: sum(nn.cross_entropy(Q.forward(p, x, cfg)[:, :-1], x[:, 1:]) for x in T))(full)
    cells = {"compile(grad), no fullgraph": lambda: close_trees(fmoe.gather(torch.compile(grad(loss))(sh)), ref,
                                                                "the issue's compiled grad vs one process", 1e-4),
             "compile(grad)": lambda: torch.compile(grad(loss), fullgraph=True)(sh)}
    fails = [_voted(i, (transform, "tp1/ep4", "qwen3_moe"), fn) for i, (transform, fn) in enumerate(cells.items())]
    return [f for f in fails if f]


def test_the_issue_snippet_ends_alike_on_every_rank():
    """``torch.compile(grad(loss))`` over a sharded qwen3_moe on tp1/ep4 (issue 46: three ranks
    entered the combine all-to-all, rank 2 raised alone, tracing its experts' kernel): on every rank
    the documented eager fallback, equal to the one-process gradient; with ``fullgraph=True`` the
    documented error on every rank."""
    from helpers import on_ranks
    for rank, fails in enumerate(on_ranks(_issue_snippet, 4, timeout=600)):
        assert fails == [], f"rank {rank}: {fails}"


def _planted(rank, world, stuck):
    """A cell every rank passes, then one where the last rank raises an undocumented error (before
    the all-reduce its peers enter, with ``stuck``: they wait in it forever)."""
    import torch.distributed as dist

    def fine():
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world

    def planted():
        if rank == world - 1:
            raise RuntimeError("a planted one-rank error")
        if stuck:
            dist.all_reduce(torch.ones(1))
    _voted(0, ("grad", "tp1/ep4", "planted, all alike"), fine, base=2.0)      # a 2 s wait: the test's time
    _voted(1, ("grad", "tp1/ep4", "planted, one rank raises"), planted, base=2.0)


@pytest.mark.parametrize("stuck", [False, True], ids=["peers-end", "peers-stuck"])
def test_the_vote_fails_a_planted_one_rank_error(stuck):
    """The vote ending each mesh cell fails a one-rank error within seconds, naming the rank and the
    cell, whether the other ranks end the cell (their outcome differs) or wait in a collective the
    failing rank left (they never vote: the failing rank's wait runs out)."""
    import time

    from helpers import on_ranks
    start = time.monotonic()
    with pytest.raises(AssertionError) as e:
        on_ranks(_planted, 4, stuck, timeout=120)
    took, msg = time.monotonic() - start, str(e.value)
    assert "'planted, one rank raises'" in msg and "rank 3" in msg and "a planted one-rank error" in msg, msg
    assert ("ranks [0, 1, 2] did not end the cell" if stuck else "the ranks ended differently") in msg, msg
    assert took < 30, f"the vote took {took:.0f} s"


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
