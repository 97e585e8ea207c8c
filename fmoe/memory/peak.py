"""The peak of one train step, by phase: what :mod:`fmoe.memory.plan` predicts the dry run measures.

A step's memory peaks at one of five moments, and the plan takes the largest:

- **start of backward**: parameters + moments + every activation kept for backward + the
  loss's backward temporaries (no gradient yet);
- **the first layer's backward**: the same with the log-softmax and that layer's activations gone and its
  backward's temporaries there (:func:`layer_temporaries`: FSDP-split weights gathered again,
  their full-size gradients and the reduce-scatter's buffer, gradients of its expert rows);
- **the last layer's backward**: the same temporaries, only the logits (``b T V``, the step
  holds them until backward ends) left, every other layer's gradient made (where gradients per layer outweigh
  activations per layer, this is the larger);
- **inside the last layer's backward**: as that, while its expert kernels run: its own
  activations still kept, its experts' whole gradients (when not data-split) made but not yet
  handed to the leaves, remat's recomputed activations (a pipeline stage's peak);
- **optimizer**: parameters + moments + every reduced gradient + the temporaries of the
  global gradient norm (:func:`norm_temporaries`: an fp32 copy of the largest local gradient
  when gradients are bf16, nothing for fp32 ones) — the donated AdamW update works in place
  (torch's fused kernel, or by small pieces).

Activations, per rank, with ``b`` the activation dtype's bytes (2 for bf16 compute or bf16
weights), ``T`` tokens per micro-batch, ``q`` / ``kv`` the rank's query / key-value widths
after tp, ``A`` the routing slots this rank's experts compute (:mod:`fmoe.experts.fake_splits`, the
rule the dry run uses)::

    MoE layer     b * (T * (8 D + q + kv) + A * (4 D + 3 I) + 3 T I_shared / tp)   (shared experts: one MLP)
    dense layer   b * T * (8 D + q + kv + 3 I_dense / tp)
    once          b * T * (V + 4 D)            the gathered logits and the embedding side
    loss          + 4 T V kept (one fp32 log-softmax) with --loss-chunks 1

``remat="layer"`` keeps ``b * T * D`` per layer (the layer inputs) plus one layer's
activations; ``remat="moe"`` drops the ``A`` term of all layers but one. The loss's backward
temporaries are ``8 T V`` (two fp32 ``[T, V]``) in one piece, ``2 b T V`` by chunks (the
chunks' gradients and their concatenation). The coefficients were fitted to dry runs of
Qwen3-30B-A3B layer shapes on tp 8 / 4 / 1 meshes (``benchmarks/RESULTS.md``, issue 21) and
are checked against a reduced-size dry run by ``tests/cli/test_dryrun.py``.

Issue 34's options: with ``--optim-in-backward`` no phase holds more than one layer's gradients
and the optimizer's phase is the first layer's update, with nearly every activation alive (with
the clip, the first of two backward passes keeps the graph, so no activation leaves during it);
with ``--sp`` the ``8 D`` per token of a layer (and the ``4 D`` once) sit on ``T / tp`` tokens
(:data:`SP_SPLIT_D`); with ``--pp`` a rank holds its stage's layers and the activations of the
micro-batches in flight (``min(M, pp - s)`` on stage ``s`` with 1F1B, ``M`` with GPipe), and the
last micro-batch's backward adds to the gradients of the others (held through it, as with
``--grad-accum``).

Example:
    >>> peak = step_peak(params=10, grads=10, optimizer=20, activations=50, loss_temps=5, norm_temps=4)
    >>> peak["phase"], peak["total_bytes"], peak["grads_bytes"]
    ('backward', 85, 0)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from ..precision import Precision
from ..experts import fake_splits

__all__ = ["layer_activations", "global_activations", "loss_temporaries", "layer_temporaries", "norm_temporaries",
           "step_peak", "Stage", "rank_peak"]


#: of the ``8 D`` per token a layer keeps beside its attention widths, the part that sequence
#: parallelism keeps on the rank's ``T / tp`` tokens only: all of it (the residual stream, norms,
#: and the inputs of the column-parallel projections, saved as the sequence shard and gathered
#: again in backward), measured by dry runs of 6 layers at tp 2 and 4 (``benchmarks/RESULTS.md``)
SP_SPLIT_D = 8


def layer_activations(w: dict, *, tokens: int, slots: int, tp: int, b: int, moe: bool, sp: bool = False,
                      cp: int = 1) -> int:
    """Activation bytes one decoder layer keeps for backward (module docstring).

    Args:
        w: layer widths as a dict (:meth:`fmoe.model.Model.widths`, ``._asdict()``).
        tokens: T; slots: A, routing slots computed by this rank's experts; tp: tensor parallel
        size; b: activation bytes per element; moe: a MoE layer (else a dense MLP layer);
        sp: sequence parallelism (:data:`SP_SPLIT_D` of the ``8 D`` on ``T / tp`` tokens).
        cp: context parallelism: attention keeps the K/V gathered from the other ``cp - 1`` ranks.
    """
    D = w["D"]
    q, kv = w["H"] * w["hd"] // tp, w["G"] * w["hd"] // tp
    split = SP_SPLIT_D if sp else 0
    attn = tokens * (8 * D - split * D + q + kv) + tokens // tp * split * D + 2 * (cp - 1) * tokens * kv
    ffn = slots * (4 * D + 3 * w["I"]) + tokens * 3 * w["Is"] // tp if moe else tokens * 3 * w["Id"] // tp  # Is: shared
    return b * (attn + ffn)


def global_activations(w: dict, *, tokens: int, b: int, loss_chunks: int, sp_tp: int = 1) -> int:
    """Activation bytes kept once per step: logits, embedding side (on ``tokens / sp_tp`` with
    sequence parallelism), the loss's log-softmax."""
    kept = b * tokens * w["V"] + b * tokens // sp_tp * 4 * w["D"]
    return kept + (4 * tokens * w["V"] if loss_chunks == 1 else 0)


