"""Model definitions as pure functions over parameter pytrees (installed as ``fmoe.models``),
and the one registry of them that every program uses.

Each model module holds a frozen ``Config`` dataclass, ``init(cfg, seed)``,
``forward(params, tokens, cfg, mesh=None)``, a default sharding ``plan(cfg)``, the Hugging Face
checkpoint name map and its declared ``MODEL = fmoe.model.Model(...)``. No parallelism logic
lives in a model file. The programs (``fmoe train``, ``fmoe memory``,
``fmoe generate``) find a model by name here, :func:`get`, and read what it offers from its
declared :class:`fmoe.model.Model`; a Hugging Face checkpoint's ``model_type`` is the name.

Example:
    >>> from fmoe import models
    >>> models.NAMES
    ('qwen3_moe', 'mixtral', 'gpt_oss', 'llama', 'deepseek_v3')
    >>> models.get("llama").remat_blocks
    ('layer',)
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from fmoe.model import Model

from . import deepseek_v3, gpt_oss, llama, mixtral, qwen3_moe

__all__ = ["REGISTRY", "NAMES", "get"]

#: name -> declared :class:`fmoe.model.Model`, in the order the programs list them.
REGISTRY: Mapping[str, Model] = MappingProxyType(
    {m.MODEL.name: m.MODEL for m in (qwen3_moe, mixtral, gpt_oss, llama, deepseek_v3)})
NAMES = tuple(REGISTRY)


def get(name: str) -> Model:
    """The declared model registered as ``name``; ``ValueError`` listing the names otherwise.

    Example:
        >>> get("qwen3_moe").routed
        True
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; fmoe.models has {list(NAMES)}")
    return REGISTRY[name]
