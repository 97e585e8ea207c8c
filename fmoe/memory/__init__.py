"""Memory of a training job before running it: one home for the estimate and its check.

- :mod:`fmoe.memory.plan`: ``memory_plan`` / ``format_plan`` / ``activation_estimate`` /
  ``VirtualMesh``: per-rank bytes of a job (parameters, gradients, optimizer state,
  activations, collectives) from the model's declared widths, no tensors allocated;
- :mod:`fmoe.memory.peak`: the step's predicted peak by phase, which the plan reports per rank;
- :mod:`fmoe.memory.dry_run`: ``dry_run``, the real train step per rank role on fake tensors
  over the fake process group, measured by category (``dry_run_report`` sets it beside the
  plan, ``format_report`` prints both); :mod:`fmoe.memory.tracker` holds what it measures with.

The split-size rule on fake tensors that the plan counts with lives beside the expert layer
(:mod:`fmoe.experts.fake_splits`): the dispatch and the experts never import this package.
The program is ``fmoe memory``. This ``__init__`` imports nothing.

Example:
    >>> from fmoe.memory.plan import memory_plan
    >>> from fmoe.models import qwen3_moe
    >>> plan = memory_plan(qwen3_moe, qwen3_moe.Config.tiny(), nproc=2, ep=2, batch=1, seq=8)
    >>> len(plan["ranks"]), plan["max_total_bytes"] > 0
    (2, True)
"""
