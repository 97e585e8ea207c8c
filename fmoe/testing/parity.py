"""``assert_parity``: a function of a parameter tree, sharded by a plan on a mesh, equals itself
on one process: outputs and the gathered gradients of every parameter leaf and input.

The check the project writes by hand in its distributed tests, as one call:

1. the one-process reference: ``out = fn(params, inputs, mesh=None)``, then the gradients of
   ``loss = sum(out * probe)`` (``probe``: a fixed random cotangent shaped like ``out``) with
   respect to every parameter leaf and every floating-point input leaf;
2. on each mesh (``"tp2/ep2"``: sizes per axis, ``tp``, ``ep``, ``fsdp``, ``dp`` for
   ``dp_replicate``, and the flag ``sp`` for sequence parallelism: ``"tp2/sp"``), on every rank: ``fmoe.shard(params, plan, mesh)``, this rank's data-parallel
   batch of ``inputs`` (split along dim 0 into ``mesh.num_batches`` pieces, ``torch.tensor_split``;
   TP ranks share one), ``out = fn(sharded, batch, mesh=mesh)``, the same loss on the batch's
   slice of ``probe``, backward, and ``fmoe.gather`` of the parameter gradients (the gradient of
   the sum over the batches, as the one process computes it);
3. every rank compares its output with the reference's slice, each gathered gradient with the
   reference gradient and its input gradients with the reference's slice. A value passes when
   ``max|got - want| <= atol + rtol * max|want|``. Whether to run backward is decided
   **collectively**: when the output differs on any rank (or ``fn`` raised there), no rank runs
   backward (its collectives would wait for the missing rank), so a one-rank difference is an
   ``AssertionError`` within seconds, never a hang or a transport error (the error then says
   that the gradients were not compared).

The ``AssertionError`` lists what differs, worst first (by the ratio of the error to its
tolerance), each line naming the mesh, the rank, the leaf by its dotted path and the gradient's
placement (``fsdp=P(sum)``: each rank held its batch's share). A sharded leaf's gradient is
compared on each rank's own slice (the rank that computed it is named); a replicated leaf's is the
sum of every rank's share, the same everywhere: named once, ``ranks summed``. With ``aux=True``
(:mod:`fmoe.testing.parity_aux`) ``fn`` returns ``(out, aux)``: the router's aux values (per
rank) and the gradients of its aux losses are compared too, each failure naming its key.

**Routers that decide per batch** (switch and expert choice with their capacity, BASE-style
balanced assignment: any function whose result on a token depends on the other tokens of its
batch) see only their data-parallel batch on a mesh, so they equal the one-process run on the
*union* only when the capacity never binds. ``per_batch=True`` makes the reference what such a
layer computes: one process calling ``fn`` on each data-parallel batch in turn (the same
``tensor_split`` pieces the ranks get), outputs concatenated, gradients summed. Top-k routers
decide per token and pass either way.

Example (a test file; any function of a tree works, here one MoE layer)::

    import torch, fmoe
    from fmoe import P

    def layer(params, x, mesh=None):
        return fmoe.moe(params, x, router=fmoe.routing.topk(2), mesh=mesh)[0]

    def test_my_layer():
        g = torch.Generator().manual_seed(0)
        params = {"router": torch.randn(8, 16, generator=g),
                  "w_gate_up": torch.randn(8, 32, 16, generator=g) / 4,
                  "w_down": torch.randn(8, 16, 16, generator=g) / 4}
        plan = fmoe.Plan({"w_*": P("ep", None, None)}, default=P())
        fmoe.testing.assert_parity(layer, params, torch.randn(32, 16, generator=g), plan,
                                   meshes=["tp1/ep4", "tp2/ep2"])
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor

from fmoe import tree as _tree
from fmoe.collectives import sum_over_world
from fmoe.mesh import Mesh, RankLayout
from fmoe.sharding import Plan, gather, placement_of, shard, slice_for_rank
from fmoe.testing import parity_aux as _aux
from fmoe.testing.pool import Pool

__all__ = ["assert_parity", "parse_mesh"]

_AXIS = re.compile(r"^(tp|ep|fsdp|dp)(\d+)$")
_FIELD = {"tp": "tp", "ep": "ep", "fsdp": "fsdp", "dp": "dp_replicate"}


def parse_mesh(spec: str) -> dict[str, int]:
    """``"tp2/ep2"`` -> ``{"tp": 2, "ep": 2}`` (the ``fmoe.Mesh`` keyword arguments; the part
    ``sp`` gives ``sp=True``).

    Example:
        >>> parse_mesh("tp2/ep4/dp2"), parse_mesh("tp2/sp")
        ({'tp': 2, 'ep': 4, 'dp_replicate': 2}, {'tp': 2, 'sp': True})
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"assert_parity: a mesh is a string like 'tp2/ep2', got {spec!r}")
    sizes: dict[str, int] = {}
    for part in spec.split("/"):
        if part == "sp" and "sp" not in sizes:
            sizes["sp"] = True
            continue
        m = _AXIS.match(part)
        if m is None or int(m.group(2)) < 1 or _FIELD[m.group(1)] in sizes:
            raise ValueError(f"assert_parity: mesh {spec!r}: bad part {part!r}; write axis and size "
                             "joined by '/', each of tp, ep, fsdp, dp (dp_replicate) once, e.g. 'tp2/ep2' (and 'sp')")
        sizes[_FIELD[m.group(1)]] = int(m.group(2))
    return sizes


