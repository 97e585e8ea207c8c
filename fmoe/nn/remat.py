"""Activation recomputation (remat): keep a block's inputs, recompute its inside in backward.

A trainer picks a policy for a region of code; a model marks its blocks. Under
``with remat.policy("layer")`` every :func:`call` of kind ``"layer"`` runs through
``torch.utils.checkpoint`` (non-reentrant): its activations are dropped after forward and
recomputed when backward reaches the block — collectives included, which line up because every
rank runs the same backward. Under ``"moe"`` only the MoE blocks are recomputed; under
``"none"`` (the default) :func:`call` is a plain call. Results and gradients are unchanged.
Under a ``torch.func`` transform (``grad``, ``vjp``, ``hessian``), whose levels do not run the
saved-tensor hooks ``torch.utils.checkpoint`` relies on, a block is recomputed functionally: an
autograd Function keeps only the block's inputs and its backward recomputes the block under
``torch.func.vjp`` (JAX's ``checkpoint`` composed with ``grad``). Results and gradients equal
``.backward()`` with remat.

The same marks serve regional compilation: under ``with remat.compiled("layer")`` every
:func:`call` of that kind runs its block through ``torch.compile`` (each decoder layer is the
same function on same-shaped weights, so Dynamo compiles it once and every layer reuses the
graph; the code between blocks stays eager). The block's FSDP gather runs eagerly before the
region (``fmoe.fsdp.unshard_layer``); everything inside is traced, the MoE block included:
router, dispatch with its expert-parallel exchange, experts, combine. The block is traced and
run under :func:`fmoe.transforms.symbolic_splits`, so the exchange's host split sizes become
unbacked symbolic ints: one graph per layer, whatever the routing (empty expert slices and a
rank receiving no rows included), no recompile, no graph break.
:func:`fmoe.training.train_step` uses it for ``StepConfig(compile=True)`` on a multi-rank mesh.

The policy lives in a ``contextvars.ContextVar`` (per thread / task, restored on exit), so the
model keeps its signature and a notebook may mark blocks of its own.

Example:
    >>> import torch
    >>> w = torch.ones(3, requires_grad=True)
    >>> with policy("layer"):
    ...     y = call("layer", lambda x: (x * w).sin(), torch.ones(3))
    >>> y.sum().backward(); w.grad.shape
    torch.Size([3])
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.checkpoint import checkpoint

from torch.utils._pytree import tree_flatten, tree_unflatten

from torch.distributed.tensor import DTensor

from ..transforms import compiling, func_active, peel, symbolic_splits

__all__ = ["POLICIES", "policy", "compiled", "call", "active"]

POLICIES = ("none", "layer", "moe")
_POLICY: contextvars.ContextVar[str] = contextvars.ContextVar("fmoe_remat", default="none")
_COMPILED: contextvars.ContextVar[Optional[tuple[str, dict]]] = contextvars.ContextVar("fmoe_compiled", default=None)


@contextlib.contextmanager
def policy(name: str) -> Iterator[None]:
    """Recompute blocks of kind ``name`` (``"none"``, ``"layer"`` or ``"moe"``) inside the block."""
    if name not in POLICIES:
        raise ValueError(f"remat.policy: name must be one of {POLICIES}, got {name!r}")
    token = _POLICY.set(name)
    try:
        yield
    finally:
        _POLICY.reset(token)


def compiled(kind: str, **options: Any) -> "_Regional":
    """Run every block of kind ``kind`` (``"layer"`` or ``"moe"``) as ``torch.compile(block, **options)``.

    Args:
        kind: the blocks to compile.
        options: ``torch.compile`` keyword arguments (``backend``, ``mode``, ``dynamic``, ...).
    Returns:
        a context manager, reusable (a step enters it once per micro-batch).
    """
    if kind not in POLICIES[1:]:
        raise ValueError(f"remat.compiled: kind must be one of {POLICIES[1:]}, got {kind!r}")
    return _Regional((kind, options))


class _Regional:
    """The context of :func:`compiled`: sets the regional compilation on enter, restores on exit;
    reusable and re-entrant (one token per entry)."""

    def __init__(self, value: tuple[str, dict]):
        self.value, self.tokens = value, []

    def __enter__(self) -> None:
        self.tokens.append(_COMPILED.set(self.value))

    def __exit__(self, *exc: Any) -> None:
        _COMPILED.reset(self.tokens.pop())


@torch.compiler.assume_constant_result
def active() -> str:
    """The current policy name (read once per trace under ``torch.compile``: Dynamo cannot trace
    ``ContextVar.get``, so a compiled function is specialised on the policy it was traced with)."""
    return _POLICY.get()


def call(kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, recomputed in backward when the current policy is ``kind``.

    Args:
        kind: ``"layer"`` (a whole decoder layer) or ``"moe"`` (a mixture-of-experts block).
        fn: the block; its outputs may be any pytree of tensors.
    Returns:
        what ``fn`` returns.
    """
    if kind not in POLICIES[1:]:
        raise ValueError(f"remat.call: kind must be one of {POLICIES[1:]}, got {kind!r}")
    regional = None if compiling() else _COMPILED.get()
    if regional is not None and regional[0] == kind:
        from ..fsdp import unshard_layer      # the FSDP gather (collectives, DTensor specs) stays eager
        fn = _splits_symbolic(torch.compile(fn, **regional[1]))   # cache per code object: one graph, all layers
        args = (unshard_layer(args[0]),) + args[1:]
    if active() != kind or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if func_active() and not compiling():       # saved-tensor hooks do not run under torch.func
        return _recomputed(fn, args, kwargs)
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _splits_symbolic(compiled_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled_fn`` called under :func:`fmoe.transforms.symbolic_splits` (Dynamo reads the
    setting when it traces: the first call, a recompile, and a recompute in backward all run
    inside it)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        with symbolic_splits():
            return compiled_fn(*args, **kwargs)
    return run


class _Recompute(torch.autograd.Function):
    """``outs = block(*floats)`` kept without its activations; backward recomputes the block
    under ``torch.func.vjp`` (a functional checkpoint: what ``torch.func`` transforms can run)."""

    @staticmethod
    def forward(block, *floats):
        with torch.no_grad():
            return tuple(block(*floats))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.block = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx, *grads):
        floats = ctx.saved_tensors
        with torch.enable_grad():
            outs, pullback = torch.func.vjp(lambda *f: tuple(ctx.block(*f)), *floats)
        grads = tuple(torch.zeros_like(o) if g is None else g for g, o in zip(grads, outs))
        return (None,) + tuple(pullback(grads))


