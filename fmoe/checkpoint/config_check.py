"""A model config read from disk, checked before anything is allocated.

A ``config.json`` (Hugging Face), a training checkpoint's ``meta.json`` or a memory-plan
``--config`` is data, not code: every field is checked against the type its config dataclass
declares (an int field holds an int, a float field a finite number, sizes are not negative and
below ``2**24``), in the raw dict before the config is even built (a config's own checks may
allocate, e.g. its rotary table); for callers that build the full model, the parameter count
is then computed from the model's checkpoint specs (shapes only, no tensor) and must fit in
this machine's memory. So a ``head_dim`` of ``4e9``
is one error line naming the file and the field, not a 16 GB allocation.

Example:
    >>> from fmoe.models import llama
    >>> cfg = config_from_dict(llama, llama.Config.tiny().to_hf(), "config.json", fits=True)
    >>> param_bytes(llama, cfg) > 0
    True
    >>> config_from_dict(llama, [1, 2], "config.json")
    Traceback (most recent call last):
    ...
    ValueError: config.json: expected a JSON object (the model config), got list
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

__all__ = ["config_from_dict", "read_config", "check_config", "param_bytes", "check_fits", "memory_bytes"]

MAX_DIM = 2 ** 24           # a size field at or above this cannot be a real model's (16M)
MAX_LAYERS = 100_000


def memory_bytes() -> int:
    """Physical memory of this machine in bytes (a bound no allocation can exceed)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):      # not POSIX: no bound
        return 2 ** 62


def _check_fields(config_type: Any, values: dict, where: str, raw: bool) -> None:
    for f in dataclasses.fields(config_type):
        if f.name not in values:
            continue
        value, default = values[f.name], f.default
        if value is None and (raw or "Optional" in str(f.type) or "None" in str(f.type)):
            continue                                    # raw: Config.from_hf decides; built: declared optional
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {f.name!r} must be true or false, got {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_DIM:
                raise ValueError(f"{where}: {f.name!r} must be an integer in [0, 2**24), got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{where}: {f.name!r} must be a finite number, got {value!r}")


def check_config(model: Any, cfg: Any, where: str) -> None:
    """Check every field of ``cfg`` (a config dataclass, or the raw dict it is built from)
    against the type ``model.Config`` declares for it (see the module docstring). A null in the
    raw dict is left to ``Config.from_hf`` (transformers writes ``"head_dim": null`` for "derive
    it"); in the built config only an ``Optional`` field may hold None.
    Raises ``ValueError`` naming ``where``, the field and the value."""
    config_type = getattr(model, "Config", None)
    if not dataclasses.is_dataclass(config_type):
        return
    values = cfg if isinstance(cfg, dict) else {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    _check_fields(config_type, values, where, raw=isinstance(cfg, dict))


def param_bytes(model: Any, cfg: Any, itemsize: int = 4) -> int:
    """Bytes of the parameters of ``cfg`` at ``itemsize`` bytes per value, from the specs' shapes
    (no tensor is made)."""
    from ..tree import flatten
    from .spec import Spec

    specs = model.hf_specs(cfg, None)               # flat {path: Spec} or a nested tree of them
    flat = specs if all(isinstance(v, Spec) for v in specs.values()) else flatten(specs)
    return itemsize * sum(math.prod(s.shape) for s in flat.values())


def check_fits(nbytes: int, what: str, where: str, limit: Optional[int] = None) -> None:
    """``ValueError`` naming ``where`` when ``nbytes`` exceed ``limit`` (default: this machine's
    physical memory)."""
    limit = memory_bytes() if limit is None else limit
    if nbytes > limit:
        raise ValueError(f"{where}: {what} need {nbytes / 1e9:.3g} GB, more than this machine's "
                         f"{limit / 1e9:.3g} GB of memory; check the sizes")


def config_from_dict(model: Any, d: Any, where: str, *, fits: bool = False) -> Any:
    """The model config of a ``config.json``-style dict, checked (fields, then the size of one
    fp32 copy of the parameters against memory when ``fits``).

    Args:
        model: the model module (``Config.from_hf``, ``hf_specs``).
        d: the dict read from disk.
        where: the file (for messages).
        fits: also check that one full fp32 copy of the parameters fits in this machine's memory
            (for callers that build one, e.g. a resumed job's ``init``; not for a sharded
            ``load_hf`` or a memory plan of a larger machine).
    Returns:
        the config.
    Raises:
        ValueError: naming ``where``, the field and the value.
    """
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object (the model config), got {type(d).__name__}")
    check_config(model, d, where)                       # before the config's own checks run
    try:
        cfg = model.Config.from_hf(d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: not a valid {getattr(model, '__name__', 'model')} config "
                         f"({type(e).__name__}: {e})") from None
    check_config(model, cfg, where)
    if fits:
        layers = getattr(cfg, "num_hidden_layers", None)   # the specs below loop over the layers
        if isinstance(layers, int) and layers > MAX_LAYERS:
            raise ValueError(f"{where}: 'num_hidden_layers' is {layers}; at most {MAX_LAYERS} are supported")
        try:
            nbytes = param_bytes(model, cfg)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a valid config ({type(e).__name__}: {e})") from None
        check_fits(nbytes, "the fp32 parameters", where)
    return cfg


def read_config(model: Any, path: str, *, fits: bool = False) -> Any:
    """:func:`config_from_dict` of the JSON file ``path`` (one-line ``ValueError`` on unreadable
    or invalid JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return config_from_dict(model, d, path, fits=fits)