def _implied_world(sizes: dict[str, int]) -> int:
    dp = sizes.get("dp_replicate", 1)
    return max(sizes.get("tp", 1) * sizes.get("fsdp", 1) * dp, sizes.get("ep", 1) * dp)


def assert_parity(fn: Callable[..., torch.Tensor], params: Any, inputs: Any,
                  plan: Union[Plan, Any, Callable[[Mesh], Plan]],
                  meshes: Sequence[str] = ("tp1/ep4", "tp2/ep2"), grads: bool = True,
                  rtol: Optional[float] = None, atol: Optional[float] = None, world: Optional[int] = None,
                  pool: Optional[Pool] = None, timeout: float = 300.0, seed: int = 0,
                  per_batch: bool = False, aux: Union[bool, Sequence[str]] = False) -> None:
    """Assert that ``fn`` on each mesh equals ``fn`` on one process (see the module docstring).

    Args:
        fn: ``fn(params, inputs, mesh=None) -> Tensor`` (plain tensor; cloudpicklable).
        params: tree of full parameter tensors.
        inputs: a tensor or tree of tensors, split over the data-parallel batches along dim 0.
        plan: a ``fmoe.Plan`` (or its rules), or ``plan(mesh) -> Plan``.
        meshes: mesh strings, e.g. ``["tp1/ep4", "tp2/ep2"]``.
        grads: also compare the gradients (of every parameter leaf and floating input).
        rtol: relative tolerance (default ``100 * eps`` of the output's dtype: about 1e-5 in
            float32; enough for sums reordered over a few thousand terms, far below an O(1) bug).
        atol: absolute tolerance (default ``rtol * 1e-3``: leaves whose reference is near zero).
        world: ranks per mesh (default: the largest any mesh implies, e.g. 4 for ``tp1/ep4``).
        pool: a :class:`fmoe.testing.Pool` to run on (default: a pool for this call).
        timeout: seconds per mesh.
        seed: seed of the cotangent ``probe``.
        per_batch: the reference runs ``fn`` on each data-parallel batch of the mesh separately
            (routers that decide per batch; module docstring).
        aux: ``fn`` returns ``(out, aux)``; also compare the aux losses' values and gradients,
            ``load``, ``imbalance`` and ``computed_slots`` (a list: those and the statistics it
            names), each failure naming its key (:mod:`fmoe.testing.parity_aux`).
    Raises:
        AssertionError: naming the worst leaf, its mesh, rank and placement.
        ValueError / TypeError: bad arguments, before any rank starts.
    """
    if not callable(fn):
        raise TypeError(f"assert_parity: fn must be callable, got {type(fn).__name__}")
    if isinstance(meshes, str) or not meshes:
        raise ValueError(f"assert_parity: meshes must be a non-empty list of strings like 'tp2/ep2', got {meshes!r}")
    if aux and per_batch:
        raise ValueError("assert_parity: aux= and per_batch=True exclude each other (per-batch references have no global aux)")
    stats = () if isinstance(aux, bool) else tuple(aux)
    specs = {m: parse_mesh(m) for m in meshes}
    world = world if world is not None else max(_implied_world(s) for s in specs.values())
    for name, sizes in specs.items():
        try:
            RankLayout(world, 0, **sizes)
        except (TypeError, ValueError) as e:
            raise ValueError(f"assert_parity: mesh {name!r} on {world} ranks: {e}") from None
    if not (callable(plan) and not isinstance(plan, Plan)):
        plan = plan if isinstance(plan, Plan) else Plan(plan)
        plan.resolve(params)                      # unknown leaves / globs raise here, not on ranks
    batches = {m: RankLayout(world, 0, **s).num_batches if per_batch else 1 for m, s in specs.items()}
    refs = {n: _reference(fn, params, inputs, grads, seed, n, aux, stats) for n in sorted(set(batches.values()))}
    ref = next(iter(refs.values()))
    shares = {m: _aux.shares(fn, params, inputs, RankLayout(world, 0, **s).num_batches) if aux and grads else None
              for m, s in specs.items()}                  # each batch's share of the aux-loss gradients
    dtype = ref["out"].dtype if ref["out"].is_floating_point() else torch.float32
    rtol = 100 * torch.finfo(dtype).eps if rtol is None else rtol
    atol = rtol * 1e-3 if atol is None else atol
    own = pool is None
    pool = Pool(world) if own else pool
    failures: list = []
    checks = 0
    try:
        for name, sizes in specs.items():
            results = pool.run(_on_rank, fn, params, inputs, plan, sizes, dict(refs[batches[name]], shares=shares[name]),
                               grads, rtol, atol, aux, stats, timeout=timeout, world=world)
            checks += sum(n for n, _ in results)
            lines = {f"{name} (ranks summed): {what}" if "ranks summed" in what else f"{name} rank {r}: {what}": ratio
                     for r, (_, fails) in enumerate(results) for ratio, what in fails}   # a sum: named once
            failures += [(ratio, line) for line, ratio in lines.items()]
    finally:
        if own:
            pool.close()
    if failures:
        failures.sort(key=lambda f: -f[0])
        lines = "\n".join(f"  {w}" for _, w in failures[:20])
        skipped = "" if not any(": output:" in w for _, w in failures) else (
            "\n  (gradients not compared on a mesh whose output differs: no rank ran backward)")
        raise AssertionError(f"assert_parity: {len(failures)} of {checks} checks differ from the one-process "
                             f"run (rtol {rtol:.1e}, atol {atol:.1e}); worst: {failures[0][1]}\n{lines}{skipped}")


