"""What fmoe does differently under ``torch.func`` transforms and ``torch.compile``.

fmoe's layers are pure functions, so ``torch.func.grad``/``vjp``/``jvp``/``vmap`` and
``torch.compile`` apply to them. Five things need care, and this module holds the answers:

1. **Data-dependent input checks.** Expert ids in ``[0, E)``, finite routing weights, token ids
   in ``[0, V)``, targets in range: each check reads a value on the host (``int(t.max())``).
   That is impossible for a batched tensor under ``vmap`` and would end a graph under
   ``torch.compile``. The checks therefore run whenever :func:`data_checks_enabled` (eager
   mode, also under ``grad``/``vjp``/``jvp``, which give real values) and are skipped while a
   ``vmap`` is active or while compiling. Run a step eagerly once (the trainer's first step
   does) to get the clear ``ValueError`` on bad inputs; shape, dtype and structure checks
   always run.
2. **Parameters wrapped by ``torch.func``.** Inside ``torch.func.grad(f)(params)`` each leaf is
   a functorch wrapper around the real tensor, so ``isinstance(leaf, DTensor)`` is False for a
   placed parameter. :func:`peel` returns the innermost tensor (the DTensor), whose placement
   and process groups the layers read; the computation itself stays on the wrapper.
3. **Custom autograd Functions.** Each has a ``jvp`` (forward mode) and a vmap rule. Dynamo
   cannot trace a Function that defines ``jvp``, so under ``torch.compile`` fmoe applies a twin
   without it (:func:`without_jvp`, :func:`apply`).
4. **Split sizes are data.** The expert-parallel exchange sends a data-dependent number of rows
   to each rank; its split sizes reach the host once per layer (``.tolist()``). By default Dynamo
   ends the graph there. Under :func:`symbolic_splits` it traces them as unbacked symbolic ints
   instead: ``torch.compile(forward)`` on a mesh is one graph with the all-to-alls inside, and no
   routing (empty slices included) causes a recompile, since nothing guards on those ints.
5. **A compiled transform on a mesh** is refused by the tracer, alike on every rank and before any
   collective (:func:`refuse_compiled_transform`): under ``fullgraph=True`` the user's error,
   without it the whole call runs eagerly, with no nested frame traced on its own.

Example:
    >>> data_checks_enabled()
    True
    >>> torch.func.vmap(lambda x: torch.tensor(data_checks_enabled()) + x)(torch.zeros(2)).tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch._dynamo
from torch._C._functorch import TransformType, get_unwrapped, is_functorch_wrapped_tensor
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

__all__ = ["refuse_compiled_transform", "CompiledTransformRefused", "vmapping", "compiling", "forward_mode", "higher_order", "func_active", "active", "data_checks_enabled", "peel", "without_jvp", "apply", "vmap_by_loop", "symbolic_splits"]


def vmapping() -> bool:
    """Whether a ``torch.func.vmap`` is active (at any level)."""
    if compiling():                 # Dynamo traces no vmap of fmoe's layers: no graph break on the interpreter list
        return False
    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def compiling() -> bool:
    """Whether Dynamo is tracing (``torch.compile``)."""
    return torch.compiler.is_compiling()


def forward_mode() -> bool:
    """Whether forward-mode AD is active: a ``torch.func.jvp`` / ``jacfwd`` level (eager), or a
    ``torch.autograd.forward_ad`` dual level. Kernels without a forward-AD formula (CPU SDPA's
    flash attention) then take a plain-op path."""
    if compiling():
        return False
    if torch.autograd.forward_ad._current_level >= 0:
        return True
    return any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


def higher_order() -> bool:
    """Whether derivatives of derivatives are being taken: forward mode (:func:`forward_mode`),
    or two ``torch.func.grad`` / ``vjp`` levels (``grad(grad(f))``). Kernels whose backward has no
    derivative (CPU SDPA's flash attention) then take a plain-op path."""
    if forward_mode():
        return True
    if compiling():
        return False
    return sum(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters()) >= 2


@torch.compiler.assume_constant_result
def _interpreter_on_stack() -> bool:
    """Whether the functorch interpreter stack is non-empty, evaluated in Python (a constant of
    the trace): Dynamo models ``peek_interpreter_stack()`` as an object that is never ``None``,
    so the same test written inline reads True in *every* traced function."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def func_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vjp``, ``jvp``, ``vmap``) is active, eager or
    while Dynamo traces one (``torch.compile(torch.func.grad(f))``); False while Dynamo traces a
    plain ``torch.compile(f)``.

    Example:
        >>> func_active(), torch.func.grad(lambda x: x * func_active())(torch.tensor(1.0)).item()
        (False, 1.0)
    """
    return _interpreter_on_stack()


def active() -> bool:
    """Whether any ``torch.func`` transform is active or Dynamo is tracing: fmoe's layers then
    take their grouped-operator expert path (:mod:`fmoe.experts.ops`), whose every piece has
    backward, jvp and vmap rules and no host sync beyond the dispatch's."""
    return compiling() or bool(retrieve_all_functorch_interpreters())


def data_checks_enabled() -> bool:
    """Whether value checks that need a host sync run: not under ``vmap``, not while compiling,
    not under a ``FakeTensorMode`` (the dry run: tensors without values)."""
    from torch._guards import active_fake_mode

    return not compiling() and not vmapping() and active_fake_mode() is None


COMPILED_TRANSFORM = (
    "torch.compile of a torch.func transform (torch.compile(torch.func.grad(loss)), a compiled functional "
    "train step) on a mesh ({world} ranks) is not supported: Dynamo cannot trace the transform's wrappers around "
    "sharded (DTensor) parameters. Without fullgraph=True the call runs eagerly on every rank (torch.func.grad "
    "on the mesh); instead run torch.func.grad eagerly on the mesh (torch.compile(forward) works there), use "
    "loss.backward() (fmoe.training.train_step), or compile the whole step on one process")


def refuse_compiled_transform(mesh: Any) -> None:
    """Refuse, while Dynamo traces, a ``torch.func`` transform of a function that runs on a
    multi-rank ``mesh``; the same on every rank, before any collective (the decoder's ``start``
    and ``fmoe.moe`` call it first thing).

    The refusal is a ``torch._dynamo.exc.Unsupported`` carrying :data:`COMPILED_TRANSFORM`, raised
    by the tracer itself (:func:`_refuse_trace`) with a frame execution strategy: the compiled frame
    runs eagerly this once (no mark left on its code: a later call traces it again) and *every frame
    it calls* is skipped. With ``fullgraph=True`` the user sees that error; without it the whole
    call runs eagerly (``torch.func.grad`` on the mesh, which is right), and Dynamo traces none of
    its nested frames. Without that strategy Dynamo traced each nested
    frame of the eager fallback on its own, with each rank's data: ~30 s per rank, and the kernels'
    bodies, whose path depends on a rank's rows (issue 46).

    Args:
        mesh: the :class:`fmoe.Mesh` the layer runs on, or None.
    Returns:
        None.

    Example:
        >>> refuse_compiled_transform(None)      # eager, or one process: nothing to refuse
    """
    if mesh is not None and getattr(mesh, "world", 1) > 1 and compiling() and func_active():
        _refuse_trace(int(mesh.world))


class CompiledTransformRefused(torch._dynamo.exc.Unsupported):
    """The refusal of :func:`refuse_compiled_transform`: an ``Unsupported`` that no frame turns
    into a graph break (``skip_frame`` stays True: Dynamo clears it when the error leaves an
    inlined call, so that only the innermost frame is skipped), carried by the tracer up to the
    compiled frame, whose execution strategy it sets (:func:`_refuse_trace`)."""

    skip_frame = property(lambda self: True, lambda self, value: None)


@torch.compiler.assume_constant_result
def _refuse_trace(world: int) -> bool:
    """Raise :class:`CompiledTransformRefused` from the tracer (Dynamo calls this in Python while
    it traces: a constant of the trace, never a graph op), with the ``frame_exec_strategy``
    ``DEFAULT`` for the compiled frame (run eagerly, traced again next call) and ``SKIP``,
    recursively, for every frame it calls. Called eagerly
    (after a graph break) it returns False: there is nothing to refuse there."""
    from torch._dynamo.types import FrameAction, FrameExecStrategy
    from torch._guards import TracingContext

    if TracingContext.try_get() is None:
        return False
    error = CompiledTransformRefused(COMPILED_TRANSFORM.format(world=world), "compiled torch.func transform on a mesh")
    error.frame_exec_strategy = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.SKIP)
    raise error


