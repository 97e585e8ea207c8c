"""``--export-hf DIR``: the Hugging Face checkpoint of what was trained, router and tokenizer too.

An export is the weights *and* what decodes them as they were trained:

- the router: where the model's own Hugging Face config can say it (its declared
  :attr:`fmoe.model.Model.hf_router`: the
  scheme the model's default router uses, with its arguments mapped onto config fields, e.g.
  ``topk:k=2,normalize=False`` on qwen3_moe is ``num_experts_per_tok=2, norm_topk_prob=false``),
  it is written there, so transformers runs the same routing; in every case ``config.json``
  carries ``"fmoe_router"`` (the ``--router`` spec; null for the model's own router) and
  ``fmoe.json`` records the router, the tokenizer and the run;
- the tokenizer that made the training data (its ``tokenizer.json`` and, when beside it,
  ``tokenizer_config.json`` / ``special_tokens_map.json``); byte tokens are recorded as
  ``"tokenizer": "bytes"`` in ``fmoe.json``.

Everything is written into the export's temporary directory and published with the weights in
one atomic step (:func:`fmoe.checkpoint.hf.save_hf`); nothing is copied through a link.

Example:
    >>> hf_router_fields("qwen3_moe", "topk:k=2,normalize=False")
    {'num_experts_per_tok': 2, 'norm_topk_prob': False}
    >>> hf_router_fields("qwen3_moe", "sigmoid_topk:k=2") is None
    True
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

__all__ = ["FMOE_RECORD", "hf_router_fields", "export_hf"]

FMOE_RECORD = "fmoe.json"


def hf_router_fields(model: Any, spec: Optional[str]) -> Optional[dict]:
    """The Hugging Face config fields that express router ``spec`` on ``model``; None when its
    config cannot (another scheme, or arguments it has no field for); ``{}`` for no spec.

    Args:
        model: the model (a name or module:attr of ``fmoe.models``, or its Model).
        spec: the ``--router`` value (None: the model's own router).
    Returns:
        ``{config field: value}`` or None.
    """
    from ..routing.spec import parse_spec

    if spec is None:
        return {}
    module, name, kwargs = parse_spec(spec, "--router")
    from ..models import get

    scheme, fields, fixed = get(model).hf_router or (None, {}, {})
    if module != "fmoe.routing" or name != scheme or "k" not in kwargs:
        return None
    if any(kwargs.get(k, v) != v for k, v in fixed.items()) or set(kwargs) - set(fields) - set(fixed):
        return None
    return {fields[k]: v for k, v in kwargs.items() if k in fields}


def _tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    from ..data import TOKENIZER_FILES

    path = getattr(tokenizer, "path", None)
    if not path:
        return {}
    files = {}
    for name in TOKENIZER_FILES:
        f = path if name == "tokenizer.json" else os.path.join(os.path.dirname(path), name)
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                files[name] = fh.read()
    return files


def export_hf(model: Any, params: Any, cfg: Any, path: str, *, model_name: str, router: Optional[str],
              tokenizer: Any, step: int, overwrite: bool = False, progress: bool = False, mesh: Any = None) -> None:
    """Write the export (see the module docstring); call on every rank.

    Args:
        model: the model module.
        params, cfg: what was trained.
        path: ``--export-hf DIR``.
        model_name: ``--model``.
        router: the ``--router`` spec (None: the model's own).
        tokenizer: the job's tokenizer (from :func:`fmoe.training.options.resolve_tokenizer`).
        step: the step the weights are at.
        overwrite: as ``--overwrite``.
        progress: a bar on stderr (rank 0 without ``--quiet``).
        mesh: the training mesh; with ``pp > 1`` each stage's leaves are gathered and joined
            into the whole model first (every stage's first rank sends its part).
    """
    from ..checkpoint.hf import save_hf
    from ..model import model_of

    fields = hf_router_fields(model_of(model), router)
    record = {"format": "fmoe-export/1", "model": model_name, "router": router,
              "router_in_hf_config": fields is not None, "tokenizer": tokenizer.name,
              "tokenizer_digest": tokenizer.digest, "step": step}
    files = {**_tokenizer_files(tokenizer), FMOE_RECORD: (json.dumps(record, indent=2) + "\n").encode()}
    if mesh is not None and mesh.pp > 1:                # every stage's part, joined (fmoe.training.pipeline)
        from .. import tree as _tree
        from ..sharding import gather
        from .pipeline import stage_leads

        part = {k: v.detach().cpu() for k, v in _tree.flatten(gather(params)).items()}
        part = part if mesh.rank % mesh.stage_world == 0 else {}      # only the stage leads' parts are read
        params = _tree.unflatten({k: v for d in stage_leads(part, mesh) for k, v in d.items()})
    save_hf(model_of(model), params, cfg, path, overwrite=overwrite, files=files,
            config_update={**(fields or {}), "fmoe_router": router}, progress=progress)