def _recomputed(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` through :class:`_Recompute`: the floating tensors of the arguments
    (a pytree) are its inputs, the floating tensors of the output its outputs; everything else
    (ints, configs, integer tensors, non-tensor outputs) rides along unchanged."""
    leaves, spec = tree_flatten((args, kwargs))
    if any(isinstance(peel(t), DTensor) for t in leaves):
        raise NotImplementedError(
            "remat policy under a torch.func transform (grad, vjp) over sharded (DTensor) parameters is not "
            "supported on a mesh: the recompute's torch.func.vjp would nest a second transform level, which a "
            "DTensor cannot carry. Instead differentiate with torch.autograd.grad / .backward() (remat works "
            "there, any mesh), or use remat.policy('none') inside torch.func")
    at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    out_spec, out_leaves, out_at = [], [], []

    def block(*floats):
        full = list(leaves)
        for i, t in zip(at, floats):
            full[i] = t
        a, kw = tree_unflatten(full, spec)
        ol, os_ = tree_flatten(fn(*a, **kw))
        out_spec[:], out_leaves[:] = [os_], ol
        out_at[:] = [i for i, t in enumerate(ol) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return [ol[i] for i in out_at]

    floats = _Recompute.apply(block, *[leaves[i] for i in at])
    full = list(out_leaves)
    for i, t in zip(out_at, floats):
        full[i] = t
    return tree_unflatten(full, out_spec[0])
