"""Load and save a model's parameters as a Hugging Face checkpoint, each rank reading its slices.

A model module plugs in with a few names (``fmoe.models.qwen3_moe`` and friends provide them):

=====================================  =========================================================
``Config.from_hf(d) -> cfg``           build the config from ``config.json``'s dict
``cfg.to_hf() -> dict``                ``config.json`` content (with ``model_type``, ``architectures``)
``hf_specs(cfg, keys=None)``           ``{fmoe_path: Spec}`` (flat dotted paths or a nested tree);
                                       ``keys`` = the checkpoint's keys when loading (pick per-expert
                                       or fused layout by what is there), None when saving (the
                                       layout ``save_pretrained`` writes)
``plan(cfg) -> Plan``                  default placements (used when ``load_hf`` gets a mesh)
``HF_IGNORE`` (optional)               dotted globs of checkpoint keys to ignore (``"**.inv_freq"``)
``__name__``                           the model's name, for messages
=====================================  =========================================================

A model module's declared :class:`fmoe.model.Model` (``qwen3_moe.MODEL``) provides exactly
these; its ``load_hf`` passes ``plan`` as a function of the config (:meth:`Model.build_plan`:
user rules and the model's checks) so the plan is checked before any tensor is read.

``load_hf`` checks everything before it reads a byte: the directory and its files, the config,
that every key the specs name exists with the shape the config implies, that the checkpoint has
no key the specs do not use, and (with a mesh) the plan against the parameter shapes. Then each
rank reads only its own block of every parameter (two blocks for a packed ``[gate | up]``
placement, one per half) and wraps it as a DTensor, so the result equals
``fmoe.shard(full_params, plan, mesh)`` bitwise without any rank holding a full tensor.

``save_hf`` gathers on every rank (parameters or a gradient tree of the same structure), rank 0
splits every tensor back into checkpoint keys with the specs and writes ``config.json`` and the
safetensors files into a temporary directory that replaces ``path`` atomically.

Example:
    >>> import shutil, tempfile
    >>> from fmoe.models import qwen3_moe
    >>> cfg, root = qwen3_moe.Config.tiny(), tempfile.mkdtemp()
    >>> save_hf(qwen3_moe.MODEL, qwen3_moe.init(cfg), cfg, os.path.join(root, "ckpt"))
    >>> params, loaded = load_hf(qwen3_moe.MODEL, os.path.join(root, "ckpt"))
    >>> loaded == cfg, torch.equal(params["layers"][1]["moe"]["w_down"], qwen3_moe.init(cfg)["layers"][1]["moe"]["w_down"])
    (True, True)
    >>> shutil.rmtree(root)
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from .. import tree as _tree
from ..collectives import broadcast_object
from ..mesh import Mesh
from ..sharding import Plan, from_local_slice, gather, rank_blocks
from .atomic import atomic_directory, check_target, checkpoint_file, foreign_files, replace_files
from .integrity import verify_tensors
from .safetensors_io import CONFIG, Checkpoint, write_checkpoint
from .spec import Spec

__all__ = ["load_hf", "save_hf", "hf_specs_of", "rank_blocks"]

_SHOW = 8  # how many offending keys an error message lists


def hf_specs_of(model: Any, cfg: Any, keys: Optional[list[str]] = None) -> tuple[Any, dict[str, Spec]]:
    """The model's specs as ``(tree, {path: Spec})``, checked: Spec leaves, no key used twice.

    Args:
        model: the model module.
        cfg: its config.
        keys: the checkpoint's keys (None when saving).
    Returns:
        the spec tree (parameter-tree structure) and its flat dotted-path view.

    Example:
        >>> from fmoe.models import qwen3_moe
        >>> tree, flat = hf_specs_of(qwen3_moe.MODEL, qwen3_moe.Config.tiny())
        >>> flat["layers.0.moe.w_down"].shape, tree["layers"][0]["moe"]["w_down"] is flat["layers.0.moe.w_down"]
        ((8, 64, 32), True)
    """
    specs = model.hf_specs(cfg, keys)
    if isinstance(specs, Mapping) and specs and all(isinstance(v, Spec) for v in specs.values()):
        specs = _tree.unflatten(dict(specs))
    flat = _tree.flatten(specs)
    owner: dict[str, str] = {}
    for path, s in flat.items():
        if not isinstance(s, Spec):
            raise TypeError(f"{_name(model)}.hf_specs: {path!r} must be a Spec, got {type(s).__name__}")
        for k in s.leaves():
            if k.name in owner:
                raise ValueError(f"{_name(model)}.hf_specs: checkpoint key {k.name!r} is used by both "
                                 f"{owner[k.name]!r} and {path!r}")
            owner[k.name] = path
    return specs, flat


def _name(model: Any) -> str:
    return model.__name__


def _check_keys(model: Any, flat: Mapping[str, Spec], ck: Checkpoint) -> None:
    """One ValueError listing every missing, mis-shaped and unexpected key."""
    used, missing, misshaped = set(), [], []
    for path, spec in flat.items():
        for k in spec.leaves():
            used.add(k.name)
            if k.name not in ck:
                missing.append(f"{k.name!r} (for {path!r}, shape {k.shape})")
            elif ck.shape(k.name) != k.shape:
                misshaped.append(f"{k.name!r} in {os.path.basename(ck.file_of(k.name))} has shape "
                                 f"{ck.shape(k.name)}, the config implies {k.shape} (for {path!r})")
    ignore = tuple(getattr(model, "HF_IGNORE", ()))     # optional in the protocol
    unexpected = [f"{k!r} in {os.path.basename(ck.file_of(k))}" for k in ck.keys()
                  if k not in used and not any(_tree.glob_match(g, k) for g in ignore)]
    problems = [f"{len(v)} {what}: {'; '.join(v[:_SHOW])}{' ...' if len(v) > _SHOW else ''}"
                for what, v in (("missing key(s)", missing), ("mis-shaped key(s)", misshaped),
                                ("unexpected key(s) (not used by any parameter; list them in "
                                 f"{_name(model)}.HF_IGNORE if they are meant to be skipped)", unexpected))
                if v]
    if problems:
        raise ValueError(f"checkpoint {ck.path!r} does not match {_name(model)}: " + " | ".join(problems))


def load_hf(model: Any, path: Union[str, os.PathLike, Checkpoint], mesh: Optional[Mesh] = None,
            plan: Union[Plan, Mapping, None] = None, *, dtype: Optional[torch.dtype] = None) -> tuple[Any, Any]:
    """Read a Hugging Face checkpoint into a parameter tree; with a mesh each rank reads its slices.

    Args:
        model: the model module (see the module docstring for what it provides).
        path: the checkpoint directory, or an open :class:`Checkpoint` (to read ``bytes_read``).
        mesh: None for full tensors; a :class:`fmoe.Mesh` for DTensor leaves, each rank reading
            only its own blocks.
        plan: placements: a Plan, user rules merged over ``model.plan(cfg)``, a function
            ``plan(cfg) -> Plan`` (a model's checked plan), or None for ``model.plan(cfg)``;
            only used with a mesh.
        dtype: cast every parameter to this dtype (default: keep the checkpoint's).
    Returns:
        ``(params, cfg)``; with a mesh ``params`` equals ``fmoe.shard(full, plan, mesh)``.

    Example:
        >>> import shutil, tempfile
        >>> from fmoe.models import llama
        >>> cfg, root = llama.Config.tiny(), tempfile.mkdtemp()
        >>> save_hf(llama.MODEL, llama.init(cfg), cfg, os.path.join(root, "ckpt"))
        >>> params, _ = load_hf(llama.MODEL, os.path.join(root, "ckpt"), dtype=torch.bfloat16)
        >>> params["layers"][0]["mlp"]["w_gate_up"].dtype, tuple(params["layers"][0]["mlp"]["w_gate_up"].shape)
        (torch.bfloat16, (256, 64))
        >>> shutil.rmtree(root)
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"load_hf: dtype must be a torch.dtype or None, got {dtype!r}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"load_hf: mesh must be an fmoe.Mesh or None, got {type(mesh).__name__}")
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    try:
        cfg = _config(model, ck)
        _check_counts(cfg, ck)                             # before building per-layer specs
        tree, flat = hf_specs_of(model, cfg, ck.keys())
        _check_keys(model, flat, ck)
        bound = {p: s.bind(ck) for p, s in flat.items()}
        _check_dtypes(bound, ck, dtype)
        for file in sorted({ck.file_of(k.name) for s in flat.values() for k in s.leaves()}):
            verify_tensors(file)                           # when written by fmoe: before reading
        if mesh is not None:                               # validate the plan before reading
            plan = plan(cfg) if callable(plan) else plan    # e.g. Model.build_plan, given the config
            plan = model.plan(cfg) if plan is None else plan
            plan = plan if isinstance(plan, Plan) else model.plan(cfg).override(plan)
            shapes = _tree.map_with_path(lambda p, s: torch.empty(s.shape, device="meta"), tree)
            placements = _tree.flatten(plan.resolve(shapes, mesh))
        if mesh is None or mesh.dense is None:             # one process: full tensors
            return _tree.map_with_path(lambda p, _: _cast(bound[p].read(), dtype), tree), cfg

        def read(path: str, spec: Spec) -> torch.Tensor:
            p = placements[path]
            blocks, d = rank_blocks(spec.shape, p, mesh)
            parts = [bound[path].read(ix) for ix in blocks]
            local = _cast(parts[0] if len(parts) == 1 else torch.cat(parts, dim=d), dtype)
            return from_local_slice(local, spec.shape, p, mesh)

        return _tree.map_with_path(read, tree), cfg
    finally:
        if ck is not path:
            ck.close()


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _count(pattern: re.Pattern, keys: list[str]) -> Optional[int]:
    ids = {int(m.group(1)) for k in keys if (m := pattern.search(k))}
    return max(ids) + 1 if ids else None


def _check_counts(cfg: Any, ck: Checkpoint) -> None:
    """The config's layer and expert counts against the checkpoint's keys (cheap, no specs)."""
    keys = ck.keys()
    file = os.path.join(ck.path, CONFIG)
    layers = _count(_LAYER, keys)
    want = getattr(cfg, "num_hidden_layers", None)
    if layers is not None and isinstance(want, int) and want != layers:
        raise ValueError(f"{file}: num_hidden_layers is {want} but the checkpoint's tensors hold {layers} "
                         f"layers (model.layers.0 .. {layers - 1})")
    experts = _count(_EXPERT, keys)
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        want = getattr(cfg, field, None)
        if experts is not None and isinstance(want, int) and want != experts:
            raise ValueError(f"{file}: {field} is {want} but the checkpoint's tensors hold {experts} "
                             f"experts per layer (experts.0 .. {experts - 1})")


def _check_dtypes(bound: Mapping[str, Spec], ck: Checkpoint, dtype: Optional[torch.dtype]) -> None:
    """Floating-point parameters of one dtype (or any floats when ``dtype`` casts them)."""
    seen: dict[torch.dtype, str] = {}
    for path, spec in bound.items():
        dt = spec.dtype                                    # parts of one parameter agree
        if not dt.is_floating_point:
            key = spec.leaves()[0].name
            raise ValueError(f"checkpoint {ck.path!r}: tensor {key!r} (for {path!r}) has dtype {dt}; model "
                             "parameters must be floating point")
        seen.setdefault(dt, spec.leaves()[0].name)
    if len(seen) > 1 and dtype is None:
        found = ", ".join(f"{k!r} is {d}" for d, k in seen.items())
        raise ValueError(f"checkpoint {ck.path!r} mixes dtypes ({found}); pass dtype=torch.float32 (or "
                         "another) to load_hf to cast every parameter to one dtype")


def _cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    t = t.contiguous()
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _config(model: Any, ck: Checkpoint) -> Any:
    from .config_check import config_from_dict

    file = os.path.join(ck.path, CONFIG)
    cfg = config_from_dict(model, ck.config, file)     # field types and sizes before any allocation
    want = cfg.to_hf().get("model_type")
    got = ck.config.get("model_type")
    if want is not None and got != want:
        raise ValueError(f"{file}: model_type is {got!r} but {_name(model)} loads model_type {want!r}")
    return cfg


def save_hf(model: Any, params: Any, cfg: Any, path: Union[str, os.PathLike], *,
            max_shard_size: Union[int, str] = "50GB", overwrite: bool = False,
            files: Optional[Mapping[str, bytes]] = None, config_update: Optional[Mapping[str, Any]] = None,
            progress: bool = False) -> None:
    """Write ``params`` as a Hugging Face checkpoint directory, atomically (call on every rank).

    Args:
        model: the model module.
        params: parameter tree (full tensors or DTensors), or a gradient tree of the same structure.
        cfg: the model config (``cfg.to_hf()`` becomes ``config.json``).
        path: the directory to write (replaced only once the new checkpoint is complete).
        max_shard_size: files larger than this split into numbered shards with an index
            (transformers' default, 50GB).
        overwrite: ``path`` may hold other files; only checkpoint files are replaced (without
            it such a directory is refused: ``ValueError`` before anything is gathered).
        files: more files of the checkpoint, ``{name: bytes}`` (the tokenizer's, ``fmoe.json``),
            published with the weights in the same atomic step; names are checkpoint file names
            (:func:`fmoe.checkpoint.atomic.checkpoint_file`).
        config_update: fields merged into ``config.json`` (e.g. the trained router).
        progress: a bar on stderr over the files written (rank 0; :mod:`fmoe.checkpoint.progress`).
    Returns:
        None.

    Example:
        >>> import shutil, tempfile, transformers
        >>> from fmoe.models import mixtral
        >>> cfg, root = mixtral.Config.tiny(), tempfile.mkdtemp()
        >>> save_hf(mixtral.MODEL, mixtral.init(cfg), cfg, os.path.join(root, "out"))
        >>> sorted(os.listdir(os.path.join(root, "out")))
        ['config.json', 'model.safetensors']
        >>> type(transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "out"))).__name__
        'MixtralForCausalLM'
        >>> shutil.rmtree(root)
    """
    _, flat = hf_specs_of(model, cfg, None)
    leaves = _tree.flatten(params)
    missing, extra = sorted(set(flat) - set(leaves)), sorted(set(leaves) - set(flat))
    if missing or extra:
        raise ValueError(f"save_hf: params do not match {_name(model)}.hf_specs: missing {missing[:_SHOW]}, "
                         f"unexpected {extra[:_SHOW]}")
    for p, t in leaves.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_hf: params[{p!r}] must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != flat[p].shape:
            raise ValueError(f"save_hf: params[{p!r}] has shape {tuple(t.shape)}, the config implies "
                             f"{flat[p].shape}")
    config = cfg.to_hf()
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"save_hf: cfg.to_hf() must return a dict with 'model_type', got {config!r}")
    config = {**config, **(config_update or {})}
    files = dict(files or {})
    for name, data in files.items():
        if not isinstance(name, str) or not checkpoint_file(name) or name == CONFIG or name.endswith(".safetensors"):
            raise ValueError(f"save_hf: files: {name!r} is not a checkpoint file name fmoe writes beside the "
                             "weights (tokenizer.json, tokenizer_config.json, special_tokens_map.json, fmoe.json)")
        if not isinstance(data, bytes):
            raise TypeError(f"save_hf: files[{name!r}] must be bytes, got {type(data).__name__}")
    check_target(path, overwrite=overwrite, what="save_hf")
    full = _tree.flatten(gather(params))
    distributed = dist.is_available() and dist.is_initialized()
    error: Optional[BaseException] = None
    if not distributed or dist.get_rank() == 0:
        try:
            tensors: dict[str, torch.Tensor] = {}
            for p, spec in flat.items():
                tensors.update(spec.split(full[p].detach()))
            place = replace_files if foreign_files(os.path.abspath(path)) else atomic_directory
            with place(path) as tmp:
                write_checkpoint(tmp, tensors, config, max_shard_size,
                                 progress=f"exporting {os.fspath(path)}" if progress else None)
                for name, data in files.items():
                    fd = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
        except BaseException as e:  # noqa: BLE001 - every rank must learn that the save failed
            error = e
    if distributed and dist.get_world_size() > 1:
        status = broadcast_object(None if error is None else f"{type(error).__name__}: {error}", src=0)
        if error is None and status is not None:
            raise RuntimeError(f"save_hf: rank 0 failed to write {os.fspath(path)!r}: {status}")
    if error is not None:
        raise error