def _grads(tree: Any) -> dict[str, Any]:
    return {p: t.grad for p, t in _tree.flatten(tree).items() if t.requires_grad}


def _call(fn, params, inputs, mesh, aux=False) -> Any:
    out, extra = _aux.split(fn(params, inputs, mesh=mesh), aux)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"assert_parity: fn must return a torch.Tensor, got {type(out).__name__}")
    return (out, extra) if aux else out


def _reference(fn, params, inputs, grads, seed, batches: int = 1, aux=False, stats=()) -> dict:
    """The one-process run: output, cotangent probe, gradients of every leaf (zeros if unused);
    with ``batches > 1``, ``fn`` on each of the ``batches`` pieces of the inputs, concatenated;
    with ``aux``, its aux values and each aux loss's gradients."""
    p, x = _aux.leaves(params, grads), _aux.leaves(inputs, grads)
    ref: dict = {}
    if aux:
        out, extra = _call(fn, p, x, None, aux)
        ref.update(_aux.reference(extra, p, stats, grads))
    elif batches == 1:
        out = _call(fn, p, x, None)
    else:
        out = torch.cat([_call(fn, p, _tree.map_with_path(lambda _, t: _aux.batch(t, b, batches), x), None)
                         for b in range(batches)])
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    ref.update({"out": out.detach(), "probe": probe})
    if grads:
        if out.requires_grad:
            (out * probe).sum().backward()
        for key, tree in (("grads", p), ("input_grads", x)):
            flat = _tree.flatten(tree)
            ref[key] = {k: (g if g is not None else torch.zeros_like(flat[k])) for k, g in _grads(tree).items()}
    return ref


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> Optional[tuple]:
    """None when ``got`` matches ``want``; else ``(error / tolerance, description)``."""
    if tuple(got.shape) != tuple(want.shape):
        return float("inf"), f"{what}: shape {tuple(got.shape)}, one process {tuple(want.shape)}"
    if not got.numel():
        return None
    got, want = got.detach().double(), want.detach().double()
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    tol = atol + rtol * scale if want.is_floating_point() else 0.0
    if err <= tol:
        return None
    return (err / tol if tol > 0 else float("inf"),
            f"{what}: max |diff| {err:.2e} > tolerance {tol:.2e} (max |one process| {scale:.2e})")


