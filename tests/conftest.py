"""Shared test settings: small thread counts keep many gloo ranks workable on 2 cores.

The fmoe pytest plugin (``fmoe.testing.plugin``: ``@pytest.mark.ranks``, the ``fmoe_pools``
fixture) is loaded through its ``pytest11`` entry point once fmoe is installed; a checkout whose
installed metadata predates the entry point loads it here."""

import os
from importlib.metadata import entry_points

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

_INSTALLED = any(ep.value == "fmoe.testing.plugin" for ep in entry_points(group="pytest11"))
pytest_plugins = ["pytester"] + ([] if _INSTALLED else ["fmoe.testing.plugin"])
