"""Layer functions: pure functions of activations and parameters that insert exactly the
collectives their parameters' placements require.

A model written with these functions contains no communication code. Each function reads
``fmoe.placement_of`` of its parameters and the shape of its input, and per rank:

================  ================================  ============================================
function          parameter placement               what it does across ranks
================  ================================  ============================================
linear            ``P()``                           nothing
linear            colwise ``P("tp", None)``         ``grad_sum`` the input (``dx`` all-reduced);
                                                    output = local features, or gathered with
                                                    ``gather=True`` / ``P(..., gather=True)``
linear            rowwise ``P(None, "tp")``         slice a full-width input if needed; partial
                                                    outputs ``all_reduce``d; bias added once
linear            ``packed=2``                      as above, each ``[gate | up]`` half split
embedding         vocab ``P("tp", None)``           own rows, others zero, ``all_reduce``
rms_norm          ``P()``                           nothing (input replicated)
rms_norm          ``P("tp")`` (a projection's       sum of squares ``all_reduce``d over tp: the
                  norm on its tp-split features)    mean over the full width
embedding         ``padding_idx=``                  the pad row gets no gradient (every placement)
head_rms_norm     ``P()`` on tp-split heads         weight gradient marked partial over tp
attention         sinks ``P("tp")`` (local)         nothing: heads are independent
any               ``fsdp`` / ``dp_replicate`` split gathered for the call (``fmoe.fsdp.unshard``),
                                                    gradient reduce-scattered
================  ================================  ============================================

With sequence parallelism (parameters placed on ``fmoe.Mesh(tp=n, sp=True)``, which marks them:
:func:`fmoe.sharding.sequence_parallel`) the activations between tensor-parallel layers are split
over tp on the sequence: a colwise ``linear`` all-gathers its input (``dx`` reduce-scattered), a
rowwise one and the vocabulary-parallel ``embedding`` reduce-scatter instead of all-reducing,
and a replicated weight on the sequence piece (``rms_norm``, a replicated ``linear``) gets a
gradient ``Partial`` over tp (:mod:`fmoe.nn.linear`).

A layer a model author writes asks a weight for its groups the same way: :func:`axis_group`
(``axis_group(w, "tp")``) and :func:`tp_size_rank` (``(group, size, rank)`` of the tp group), then
calls :mod:`fmoe.collectives`.

So changing one plan rule (say, a projection made ``colwise_gather``, or attention replicated)
changes the communication without touching the model, and every plan gives the numbers of a
single process. A replicated activation carries, on every rank, the full gradient of the one
loss that every rank of the tp group computes identically.

Example:
    >>> import torch, fmoe.nn as nn
    >>> x = torch.randn(2, 5, 8)
    >>> h = nn.rms_norm(x, torch.ones(8))
    >>> nn.swiglu_mlp(h, torch.randn(12, 8), torch.randn(8, 6)).shape
    torch.Size([2, 5, 8])
"""

from . import cache, remat
from ._tp import axis_group, tp_size_rank
from .attention import attention, shared_by_heads, visible
from .context_parallel import ContextParallel
from .linear import embedding, linear
from .loss import cross_entropy
from .mlp import swiglu, swiglu_mlp
from .norm import head_rms_norm, rms_norm
from .rope import ROPE_TYPES, apply_rope, rope_cos_sin, rope_frequencies, yarn_mscale

__all__ = ["linear", "embedding", "rms_norm", "head_rms_norm", "rope_frequencies", "rope_cos_sin",
           "apply_rope", "yarn_mscale", "ROPE_TYPES", "attention", "visible", "shared_by_heads", "cache", "remat",
           "swiglu", "swiglu_mlp", "cross_entropy", "axis_group", "tp_size_rank", "ContextParallel"]