def _on_rank(rank: int, world: int, fn, params, inputs, plan, sizes, ref, grads, rtol, atol, aux=False,
             stats=()) -> tuple:
    """One rank of one mesh: run, compare with the reference; ``(number of checks, failures)``."""
    mesh = Mesh(**sizes)
    sharded = shard(_aux.leaves(params, grads), plan(mesh) if callable(plan) and not isinstance(plan, Plan) else plan,
                    mesh)
    b, n = mesh.batch_index, mesh.num_batches
    x = _aux.leaves(_tree.map_with_path(lambda _, t: _aux.batch(t, b, n), inputs), grads)
    out, extra = _call(fn, sharded, x, mesh, aux) if aux else (_call(fn, sharded, x, mesh), None)
    results = [_compare("output", out, _aux.batch(ref["out"], b, n), rtol, atol)]
    got_aux = _aux.values(extra, stats) if aux else {}
    for k, want in ref.get("aux", {}).items():       # global values: every rank holds the one-process value
        results.append((float("inf"), f"aux {k}: missing") if k not in got_aux else
                       _compare(f"aux {k}", got_aux[k], want, rtol, atol))
    differs = sum_over_world(torch.tensor([float(results[0] is not None)]))   # a vote: backward on all or none
    if grads and not differs.item():
        for k, loss in (_aux.losses(extra).items() if aux else ()):        # each rank: its copy of the global loss
            if loss.requires_grad:
                loss.backward(retain_graph=True)
            share = {} if mesh.sp or not ref["shares"] else ref["shares"][b][k]     # sp: a tp rank's piece
            results += _param_grads(f"grad of aux {k}: ", sharded, ref["aux_grads"][k], rtol, atol, mesh, share)
            for t in _tree.leaves(x):
                t.grad = None
        if out.requires_grad:
            (out * _aux.batch(ref["probe"], b, n)).sum().backward()
        results += _param_grads("grad ", sharded, ref["grads"], rtol, atol, mesh)
        for p, g in _grads(x).items():
            want = _aux.batch(ref["input_grads"][p], b, n)
            name = f"grad inputs.{p}" if p else "grad inputs"
            results.append((float("inf"), f"{name}: no gradient") if g is None else _compare(name, g, want, rtol, atol))
    return len(results), [r for r in results if r is not None]


def _param_grads(prefix: str, sharded: Any, want: dict, rtol: float, atol: float, mesh: Mesh,
                 share: Optional[dict] = None) -> list:
    """Compare the gathered gradients of every leaf with ``want`` (then clear them): a sharded
    leaf's own slice on this rank (a failure names the rank that computed it), a replicated leaf's
    whole gradient (the sum of every rank's share: ``ranks summed``); each failure names the
    gradient's placement. ``share`` (aux losses: a leaf without a gradient has a zero one): this
    rank's batch's share of a replicated leaf's gradient, against its pending sum (naming the rank)."""
    flat, got = _tree.flatten(sharded), _grads(sharded)
    if share is not None:
        got = {p: g if g is not None else torch.zeros_like(flat[p]) for p, g in got.items()}
    places = {p: _aux.grad_place(g) for p, g in got.items()}
    full = gather({p: g if g is not None else torch.zeros_like(flat[p]) for p, g in got.items()})
    results = []
    for p, w in want.items():
        if got.get(p) is None:
            results.append((float("inf"), f"{prefix}params.{p}: no gradient on this rank "
                                           f"(placement {placement_of(flat[p])!r})"))
            continue
        mine, own = slice_for_rank(full[p], placement_of(flat[p]), mesh), slice_for_rank(w, placement_of(flat[p]), mesh)
        split = tuple(mine.shape) != tuple(w.shape)          # this rank's slice: its own computation
        r = _compare(f"{prefix}params.{p}", mine if split else full[p], own if split else w, rtol, atol)
        where = "this rank's slice" if split else "ranks summed"
        results.append(None if r is None else (r[0], f"{r[1]}; gradient {places[p]}, {where}"))
        if p in (share or {}) and not split and isinstance(got[p], DTensor) and any(
                q.is_partial() for q in got[p].placements):          # its pending sum: this rank's own share
            r = _compare(f"{prefix}params.{p}", got[p].to_local(), share[p], rtol, atol)
            results.append(None if r is None else (r[0], f"{r[1]}; gradient {places[p]}, this rank's share "
                                                          f"(batch {mesh.batch_index} of {mesh.num_batches})"))
    for t in flat.values():
        t.grad = None
    return results
