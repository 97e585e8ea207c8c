"""fmoe: functional mixture-of-experts on PyTorch.

Models are pure functions over parameter pytrees; a :class:`Plan` annotates the tree with
placements, :func:`shard` applies it on a :class:`Mesh`, and layer functions insert exactly the
collectives those placements need. The public namespace is made of explicit re-exports; the map
of the modules is ``ARCHITECTURE.md``.

The test harness :mod:`fmoe.testing` (warm gloo ranks, ``spawn``, ``assert_parity``) is not
imported with the package: ``fmoe.testing`` loads it on first use.
"""

from . import collectives, ep, experts, fsdp, nn, optim, routing, tree
from .fsdp import unshard, unshard_layer, unsharded_layers
from .model.generate import generate
from .mesh import Mesh
from .moe import moe
from .sharding import STYLES, P, Plan, gather, placement_of, shard, to_local
from .checkpoint.tree_io import load, save

__all__ = ["Mesh", "P", "Plan", "STYLES", "shard", "gather", "placement_of", "to_local", "unshard", "unshard_layer",
           "unsharded_layers", "moe", "generate", "nn", "routing",
           "fsdp", "ep", "experts", "collectives", "testing", "tree", "optim", "save", "load"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``fmoe.testing``, the test harness, imported on first use (``import fmoe`` does not load it)."""
    if name == "testing":
        import importlib

        return importlib.import_module(f"{__name__}.testing")       # sets fmoe.testing: asked once
    raise AttributeError(f"module 'fmoe' has no attribute {name!r}")
