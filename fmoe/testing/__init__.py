"""Test your code on local gloo ranks: ``spawn`` (fresh ranks), ``Pool`` (warm ranks),
``assert_parity`` (one process vs. several meshes) and a pytest plugin (``@pytest.mark.ranks``).

- :func:`spawn` (``spawn.py``): one function on N fresh ranks; seconds per call.
- :class:`Pool` (``pool.py``): N ranks kept alive, each call on a clean slate; milliseconds.
- :func:`assert_parity` (``parity.py``): a function of a parameter tree on one process equals
  itself sharded by a plan on each mesh: outputs and the gathered gradients of every leaf.
- :func:`check_model` (``conformance.py``): a model's conformance suite in one call: plan,
  transformers parity (logits, every gradient, checkpoints both ways), greedy generation, each
  mesh against one process, ``torch.func.grad``, ``torch.compile``, remat.
- the pytest plugin (entry point ``pytest11``: ``@pytest.mark.ranks(4)`` and the session fixture
  ``fmoe_pools``) is the top-level module ``fmoe_pytest``, outside this package, so that loading it
  imports neither torch nor fmoe.

All of them start ranks through :mod:`fmoe.launch`: loopback only, ``FileStore`` rendezvous, the
first failing rank's traceback re-raised, timeouts, no orphans.
"""

from fmoe.launch import RemoteTraceback, free_port
from fmoe.testing.conformance import check_model
from fmoe.testing.parity import assert_parity
from fmoe.testing.pool import Pool
from fmoe.testing.spawn import spawn

__all__ = ["spawn", "Pool", "assert_parity", "check_model", "RemoteTraceback", "free_port"]
