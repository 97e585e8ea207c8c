"""Model definitions as pure functions over parameter pytrees (installed as ``fmoe.models``),
and the one open registry of models that every program uses.

Each model module holds a frozen ``Config`` dataclass, ``init(cfg, seed)``,
``forward(params, tokens, cfg, mesh=None)``, a default sharding ``plan(cfg)``, the Hugging Face
checkpoint name map and its declared ``MODEL = fmoe.model.Model(...)``, written on the public kit
:mod:`fmoe.model`. No parallelism logic lives in a model file.

The programs (``fmoe train``, ``fmoe memory``, ``fmoe generate``) and the Hugging Face paths
(``--init-hf``, ``load_hf``, ``fmoe generate --ckpt HF_DIR``: a checkpoint's ``model_type`` is
the name) find a model with :func:`get`, from three sources, one name each:

- **shipped**: the families in this package (:data:`SHIPPED`);
- **registered**: ``fmoe.models.register(MODEL)`` in this process;
- **entry points**: installed packages declare ``[project.entry-points."fmoe.models"]
  my_moe = "my_pkg.my_moe:MODEL"`` (as pytest finds ``pytest11`` plugins). Their code is
  imported only when their name is looked up; one that fails to import is named in the error for
  that name, and every other model stays usable.

A name in two sources is refused, naming both. Besides names, :func:`get` takes ``module:attr``,
an import path to a :class:`fmoe.model.Model` (``--model my_pkg.my_moe:MODEL``), or the ``Model``
itself. A job and a checkpoint record the model as text (:func:`text_of`): the name, or the
``module:attr`` string; a checkpoint never imports code (``--resume`` of a model that fmoe does
not ship needs ``--model`` again).

Example:
    >>> from fmoe import models
    >>> models.names()[:6]
    ('qwen3_moe', 'mixtral', 'gpt_oss', 'llama', 'deepseek_v3', 'olmoe')
    >>> models.get("llama").remat_blocks
    ('layer',)
    >>> models.get("fmoe.models.llama:MODEL") is models.get("llama")
    True
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys
import types
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

from fmoe.model import Model, model_of

from . import deepseek_v3, gpt_oss, llama, mixtral, olmoe, qwen3_moe

__all__ = ["SHIPPED", "GROUP", "register", "get", "names", "text_of", "hf_model", "recorded"]

#: name -> declared :class:`fmoe.model.Model` of the families fmoe ships, in the order programs list them.
SHIPPED: Mapping[str, Model] = MappingProxyType(
    {m.MODEL.name: m.MODEL for m in (qwen3_moe, mixtral, gpt_oss, llama, deepseek_v3, olmoe)})

#: the entry-point group installed packages declare their models in.
GROUP = "fmoe.models"

#: filled by design: name -> (Model, source) of :func:`register`; the entry points of one ``sys.path``.
_STATE: dict[str, Any] = {"registered": {}, "entry_points": None}

Spec = Union[str, Model, types.ModuleType]


def _entry_points() -> dict[str, list]:
    """Name -> entry points of group :data:`GROUP` (metadata only, read once per ``sys.path``)."""
    key = tuple(sys.path)
    cached = _STATE["entry_points"]
    if cached is None or cached[0] != key:
        found: dict[str, list] = {}
        for ep in importlib.metadata.entry_points(group=GROUP):
            found.setdefault(ep.name, []).append(ep)
        _STATE["entry_points"] = cached = (key, found)
    return cached[1]


def _ep_source(ep: Any) -> str:
    return f"entry point {ep.name} = {ep.value}" + (f" (distribution {ep.dist.name})" if ep.dist is not None else "")


def _sources(name: str) -> list[str]:
    """Every source declaring ``name`` (no code imported)."""
    found = [f"shipped fmoe.models.{name}"] if name in SHIPPED else []
    if name in _STATE["registered"]:
        found.append(_STATE["registered"][name][1])
    return found + [_ep_source(ep) for ep in _entry_points().get(name, ())]


def register(model: Model) -> Model:
    """Make ``model`` findable by its name (``get(model.name)``, ``--model NAME``) in this process.

    Args:
        model: a declared :class:`fmoe.model.Model` (or a model module declaring ``MODEL``).
    Returns:
        the Model. Registering the same object again does nothing; another model of a taken
        name is a ``ValueError`` naming both sources.

    Example:
        >>> register(get("llama")) is get("llama")
        True
    """
    model = _declared(model, "register")
    if SHIPPED.get(model.name) is model or _STATE["registered"].get(model.name, (None,))[0] is model:
        return model
    taken = _sources(model.name)
    source = f"fmoe.models.register() of {model.forward.__module__}"
    if taken:
        raise ValueError(f"fmoe.models.register: model name {model.name!r} is taken by {taken[0]}; refused "
                         f"{source} (rename one Model)")
    _STATE["registered"][model.name] = (model, source)
    return model


def names() -> tuple[str, ...]:
    """Every model name: shipped, registered, then entry points (read from metadata, not imported).

    Example:
        >>> "deepseek_v3" in names()
        True
    """
    return tuple(dict.fromkeys([*SHIPPED, *_STATE["registered"], *_entry_points()]))


def _declared(obj: Any, what: str) -> Model:
    if isinstance(obj, Model) or (isinstance(obj, types.ModuleType) and isinstance(vars(obj).get("MODEL"), Model)):
        return model_of(obj)
    kind = type(obj).__qualname__ if type(obj).__module__ == "builtins" else f"{type(obj).__module__}.{type(obj).__qualname__}"
    raise TypeError(f"{what}: expected an fmoe.model.Model (or a module declaring MODEL = Model(...)), got a {kind}")


def _import(spec: str) -> Model:
    """The Model at ``module:attr`` (``ValueError`` naming what went wrong, in one line)."""
    module, _, attr = spec.partition(":")
    if not module or not attr or ":" in attr:
        raise ValueError(f"model {spec!r}: an import path is module:attr (e.g. my_pkg.my_moe:MODEL)")
    try:
        obj = importlib.import_module(module)
    except Exception as e:                  # any failure of the user's module: reported in one line
        raise ValueError(f"model {spec!r}: importing {module} failed: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from e
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"model {spec!r}: {module} has no attribute {attr}") from None
    try:
        return _declared(obj, f"model {spec!r}")
    except TypeError as e:
        raise ValueError(str(e)) from None


def _load_entry_point(name: str) -> Model:
    eps = _entry_points()[name]
    try:
        model = _declared(eps[0].load(), f"model {name!r} ({_ep_source(eps[0])})")
    except Exception as e:                  # the entry point named; every other model stays usable
        raise ValueError(f"model {name!r}: {_ep_source(eps[0])} failed to load: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from e
    if model.name != name:
        raise ValueError(f"model {name!r}: {_ep_source(eps[0])} loads a Model named {model.name!r}; "
                         "the entry point's name must be the Model's name")
    return model


def get(spec: Spec) -> Model:
    """The declared model ``spec`` names.

    Args:
        spec: a model name (shipped, registered or an entry point), ``module:attr`` (an import
            path to a :class:`fmoe.model.Model`), or the Model (or model module) itself.
    Returns:
        the :class:`fmoe.model.Model`.
    Raises:
        ValueError: an unknown name (listing the names), a name two sources declare (naming
            both), a module that fails to import, a missing attribute, an object that is not a
            Model (its type named), an entry point that fails to load (named).

    Example:
        >>> get("qwen3_moe").routed
        True
        >>> get("fmoe.models.llama:init")
        Traceback (most recent call last):
        ValueError: model 'fmoe.models.llama:init': expected an fmoe.model.Model (or a module declaring MODEL = Model(...)), got a function
    """
    if not isinstance(spec, str):
        return _declared(spec, "fmoe.models.get")
    if ":" in spec:
        return _import(spec)
    found = _sources(spec)
    if len(found) > 1:
        raise ValueError(f"model {spec!r} is declared twice: by {found[0]} and by {found[1]}; remove one")
    if spec in SHIPPED:
        return SHIPPED[spec]
    if spec in _STATE["registered"]:
        return _STATE["registered"][spec][0]
    if spec in _entry_points():
        return _load_entry_point(spec)
    raise ValueError(f"unknown model {spec!r}; fmoe.models has {list(names())}, or give module:attr")


def text_of(spec: Spec) -> str:
    """How a job and a checkpoint record the model ``spec`` names (checked by :func:`get` first).

    Args:
        spec: as :func:`get` takes it.
    Returns:
        a name or ``module:attr`` as given; for a Model object, its name (the Model is
        :func:`register`-ed, so the name finds it in this process).

    Example:
        >>> text_of(get("mixtral")), text_of("fmoe.models.mixtral:MODEL")
        ('mixtral', 'fmoe.models.mixtral:MODEL')
    """
    model = get(spec)
    if isinstance(spec, str):
        return spec
    return register(model).name


def hf_model(path: Union[str, os.PathLike], given: Optional[Spec] = None) -> str:
    """The model of a Hugging Face checkpoint directory (``--init-hf``, ``fmoe generate --ckpt
    HF_DIR``, ``fmoe memory --config``): its ``config.json``'s ``model_type``, a name of this
    registry, or the model ``given`` (``--model``), which must load that ``model_type``.

    Args:
        path: the checkpoint directory (or its ``config.json``).
        given: the ``--model`` given (as :func:`get` takes it), or None.
    Returns:
        the model as text (:func:`text_of`): ``given``'s, else the ``model_type``.
    Raises:
        ValueError: no readable ``config.json`` / ``model_type``, an unknown one, or another type's ``given``.

    Example:
        >>> import tempfile; d, llama = tempfile.mkdtemp(), get("llama")
        >>> llama.save_hf(llama.init(llama.Config.tiny()), llama.Config.tiny(), d); hf_model(d)
        'llama'
        >>> hf_model(d, "mixtral")
        Traceback (most recent call last):
        ValueError: ...config.json: model_type 'llama' is not the model_type of mixtral ('mixtral')
    """
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: cannot read it as JSON ({e})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if given is not None:
        model = get(given)
        if kind is not None and model.Config.HF.get("model_type") != kind:
            raise ValueError(f"{file}: model_type {kind!r} is not the model_type of {model.name} "
                             f"({model.Config.HF.get('model_type')!r})")
        return text_of(given)
    if not isinstance(kind, str) or not kind or ":" in kind:
        raise ValueError(f"{file}: model_type is {kind!r}, not a model name (pass --model)")
    if not _sources(kind):
        raise ValueError(f"{file}: model_type {kind!r} is not a model of fmoe.models ({', '.join(names())}); "
                         f"register it (fmoe.models.register, an entry point of group {GROUP!r}) or pass "
                         "--model module:attr")
    return kind


def recorded(text: Any, given: Optional[Spec], file: str) -> Model:
    """The model a training checkpoint records as ``text`` (``meta.json``'s ``model``), as a
    resume or ``fmoe generate`` may use it. A checkpoint never imports code: without ``given``
    only a model fmoe ships is taken; any other needs the user's ``--model``, naming it (the
    same text, a Model of that name, or a Model defined in the recorded ``module:attr``'s module).

    Args:
        text: the recorded model.
        given: the ``--model`` given, or None.
        file: the record's file (for messages).
    Returns:
        the :class:`fmoe.model.Model`.
    Raises:
        ValueError: not a model's text, a model fmoe does not ship without ``given``, another ``given`` model.

    Example:
        >>> recorded("llama", None, "meta.json").name
        'llama'
        >>> recorded("my_pkg.moe:MODEL", None, "meta.json")
        Traceback (most recent call last):
        ValueError: meta.json: 'model' is 'my_pkg.moe:MODEL', not one of the models fmoe ships (qwen3_moe, mixtral, gpt_oss, llama, deepseek_v3, olmoe); a checkpoint never chooses code to import and run. If you trust it, pass --model my_pkg.moe:MODEL again
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"{file}: 'model' is {text!r}; a model is recorded as its name or module:attr")
    if given is None:
        if text in SHIPPED:
            return get(text)
        raise ValueError(f"{file}: 'model' is {text!r}, not one of the models fmoe ships ({', '.join(SHIPPED)}); a "
                         f"checkpoint never chooses code to import and run. If you trust it, pass --model {text} again")
    model = get(given)
    if given != text and model.name != text and text.partition(":")[0] != model.forward.__module__:
        raise ValueError(f"{file}: 'model' is {text!r}; --model {text_of(given)} names another model ({model.name!r})")
    return model
