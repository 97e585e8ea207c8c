"""The optimizer step inside backward (``--optim-in-backward``): each layer is updated as soon as
its gradients are reduced, so full gradients never coexist.

The normal step (:func:`fmoe.training.step.train_step`) holds every gradient at once: autograd
returns them all, :func:`fmoe.training.grads.reduce_flat` reduces them, then AdamW updates every
leaf. Here the last micro-batch's backward carries the update. The trainable leaves are grouped
by layer (``layers.N``, and each other top-level entry: ``embed``, ``norm``, ``lm_head``); a
``register_post_accumulate_grad_hook`` on every leaf counts its gradient in, and when a group is
complete its gradients are taken off the leaves, reduced over the data-parallel copies (one
:func:`reduce_flat` per layer, so its leaves share the coalesced all-reduces), the AdamW update of
:func:`fmoe.optim.adamw.apply_flat` is applied, and the gradients are freed. At most one layer's
reduced gradients (and the leaves' accumulated ``.grad`` of the layers whose backward is running)
are alive, instead of all of them.

Global-norm clipping (``AdamWConfig.max_grad_norm``, ``--clip``, on by default) needs the norm
of *all* gradients before the first update, so with clipping the step takes **two backward
passes over one forward**: the first (``retain_graph=True``) reduces each layer's gradients,
adds their square sums (:func:`fmoe.optim.norm.local_square_sum`) and frees them; one all-reduce
gives the global norm and the clip scale; the second backward updates each layer with that
scale. Same numbers as the normal step (the gradients of both passes are the same computation),
at the price of one more backward (and its collectives). Without clipping one backward does both:
the square sums are added as the layers are updated and reduced once at the end.

Skips and metrics: ``grad_norm`` is the global norm of the reduced gradients, exactly as the
normal step logs it. The mean loss over the world is known before the last backward; a
non-finite one runs that backward to measure the norm only, updates nothing and reports
``skipped``. With clipping a non-finite norm is known after the first pass, so again nothing is
updated: the normal step's "no update of any kind". Without clipping the norm is known only after
the layers whose backward came first were updated: a layer whose own gradients are not finite
is not updated (the fused kernel's ``found_inf``), the step reports ``skipped`` and the step
counter does not advance, but the finite layers keep their update — the one difference from the
normal step, documented in ``docs/memory.md``.

``grad_accum > 1``: the micro-batches before the last accumulate their gradients in the leaves'
``.grad`` (as the normal step accumulates them) and the last one's backward reduces and updates:
the same update. With clipping that needs a second pass over the last micro-batch on top of the
accumulated gradients of the others, which a retained graph cannot give, so that combination is
refused; so is clipping with ``compile`` (a compiled backward runs once per graph), while
``--clip 0`` compiles and gives the same numbers. bf16 weights with stochastic rounding draw their rounding layer by layer: the same
distribution as the normal step, not the same draws.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import tree as _tree
from ..mesh import Mesh
from ..optim import adamw
from ..optim.norm import clip_scale, local_square_sum, norm_of
from ..precision import round_generator
from .grads import reduce_flat

__all__ = ["InBackward", "layer_of", "check"]


def layer_of(path: str) -> str:
    """The update group of a parameter path: ``layers.N`` for a decoder layer's leaves, else the
    first segment (``embed``, ``norm``, ``lm_head``).

    Example:
        >>> layer_of("layers.3.moe.w_down"), layer_of("embed")
        ('layers.3', 'embed')
    """
    parts = path.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 2 else parts[0]


def check(grad_accum: int, max_grad_norm: Optional[float], compile: Any = False, pp: int = 1) -> None:
    """``ValueError`` for the refused combinations: a pipeline (``pp > 1``), and with clipping more
    than one micro-batch (module docstring) or a compiled step (AOTAutograd's backward gives its
    buffers up, so it cannot run twice over one graph). The message names the flags."""
    if pp > 1:
        raise ValueError(f"--optim-in-backward with --pp {pp}: the pipeline's stages run several micro-batches' "
                         "backward before their one update, which the in-backward update does not schedule; drop "
                         "one of them")
    if compile and max_grad_norm is not None:
        raise ValueError(f"--optim-in-backward with --clip {max_grad_norm} and --compile: the clip's two backward "
                         "passes run the compiled backward twice, which frees its buffers after the first (AOTAutograd's "
                         "donated buffers); use --clip 0 (one pass, compiles) or drop --compile")
    if grad_accum > 1 and max_grad_norm is not None:
        raise ValueError(f"--optim-in-backward with --clip {max_grad_norm} and --grad-accum {grad_accum}: the clip "
                         "needs the norm of the accumulated gradient before the first layer is updated, which a "
                         "second backward over the last micro-batch cannot give; use --clip 0 (no clipping) or "
                         "--grad-accum 1")


class InBackward:
    """One step's optimizer-in-backward state (what :func:`~fmoe.training.step.train_step` calls).

    ``backward(total, losses)`` replaces the step's ``torch.autograd.grad``: before the last
    micro-batch it accumulates into ``.grad``; on the last it runs the pass(es) of the module
    docstring. ``result()`` then gives ``(flat_params, opt_state, stats, mean_loss)`` as the
    normal step's update does.

    Args:
        flat: the step's parameters by path.
        train_paths: the paths that require grad (updated; the rest is left as it is).
        opt_state: AdamW's state (``{"step", "m", "v"}``).
        mesh: the training mesh.
        step_cfg: the :class:`~fmoe.training.step.StepConfig` (``opt``, ``round_seed``, ``donate``).
        lr: this step's learning rate.
        world_mean: ``x -> `` the mean of ``x`` over the world's ranks (the step's own).
    """

    def __init__(self, flat: dict, train_paths: list, opt_state: dict, mesh: Mesh, step_cfg: Any, lr: float,
                 world_mean: Callable[[torch.Tensor], torch.Tensor]):
        check(step_cfg.grad_accum, step_cfg.opt.max_grad_norm, step_cfg.compile)
        self.flat, self.paths, self.mesh, self.cfg, self.lr = flat, train_paths, mesh, step_cfg, lr
        self.state, self.world_mean = opt_state, world_mean
        self.flat_m, self.flat_v = _tree.flatten(opt_state["m"]), _tree.flatten(opt_state["v"])
        self.groups: dict[str, list[str]] = {}
        for p in train_paths:
            self.groups.setdefault(layer_of(p), []).append(p)
        self.new_p: dict = {}
        self.new_m: dict = {}
        self.new_v: dict = {}
        self.norm = self.mean_loss = None
        self.updated = False

    def backward(self, total: torch.Tensor, losses: list) -> tuple:
        """Backward of one micro-batch's ``total`` loss; ``losses``: the LM losses of the step's
        micro-batches so far, this one's last (on the step's last micro-batch their world mean is
        checked before any update). Returns no gradient (``()``): they live in ``.grad`` until
        their layer is updated."""
        leaves = [self.flat[p] for p in self.paths]
        if len(losses) < self.cfg.grad_accum:
            total.backward(inputs=leaves)
            return ()
        self.mean_loss = self.world_mean(torch.stack([x.detach() for x in losses]).mean())
        loss_ok = bool(torch.isfinite(self.mean_loss))
        clipping = self.cfg.opt.max_grad_norm is not None
        if clipping or not loss_ok:                 # pass 1: the norm only
            square = self._pass(total, leaves, None, retain=clipping and loss_ok)
            self.norm = norm_of(square, leaves)
            if not (loss_ok and bool(torch.isfinite(self.norm))):
                return ()
            self._pass(total, leaves, clip_scale(self.norm, self.cfg.opt), retain=False)
        else:                                       # one pass: update, and the norm on the way
            self.norm = norm_of(self._pass(total, leaves, clip_scale(torch.zeros(()), self.cfg.opt),
                                           retain=False), leaves)
        self.updated = True
        return ()

    def _pass(self, total: torch.Tensor, leaves: list, scale: Optional[torch.Tensor], retain: bool) -> torch.Tensor:
        """One backward whose hooks reduce each complete layer, add its square sum, and update it
        with ``scale`` (None: the norm only); returns this rank's square-sum share."""
        square = torch.zeros((), dtype=torch.float64)
        waiting = {g: len(ps) for g, ps in self.groups.items()}
        rounding = None if scale is None or self.cfg.round_seed is None else round_generator(
            self.cfg.round_seed, int(self.state["step"]) + 1, self.mesh.rank, leaves[0].device)

        def arrived(path: str) -> None:
            nonlocal square
            group = layer_of(path)
            waiting[group] -= 1
            if waiting[group]:
                return
            paths = self.groups[group]
            grads = {}
            for p in paths:                          # taken off the leaves: freed with this dict
                grads[p], self.flat[p].grad = self.flat[p].grad, None
            reduced = reduce_flat(grads, self.flat, self.mesh, inplace=True)
            del grads
            part = local_square_sum([reduced[p] for p in paths])
            square = square + part
            if scale is not None:
                self._update(reduced, paths, scale, torch.isfinite(part), rounding)

        handles = [self.flat[p].register_post_accumulate_grad_hook(lambda _, p=p: arrived(p)) for p in self.paths]
        try:
            total.backward(inputs=leaves, retain_graph=retain)
        finally:
            for h in handles:
                h.remove()
        missing = sorted(g for g, n in waiting.items() if n)
        if missing:
            raise ValueError(f"optim_in_backward: no gradient reached every leaf of {missing[:5]} (a parameter "
                             "not used in the loss?)")
        return square

    def _update(self, reduced: dict, paths: list, scale: torch.Tensor, finite: torch.Tensor,
                rounding: Optional[torch.Generator]) -> None:
        """AdamW on one layer's reduced gradients (:func:`fmoe.optim.adamw.apply_flat`)."""
        f = self.flat
        p, m, v = adamw.apply_flat(reduced, {k: self.flat_m[k] for k in paths}, {k: self.flat_v[k] for k in paths},
                                   {k: f[k] for k in paths}, self.state["step"] + 1, self.lr, self.cfg.opt,
                                   scale=scale, finite=finite, rounding=rounding, donate=self.cfg.donate)
        self.new_p.update(p)
        self.new_m.update(m)
        self.new_v.update(v)

    def result(self) -> tuple[dict, dict, dict, torch.Tensor]:
        """``(flat_params, opt_state, stats, mean_loss)`` after the last backward: the updated
        leaves in the step's flat form, AdamW's state (the counter advanced unless skipped), the
        statistics (``grad_norm``, ``skipped``) and the world-mean loss."""
        skipped = not (self.updated and bool(torch.isfinite(self.norm)))
        stats = {"grad_norm": self.norm, "skipped": skipped}
        if not self.updated:
            return self.flat, self.state, stats, self.mean_loss
        flat = {k: self.new_p.get(k, t) for k, t in self.flat.items()}
        m = {k: self.new_m.get(k, t) for k, t in self.flat_m.items()}
        v = {k: self.new_v.get(k, t) for k, t in self.flat_v.items()}
        state = {"step": self.state["step"] + (0 if skipped else 1),
                 "m": _tree.unflatten(m, like=self.state["m"]), "v": _tree.unflatten(v, like=self.state["v"])}
        return flat, state, stats, self.mean_loss