def loss_temporaries(w: dict, *, tokens: int, b: int, loss_chunks: int) -> int:
    """Bytes the loss's backward allocates at the start of backward."""
    return 8 * tokens * w["V"] if loss_chunks == 1 else 2 * b * tokens * w["V"]


def layer_temporaries(*, gathered: int, expert_acts: int) -> int:
    """Bytes one layer's backward allocates at its end: its FSDP-split weights gathered again, their
    full-size gradients and the reduce-scatter's buffer (3 x the gathered bytes), and gradients
    the size of its expert activations."""
    return 3 * gathered + expert_acts


def norm_temporaries(largest: int, grad_bytes: int) -> int:
    """Bytes the global gradient norm allocates (:func:`fmoe.optim.adamw.global_norm`): the
    largest local gradient (``largest`` elements) upcast to fp32 when it is narrower; its row dot
    products read fp32 gradients in place.

    Example:
        >>> norm_temporaries(1000, 2), norm_temporaries(1000, 4)
        (4000, 0)
    """
    return 4 * largest if grad_bytes < 4 else 0


def step_peak(*, params: int, grads: int, optimizer: int, activations: int, loss_temps: int,
              norm_temps: int, layer_acts: int = 0, layer_temps: int = 0, last_acts: int = 0,
              last_grads: int = 0, in_backward: Optional[int] = None,
              retained: Optional[int] = None, held_grads: int = 0,
              inside: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """The largest of the phases, with its bytes by category (``total_bytes`` the peak): the
    start of backward; the first layer's backward (the log-softmax and its own activations going,
    its temporaries ``layer_temps`` there, no gradient yet); the last layer's backward (only
    ``last_acts`` left, ``last_grads`` of gradients already made); the optimizer.

    With the optimizer inside backward (``in_backward``: the largest layer's gradient bytes) no
    phase holds more gradients than that one layer's, and the optimizer's phase is the first
    layer's update (its norm's temporaries) while nearly every activation is still alive;
    ``retained``: the activations a backward that keeps its graph holds throughout (the clip's
    first pass; None: no such pass). ``held_grads``: gradients of earlier micro-batches held
    through every backward phase (the last micro-batch's backward adds to them). ``inside``:
    ``(activations, temporaries)`` of the last layer's backward while its expert kernels run (its
    own activations still kept; its experts' whole gradients, made before the Function returns
    them to the leaves, its recomputed activations under remat) instead of at its end."""
    if in_backward is not None:                  # a layer's gradients come at the end of its backward
        grads, last_grads = in_backward, 0
        if retained is not None:
            layer_acts, last_acts = activations - retained, retained
    phases = [
        ("backward", {"grads_bytes": 0, "activations_bytes": activations, "temporaries_bytes": loss_temps}),
        ("first layer backward", {"grads_bytes": 0, "activations_bytes": activations - layer_acts,
                                  "temporaries_bytes": layer_temps}),
        ("last layer backward", {"grads_bytes": last_grads, "activations_bytes": last_acts,
                                 "temporaries_bytes": layer_temps}),
        ("inside the last layer's backward", {"grads_bytes": last_grads, "activations_bytes": last_acts + inside[0],
                                              "temporaries_bytes": inside[1]}),
        ("optimizer", {"grads_bytes": grads, "activations_bytes": 0, "temporaries_bytes": norm_temps})
        if in_backward is None else         # the first layer updated: the activations are still there
        ("update in backward", {"grads_bytes": grads, "activations_bytes": activations,
                                "temporaries_bytes": norm_temps}),
    ]
    best = None
    for name, cats in phases:
        if name != "optimizer":
            cats["grads_bytes"] += held_grads
        total = params + optimizer + sum(cats.values())
        if best is None or total > best["total_bytes"]:
            best = {"phase": name, "total_bytes": total, "params_bytes": params, "optimizer_bytes": optimizer, **cats}
    return best


class Stage(NamedTuple):
    """What the pipeline and the optimizer-in-backward change in a rank's step: micro-batches in
    flight, first / last stage, the largest layer's gradient bytes (None: the normal step),
    whether a first backward keeps the graph (the clip's norm pass), and the micro-batches of a
    step (``grad_accum`` or the pipeline's: the last one's backward adds to the others' gradients)."""
    inflight: int
    first: bool
    last: bool
    group_grads: Optional[int]
    retained: bool
    micro: int


def rank_peak(w: dict, mesh: Any, T: int, moe_layers: int, layers: int, pol: Precision, remat: str,
          loss_chunks: int, params: int, grads: int, optimizer: int, largest: int, autocast_copies: int,
          gathered: int, unsplit: int, last_grads: int, stage: Stage) -> dict:
    """The step's predicted peak on one rank (:func:`step_peak` of its phases), from the layer
    widths ``w``, its mesh coordinates, the tokens ``T`` of one micro-batch, its stage's layer
    counts and the byte counts :func:`fmoe.memory.plan.memory_plan` adds up; the routing slots
    follow :mod:`fmoe.experts.fake_splits`, the rule the dry run uses."""
    from ..ep.token_dispatch import tp_slice_bounds

    b = 2 if "bf16" in (pol.compute, pol.master) else 4
    if moe_layers and mesh.ep > 1:
        slices = [(lambda ab: ab[1] - ab[0])(tp_slice_bounds(T, mesh.tp, j % mesh.tp)) for j in range(mesh.ep)]
        slots = fake_splits.received(slices, k=w["K"], me=mesh.rank_in("ep"))[1]
    else:
        slots = T * w["K"]
    dense_layers = layers - moe_layers
    kw = dict(tokens=T, tp=mesh.tp, b=b, sp=mesh.sp, cp=mesh.cp)
    moe_l = layer_activations(w, slots=slots, moe=True, **kw) if moe_layers else 0
    dense_l = layer_activations(w, slots=0, moe=False, **kw) if dense_layers else 0
    if remat == "layer":
        acts = (moe_layers + dense_layers) * b * T * w["D"] // (mesh.tp if mesh.sp else 1) + max(moe_l, dense_l)
    elif remat == "moe" and moe_layers:
        expert = b * slots * (4 * w["D"] + 3 * w["I"])
        acts = moe_layers * (moe_l - expert) + expert + dense_layers * dense_l
    else:
        acts = moe_layers * moe_l + dense_layers * dense_l
    head = stage.last                            # logits, the loss and the final norm live on the last stage
    once = global_activations(w, tokens=T, b=b, loss_chunks=loss_chunks, sp_tp=mesh.tp if mesh.sp else 1) if head else 0
    expert = b * slots * (4 * w["D"] + 3 * w["I"]) if moe_layers else 0
    last = max(moe_l, dense_l) if remat == "none" else b * T * w["D"]          # what the first layer's backward frees
    loss_side = 4 * T * w["V"] if loss_chunks == 1 and head else 0   # the log-softmax is gone by then (the logits stay)
    recomputed = max(moe_l, dense_l) if remat == "layer" else 0
    own = max(moe_l, dense_l) if remat == "none" else 0      # the running layer's activations, inside it

    def peak(inflight: int, held: int) -> dict:
        kept = inflight * acts + once + autocast_copies // 2
        return step_peak(params=params, grads=grads, optimizer=optimizer, activations=int(kept),
                         loss_temps=loss_temporaries(w, tokens=T, b=b, loss_chunks=loss_chunks) if head else 0,
                         norm_temps=norm_temporaries(largest, pol.master_dtype.itemsize),
                         layer_acts=int(last + loss_side),
                         layer_temps=layer_temporaries(gathered=gathered, expert_acts=int(expert)),
                         inside=(own, int(expert) + unsplit + recomputed),
                         last_acts=(inflight - 1) * acts + (b * T * w["V"] if head else 0), last_grads=last_grads,
                         in_backward=stage.group_grads, retained=int(kept - recomputed) if stage.retained else None,
                         held_grads=held)

    # the first micro-batch's backward (the most in flight), and the last one's (the others' gradients held)
    return max([peak(stage.inflight, 0)] + ([peak(min(stage.inflight, stage.micro - 1), grads)] if stage.micro > 1 else []),
               key=lambda p: p["total_bytes"])
