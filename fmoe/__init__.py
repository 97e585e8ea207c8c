"""fmoe: functional mixture-of-experts on PyTorch.

Models are pure functions over parameter pytrees; a :class:`Plan` annotates the tree with
placements, :func:`shard` applies it on a :class:`Mesh`, and layer functions insert exactly the
collectives those placements need. The public namespace is made of explicit re-exports.
"""

from . import routing  # noqa: I001  (first: aux_losses builds on it)
from . import aux_losses, collectives, ep, experts, load_stats, nn, regather, shared_experts, testing, tree
from .generate import generate
from .mesh import Mesh
from .moe import moe
from .placement import P
from .plan import STYLES, Plan
from .prefetch import prefetch, prefetch_layers
from .sharding import gather, materialize, placement_of, shard, to_local

__all__ = ["Mesh", "P", "Plan", "STYLES", "shard", "gather", "placement_of", "to_local", "materialize", "prefetch", "prefetch_layers",
           "moe", "generate", "nn", "routing", "aux_losses", "load_stats", "shared_experts", "regather", "ep", "experts", "collectives", "testing", "tree"]
__version__ = "0.1.0"