def peel(t: Any) -> Any:
    """The tensor under every functorch wrapper (``grad``/``jvp``/``vmap`` levels) of ``t``;
    ``t`` itself when it is not wrapped (or not a tensor)."""
    if compiling():                 # Dynamo sees through the wrappers itself
        return t
    while isinstance(t, torch.Tensor) and is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def without_jvp(cls: type) -> type:
    """A twin of the autograd Function ``cls`` without its ``jvp`` (otherwise identical), for
    :func:`apply` to use while compiling: Dynamo refuses to trace a Function with a custom
    ``jvp``. Keep it as a module global (``_FooTraced = without_jvp(_Foo)``): Dynamo resolves
    globals, not classes hung on other classes."""
    attrs = {k: v for k, v in cls.__dict__.items() if k not in ("jvp", "__dict__", "__weakref__")}
    return type(cls.__name__ + "Traced", cls.__bases__, attrs)


@contextlib.contextmanager
def symbolic_splits() -> Iterator[None]:
    """While active, Dynamo traces the host values of tensors (``.tolist()``, ``.item()``: the
    expert-parallel exchange's split sizes) as unbacked symbolic ints instead of ending the graph
    there (``torch._dynamo.config.capture_scalar_outputs``, restored on exit). Compile *and call*
    the function inside it: the setting is read when Dynamo traces (the first call, and any
    recompile).

    Example (on one process the forward has no host sync; on a mesh with ``ep > 1`` this is
    what makes it one graph):
        >>> f = torch.compile(lambda x: x * x.sum().item(), fullgraph=True, backend="eager")
        >>> with symbolic_splits():
        ...     f(torch.ones(2)).tolist()
        [2.0, 2.0]
    """
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        yield


def apply(fn: type, traced: type, *args: Any) -> Any:
    """``fn.apply(*args)``, or ``traced.apply(*args)`` (its :func:`without_jvp` twin) while compiling."""
    return (traced if compiling() else fn).apply(*args)


def vmap_by_loop(apply: Any):
    """A vmap rule (for an autograd Function's ``vmap`` staticmethod) that runs ``apply`` once
    per batch element and stacks the results along dim 0: correct for any Function, meant for
    fused kernels whose inputs carry host-side metadata (group counts) that a batch cannot share.
    fmoe's layers do not reach these under ``vmap`` (they take the grouped-op path), so the loop
    only serves direct calls.

    Args:
        apply: the Function's ``apply``.
    Returns:
        ``rule(info, in_dims, *args) -> (outputs, out_dims)``.
    """

    def rule(info, in_dims, *args):
        outs = [apply(*[a.select(d, i) if isinstance(d, int) else a for a, d in zip(args, in_dims)])
                for i in range(info.batch_size)]
        if isinstance(outs[0], tuple):
            return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])
        return torch.stack(outs), 0

    return rule
