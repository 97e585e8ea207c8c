"""Checkpoints: Hugging Face safetensors interop with per-rank slice reads.

- :mod:`~fmoe.checkpoint.spec` and :mod:`~fmoe.checkpoint.nodes`: how one fmoe parameter is made
  of checkpoint tensors (:class:`Key`, :class:`Cat`, :class:`Stack`, :class:`Transpose`,
  :class:`Deinterleave`), able to read only a requested block;
- :mod:`~fmoe.checkpoint.safetensors_io`: the hub directory layout (:class:`Checkpoint` reader,
  :func:`write_checkpoint`);
- :mod:`~fmoe.checkpoint.atomic`: :func:`atomic_directory`, a directory replaced only when complete
  (the one mechanism for exports, training checkpoints and data shards; links refused);
- :mod:`~fmoe.checkpoint.hf`: :func:`load_hf` / :func:`save_hf` for any model module;
- :mod:`~fmoe.checkpoint.training`: sharded training checkpoints ``OUT/step-N`` (DCP, no pickle);
- :mod:`~fmoe.checkpoint.config_check`: a model config read from disk, checked before allocation.
"""

from .atomic import atomic_directory
from .hf import hf_specs_of, load_hf, rank_blocks, save_hf
from .safetensors_io import Checkpoint, write_checkpoint
from .nodes import Cat, Deinterleave, Stack, Transpose
from .spec import Key, Spec

__all__ = ["load_hf", "save_hf", "hf_specs_of", "rank_blocks", "Checkpoint", "write_checkpoint",
           "atomic_directory", "Spec", "Key", "Cat", "Stack", "Transpose", "Deinterleave"]
