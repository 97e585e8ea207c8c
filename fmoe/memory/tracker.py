"""What the dry run measures while the real train step runs on fake tensors.

- :class:`StepTracker`: torch's ``MemTracker`` (live bytes per storage, peak snapshot by
  category) with fmoe's categories. fmoe's model is a function of a pytree, not an
  ``nn.Module``, so the categories come from the step's phases instead of module hooks:
  ``params`` and ``optimizer`` are the trees handed to the step (tagged before it runs),
  ``grads`` every parameter's gradient as autograd produces it (a hook per leaf),
  ``activations`` what the forward allocates and ``temporaries`` everything allocated in
  backward (recomputation included) or after it (gradient reduction, optimizer math);
  ``max_grads_bytes``, the most gradient bytes alive at any moment of the step (what
  ``--optim-in-backward`` lowers). DTensor's sharding propagation builds fake tensors of an op's
  *global* shape to infer its output (under its own fake mode on a real run: no memory); under
  the dry run's fake mode the tracker would count them, so it skips what runs inside it (an
  ``.grad`` accumulation of a sharded expert weight made an 0.8 GB ghost).
- :class:`CollectiveBytes`: bytes handed to each collective (the input tensors of every
  ``c10d`` op), per op name.
- :class:`HostReads`: the fake-mode rule for a host read (``int(t)``, ``bool(t)``, ``float(t)``
  of a value that does not exist): integers read 0, floats 1.0, booleans True. So the step's
  finite-loss check passes, its metrics are placeholders and its optimizer step counter reads
  0; data checks are already off under fake mode (:func:`fmoe.transforms.data_checks_enabled`)
  and split sizes follow :mod:`fmoe.experts.fake_splits`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode

from .. import tree as _tree

__all__ = ["StepTracker", "CollectiveBytes", "HostReads", "CATEGORIES"]

#: fmoe's category -> torch's MemTracker reference types summed into it
CATEGORIES = {"params": ("Parameter",), "grads": ("Gradient",), "optimizer": ("Optstate",),
              "activations": ("Activation",), "temporaries": ("Temp", "Other", "Buffer")}


class _Phases(ModTracker):
    """``is_bw`` (what MemTracker calls temporary): inside backward, and after a backward until
    the next forward starts (:meth:`StepTracker.__torch_dispatch__` sees it start): the
    gradient norm, reduction and optimizer update of a functional step. Grad-mode-off work
    *inside* a forward (a custom autograd Function's forward, such as a collective's) stays
    an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.after_backward = False

    @property
    def is_bw(self) -> bool:
        if torch._C._current_graph_task_id() != -1:
            self.after_backward = True
            return True
        return self.after_backward


class StepTracker(MemTracker):
    """MemTracker with fmoe's categories (module docstring); enter it around the step.

    Example:
        >>> t = StepTracker()
        >>> p = {"w": torch.ones(4, requires_grad=True)}
        >>> t.tag(p, "params")
        >>> with t:
        ...     y = (p["w"] * 2).sum()
        ...     g, = torch.autograd.grad(y, [p["w"]])
        >>> t.peak()["params_bytes"]
        16
    """

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _Phases()
        self.max_grads_bytes = 0        # the most gradient bytes alive at once (not only at the peak)

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        self._note_grads()

    def _note_grads(self) -> None:
        live = sum(int(snap.get(_MemRefType.GRAD, 0)) for snap in self._curr_mem_snap.values())
        self.max_grads_bytes = max(self.max_grads_bytes, live)

    _REF = {"params": _MemRefType.PARAM, "optimizer": _MemRefType.OPT, "grads": _MemRefType.GRAD}

    def __enter__(self) -> "StepTracker":
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        own = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(prop, *args, **kwargs):        # DTensor's shape inference: not the step's memory
            self._propagating += 1
            try:
                return own(prop, *args, **kwargs)
            finally:
                self._propagating -= 1

        self._propagating, self._own_propagate = 0, own
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        ShardingPropagator._propagate_tensor_meta_non_cached = self._own_propagate
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._propagating:                        # fake arguments of a DTensor op's global shape
            return func(*args, **(kwargs or {}))
        # a computing (not view / detach) op on a tensor that requires grad, with grad mode on,
        # outside backward: a forward (again: the next micro-batch); ops on gradients alone
        # (the norm) and ``loss.detach()`` stay after the backward
        if (self._mod_tracker.after_backward and torch.is_grad_enabled() and not func.is_view
                and torch._C._current_graph_task_id() == -1
                and any(isinstance(a, torch.Tensor) and a.requires_grad
                        for a in torch.utils._pytree.tree_leaves((args, kwargs)))):
            self._mod_tracker.after_backward = False
        return super().__torch_dispatch__(func, types, args, kwargs)

    def tag(self, tree: Any, category: str) -> None:
        """Count the storages of ``tree``'s tensors as ``category`` (params, optimizer, grads);
        parameter leaves that require grad also get a hook tagging their gradients."""
        ref = self._REF[category]
        for leaf in _tree.leaves(tree):
            if isinstance(leaf, torch.Tensor):
                self._update_and_maybe_create_winfos(leaf, ref)
                if category == "params" and leaf.requires_grad:
                    leaf.register_hook(self._grad_hook)

    def _grad_hook(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)
        self._note_grads()

    def peak(self) -> dict:
        """``{"peak_bytes", "<category>_bytes"...}`` at the moment of the peak (one device)."""
        snaps = self.get_tracker_snapshot("peak")
        out = {"peak_bytes": 0, **{f"{c}_bytes": 0 for c in CATEGORIES}}
        for snap in snaps.values():
            out["peak_bytes"] += int(snap.get("Total", 0))
            for c, refs in CATEGORIES.items():
                out[f"{c}_bytes"] += sum(int(snap.get(_MemRefType(r), 0)) for r in refs)
        return out


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors handed to every ``c10d`` collective (``.bytes[name]``):
    the input (send) buffers, which for ``c10d`` ops with an output argument come second."""

    _SKIP = ("wait_tensor", "barrier", "monitored_barrier")

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        name = func._opname
        if ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd") and name not in self._SKIP:
            out_first = ns == "c10d" and name.lstrip("_").startswith(("allgather", "reduce_scatter", "alltoall"))
            n = 0
            for a in torch.utils._pytree.tree_leaves(args[1:2] if out_first else args[:1]):   # the send buffer(s)
                if isinstance(a, torch.Tensor):
                    n += a.numel() * a.element_size()
            self.bytes[name] = self.bytes.get(name, 0) + n
        return func(*args, **(kwargs or {}))


class HostReads(TorchDispatchMode):
    """Answers host reads of fake tensors by the module docstring's rule."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.dtype.is_floating_point else 0)
        return func(*args, **(kwargs or {}))
