"""The public model kit: the declared model interface and everything a model file is built from.

A model is a module (shipped in ``fmoe.models`` or anywhere else) written on this kit, imported
as ``from fmoe import model as kit`` (``docs/adding-a-model.md``):

- :mod:`fmoe.model.config`: :class:`ModelConfig` (the ``Config`` base: presets as data,
  ``config.json`` both ways), :func:`check_config`, :func:`rope`, :func:`rope_from_hf`,
  :func:`from_hf_fields`, :func:`to_hf_fields`;
- :mod:`fmoe.model.shapes`: one shape table (:func:`decoder_shapes`, :func:`attention_shapes`)
  feeding :func:`init_params`; :func:`init_kv_cache`; :data:`TP_FIELDS`;
- :mod:`fmoe.model.decoder`: the forward scaffold (:func:`start`, :class:`Context`,
  :class:`Outputs`, :func:`moe`, :func:`mlp`, :func:`lm_head`), the router-loss switch
  (:func:`with_aux_loss`, :data:`AUX_LOSS_FIELDS`; its formula against transformers');
- :mod:`fmoe.model.hf_names`: the name map (:func:`hf_specs`, :func:`hf_names`, :class:`Experts`, :data:`HF_TOP`);
- here: :class:`Model`, what a generic loader and trainer need from a model, declared once.

Each model module declares one :class:`Model` and offers its shared methods as module
attributes through a PEP 562 module ``__getattr__``::

    MODEL = kit.Model("qwen3_moe", Config, init, forward, plan, hf_specs, tp_fields=kit.TP_FIELDS)

    def __getattr__(name):               # qwen3_moe.load_hf, .save_hf, .shard, .check_plan
        return MODEL.attribute(__name__, name)

so the wrappers every model needs are written once, here, and code that handles any model
(the trainer, the CLI, the checkpoint loader, the memory plan) reads the declared object
(:func:`model_of`, or the registry :func:`fmoe.models.get`) instead of probing a module: what a
model offers is a field here (the blocks it marks for recomputation, the config fields holding
its layer widths, its router-loss switch). ``forward`` of a ``routed`` model (one with MoE
layers) takes ``impl=``, ``router=`` and ``return_aux=``; a dense model's takes neither.

Plans are built in one place, :meth:`Model.build_plan`::

    default plan(cfg) -> user rules (a Plan replaces it; a mapping merges over it by key)
      -> model checks (tp divides every config field of ``tp_fields`` whose dim the plan splits
         over tp: whole heads per tp rank; a split fused gate/up is packed, each half split)
      -> data-parallel additions (``fsdp`` / ``efsdp`` per leaf, :func:`fmoe.fsdp.data_parallel_plan`)

Mesh sizes themselves are checked by :class:`fmoe.Mesh`, dims divisible by their axes by
:meth:`fmoe.Plan.resolve`.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Union

import torch

from .. import tree as _tree
from ..checkpoint import hf as _hf
from ..fsdp import data_parallel_plan
from ..mesh import Mesh
from ..sharding import Plan
from ..sharding import shard as _shard
from .config import (NOT_PASSED, ModelConfig, check_config, from_hf_fields, positions_warning, rope, rope_from_hf,
                     to_hf_fields)
from .decoder import AUX_LOSS_FIELDS, Context, Outputs, lm_head, mlp, moe, start, with_aux_loss
from .hf_names import HF_TOP, Experts, Names, hf_names, hf_specs
from .plan_checks import check_sequence_parallel, check_tp_splits
from .shapes import TP_FIELDS, attention_shapes, decoder_shapes, init_kv_cache, init_params
from .widths import WIDTH_FIELDS, Widths, field_of, read_widths

__all__ = ["Model", "model_of", "Widths", "WIDTH_FIELDS", "PRESETS", "EXPORTS",
           "ModelConfig", "check_config", "rope", "rope_from_hf", "from_hf_fields", "to_hf_fields", "NOT_PASSED",
           "positions_warning", "TP_FIELDS", "decoder_shapes", "attention_shapes", "init_params", "init_kv_cache",
           "AUX_LOSS_FIELDS", "Context", "Outputs", "start", "moe", "mlp", "lm_head", "with_aux_loss",
           "HF_TOP", "Names", "Experts", "hf_specs", "hf_names"]

Rules = Union[Plan, Mapping, None]

#: The preset sizes every model's ``Config`` offers (``Config.tiny()``, from its ``PRESETS`` table).
PRESETS = ("tiny", "small")

#: The :class:`Model` methods a model module offers as its own attributes (:meth:`Model.attribute`).
EXPORTS = ("check_plan", "shard", "load_hf", "save_hf", "init_cache")


@dataclass(frozen=True)
class Model:
    """A model module's declared interface.

    Attributes:
        name: the module's short name (``"qwen3_moe"``), used in messages.
        Config: the frozen config dataclass (``Config.tiny()``, ``Config.from_hf``, ``cfg.to_hf()``).
        init: ``init(cfg, seed=0, dtype=float32) -> params``.
        forward: ``forward(params, tokens, cfg, mesh=None, ...) -> logits``.
        plan: ``plan(cfg) -> Plan``, the default placements.
        hf_specs: ``hf_specs(cfg, keys=None) -> {path: Spec}``: the checkpoint name map.
        hf_ignore: dotted globs of checkpoint keys the loader skips (default: rotary ``inv_freq`` buffers).
        tp_fields: ``{(name inside a layer, dim): config field}`` tp must divide when it splits that dim.
        fused_gate_up: layer parameter names holding a fused ``[gate | up]`` (split per half).
        routed: whether ``forward`` takes ``impl=``, ``router=`` and ``return_aux=`` (MoE layers).
        init_cache: ``init_cache(cfg, batch, max_len, mesh=None, dtype=...) -> cache``, or None.
        aux_loss_fields: ``(switch, coefficient)`` config fields of the router's load-balance loss
            (``output_router_logits``, ``router_aux_loss_coef``), or None (:meth:`with_aux_loss`).
        remat_blocks: the blocks ``forward`` marks for :mod:`fmoe.nn.remat` (``--remat`` choices).
        context_parallel: ``forward`` runs on a context-parallel mesh: it starts with :func:`start` (the
            rank's chunks and their positions) and passes ``cp=ctx.cp`` to ``fmoe.nn.attention``
            (``--cp`` is refused otherwise, before any rank starts).
        width_fields: shape letter -> config field, over :data:`WIDTH_FIELDS` (:meth:`widths`).
        hf_router: how the model's Hugging Face config states its router, for exports:
            ``(fmoe.routing scheme, {scheme argument: config field}, {fixed argument: value})``,
            or None when the config has no router fields.
        router: ``router(cfg, biased=False)``: the router ``forward`` uses by default (``biased``:
            its twin that also reads ``expert_bias``, for ``--balance bias``); None for a dense model.
        router_scores: the default router's scores (``"softmax"`` or ``"sigmoid"``; the balance losses' too).
        hf_expert_bias: the Hugging Face format holds the expert bias (exportable after bias updates).
        balance: the model's own load balancing (``"aux"``, or ``"bias"``: expert-bias updates).
    """

    name: str
    Config: type
    init: Callable
    forward: Callable
    plan: Callable[[Any], Plan]
    hf_specs: Callable
    hf_ignore: tuple = ("**.rotary_emb.inv_freq",)
    tp_fields: Mapping[tuple, str] = field(default_factory=dict)
    fused_gate_up: tuple = ("mlp.w_gate_up", "mlp.b_gate_up")
    routed: bool = True
    init_cache: Optional[Callable] = None
    aux_loss_fields: Optional[tuple] = None
    remat_blocks: tuple = ("layer", "moe")
    context_parallel: bool = False
    width_fields: Mapping[str, Optional[str]] = field(default_factory=dict)
    hf_router: Optional[tuple] = None
    router: Optional[Callable] = None
    router_scores: str = "softmax"
    hf_expert_bias: bool = False
    balance: str = "aux"

    def __post_init__(self):
        unknown = sorted(set(self.width_fields) - set(WIDTH_FIELDS))
        if unknown:
            raise ValueError(f"Model {self.name!r}: width_fields has unknown letters {unknown}; "
                             f"valid: {list(WIDTH_FIELDS)}")

    @property
    def __name__(self) -> str:       # the checkpoint loader's messages name the model
        return self.name

    @property
    def HF_IGNORE(self) -> tuple:    # upper case: the checkpoint loader's protocol name
        return self.hf_ignore

    def attribute(self, module: str, name: str) -> Any:
        """A model module's attribute ``name`` from :data:`EXPORTS` (its PEP 562 ``__getattr__``):
        ``AttributeError`` for any other name, as for a missing module attribute.

        Example:
            >>> from fmoe.models import llama
            >>> llama.load_hf == llama.MODEL.load_hf
            True
        """
        if name in EXPORTS and getattr(self, name) is not None:
            return getattr(self, name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    def with_aux_loss(self, cfg: Any, weight: float) -> Any:
        """``cfg`` with the router's load-balance loss on at ``weight`` (off at 0), through the
        declared :attr:`aux_loss_fields`; ``cfg`` unchanged for a model without them."""
        if self.aux_loss_fields is None:
            return cfg
        switch, coef = self.aux_loss_fields
        return replace(cfg, **{switch: weight > 0, coef: weight})

    def _field(self, letter: str) -> Optional[str]:
        return field_of(letter, self.width_fields)

    def widths(self, cfg: Any) -> Widths:
        """The layer widths of ``cfg``, read from the declared :attr:`width_fields`; the shared
        experts' hidden ``Is`` from the shape table (``layers.N.moe.shared.w_down [D, Is]``).

        Example:
            >>> from fmoe.models import mixtral
            >>> w = mixtral.MODEL.widths(mixtral.Config.tiny())
            >>> (w.E, w.K) == (mixtral.Config.tiny().num_local_experts, mixtral.Config.tiny().num_experts_per_tok)
            True
        """
        Is = [s.shape[1] for p, s in _tree.flatten(self.hf_specs(cfg)).items() if p.endswith(".moe.shared.w_down")]
        return read_widths(cfg, self.width_fields)._replace(Is=Is[0] if Is else 0)

    def widen_kv_heads(self, cfg: Any, tp: int) -> Any:
        """``cfg`` with ``tp`` KV heads when ``tp`` divides the query heads but not the KV heads
        (each KV head replicated, as the reference does), else ``cfg``; the one home of this rule.

        Example:
            >>> from fmoe.models import qwen3_moe
            >>> qwen3_moe.MODEL.widen_kv_heads(qwen3_moe.Config.tiny(), 8).num_key_value_heads
            8
        """
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"widen_kv_heads: tp must be an int >= 1, got {tp!r}")
        kv, heads = self._field("G"), self._field("H")
        if kv is None or getattr(cfg, kv) % tp == 0 or getattr(cfg, heads) % tp:
            return cfg
        return replace(cfg, **{kv: tp})

    def preset(self, name: str, tp: int = 1) -> Any:
        """The config ``Config.<name>()`` widened for a job on ``tp`` ranks: at least 256
        vocabulary entries (byte tokens), KV heads by :meth:`widen_kv_heads`.

        Example:
            >>> from fmoe.models import llama
            >>> llama.MODEL.preset("tiny").vocab_size >= 256
            True
        """
        if name not in PRESETS:
            raise ValueError(f"preset: name must be one of {PRESETS} (the Config's PRESETS), got {name!r}")
        cfg = self.Config.preset(name)
        vocab = self._field("V")
        if getattr(cfg, vocab) < 256:
            cfg = replace(cfg, **{vocab: 256})
        return self.widen_kv_heads(cfg, tp)

    # ---------------------------------------------------------------- plans, in one place
    def build_plan(self, cfg: Any, rules: Rules = None, mesh: Optional[Mesh] = None, params: Any = None, *,
                   tp: Optional[int] = None, data_parallel: bool = False) -> Plan:
        """The plan to shard this model with (see the module docstring for the steps).

        Args:
            cfg: the config.
            rules: a Plan (replaces the default), user rules merged over the default by key, or None.
            mesh: the mesh (its ``tp`` for the checks; required with ``data_parallel``).
            params: the parameter tree (or anything with shapes) for ``data_parallel``;
                default: the shapes of :attr:`hf_specs`.
            tp: tensor-parallel size to check against when there is no mesh (default 1).
            data_parallel: add the ``fsdp`` / ``efsdp`` splits (training).
        Returns:
            the checked :class:`fmoe.Plan`.
        """
        tp = mesh.tp if mesh is not None else 1 if tp is None else tp
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"check_plan: tp must be an int >= 1, got {tp!r}")
        default = self.plan(cfg)
        plan = rules if isinstance(rules, Plan) else default if rules is None else default.override(rules)
        shapes = self._shapes(cfg)
        check_tp_splits(plan, shapes, tp, cfg, self.tp_fields, self.fused_gate_up)
        if mesh is not None and mesh.sp and tp > 1 and plan is not default:
            check_sequence_parallel(plan, default, shapes)
        if not data_parallel:
            return plan
        if mesh is None:
            raise ValueError("build_plan: data_parallel=True needs the mesh")
        return data_parallel_plan(plan, shapes if params is None else params, mesh)

    def check_plan(self, cfg: Any, rules: Rules = None, tp: int = 1) -> Plan:
        """The plan (``rules``: a Plan, user rules merged over the default plan by key, or None)
        after checking that it splits whole heads and a dense fused gate/up per half over
        ``tp`` ranks; ``ValueError`` naming the config field otherwise."""
        return self.build_plan(cfg, rules, tp=tp)

    def _shapes(self, cfg: Any) -> Any:
        """Every parameter as a meta tensor of its shape (from the checkpoint name map)."""
        flat = _tree.flatten(self.hf_specs(cfg))
        return _tree.unflatten({k: torch.empty(tuple(s.shape), device="meta") for k, s in flat.items()})

    # ---------------------------------------------------------------- the wrappers every model shares
    def shard(self, params: dict, cfg: Any, mesh: Mesh, plan: Rules = None) -> dict:
        """:func:`fmoe.shard` the full ``params`` by ``plan`` (as in :meth:`check_plan`), checked first."""
        return _shard(params, self.build_plan(cfg, plan, mesh), mesh)

    def load_hf(self, path: Union[str, os.PathLike], mesh: Optional[Mesh] = None, plan: Rules = None, *,
                dtype: Optional[torch.dtype] = None) -> tuple[dict, Any]:
        """Load a Hugging Face checkpoint directory (``config.json`` + safetensors, one file or an
        indexed set); with a mesh each rank reads only its own slices, after the plan has been
        checked against the config (:meth:`build_plan`, before any tensor is read).

        Args:
            path: the checkpoint directory.
            mesh: None for full tensors, else the :class:`fmoe.Mesh` to shard on.
            plan: a Plan, user rules merged over the default plan by key, or None (default plan).
            dtype: cast every parameter to this dtype (default: the checkpoint's, which must be one
                floating-point dtype).
        Returns:
            ``(params, cfg)``; with a mesh the params equal ``shard(full_params, cfg, mesh, plan)``.
        """
        built = None if mesh is None else (lambda cfg: self.build_plan(cfg, plan, mesh))
        return _hf.load_hf(self, path, mesh=mesh, plan=built, dtype=dtype)

    def save_hf(self, params: dict, cfg: Any, path: Union[str, os.PathLike], *, overwrite: bool = False) -> None:
        """Write ``params`` (or a gradient tree) with the keys ``save_pretrained`` writes,
        atomically; transformers' ``from_pretrained`` loads the result. Call on every rank.
        ``overwrite``: ``path`` may hold other files (see :func:`fmoe.checkpoint.save_hf`)."""
        _hf.save_hf(self, params, cfg, path, overwrite=overwrite)


def model_of(model: Union[Model, types.ModuleType]) -> Model:
    """The declared :class:`Model` of ``model``: itself, or a model module's ``MODEL``.

    Example:
        >>> from fmoe.models import llama
        >>> model_of(llama).routed
        False
    """
    if isinstance(model, Model):
        return model
    declared = vars(model).get("MODEL") if isinstance(model, types.ModuleType) else None
    if not isinstance(declared, Model):
        raise TypeError(f"expected an fmoe.model.Model or a model module that declares MODEL = Model(...), "
                        f"got {model!r}")
    return declared
