"""Load balancing as flags of the main job, on every MoE model: what each method needs and when
a flag does not apply.

``--balance M[,M...]`` picks the methods (default: the model's own: the Switch load-balance
loss for qwen3_moe / mixtral / gpt_oss, expert-bias updates for deepseek_v3; ``none`` for a
``--router`` a balance loss does not fit, one with ``router.no_balance_loss``: expert choice is
balanced by construction, hash / round-robin / random routing ignore the scores):

============  ==========================================================  ==================
method        what                                                        weight flag
============  ==========================================================  ==================
``none``      no balancing (alone)
``aux``       Switch ``E * sum_e f_e P_e`` per (micro-)batch, global       ``--aux-weight``
              over the data-parallel batches
``seq_aux``   DeepSeek-V3's sequence-wise version                         ``--aux-weight``
``global_aux`` the same loss with ``f`` summed over the data-parallel      ``--aux-weight``
              batches *and* the step's ``--grad-accum`` micro-batches
              (Qiu et al. 2025)
``z``         router z-loss (ST-MoE)                                      ``--z-weight``
``bias``      aux-loss-free expert-bias updates (Wang et al. 2024)        ``--bias-rate U``
              after each step; ``--bias-update sign|proportional``         (0: frozen)
============  ==========================================================  ==================

The losses use the router's own score function (:data:`fmoe.routing.balance.SCORES`: softmax,
or the normalised sigmoid for ``sigmoid_topk``; a user router may say ``router.scores =
"sigmoid"``). The bias method needs a router that reads ``expert_bias``: the model's default
router is replaced by its biased twin (:func:`fmoe.routing.balance.biased_topk` ...), and an
``expert_bias [E]`` leaf (zeros) is added to every MoE layer that lacks one. Only a bias the
router reads is ever updated: without the bias method it stays frozen (deepseek_v3's
``e_score_correction_bias`` is exported as loaded).

Usage errors (exit 2, before anything starts): a balancing flag on a dense model, a weight flag
without its method, ``--balance bias`` with a router that ignores ``expert_bias``, a balance
loss with a router it does not fit (the router's ``no_balance_loss`` says why), and
``--export-hf`` of a bias-balanced model whose Hugging Face format has no expert bias (the
export would route differently). The resolved settings are recorded in ``meta.json`` and kept
on ``--resume``.

Example:
    >>> parse_methods("bias,z")
    ('bias', 'z')
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

from ..model import Model

__all__ = ["METHODS", "parse_methods", "resolve", "record", "router_for", "run_router", "with_expert_bias",
           "model_router", "score_name", "step_options", "with_recording", "RECORDED"]

METHODS = ("none", "aux", "seq_aux", "global_aux", "z", "bias")
LOSS_METHODS = ("aux", "seq_aux", "global_aux")
DEFAULT_Z, DEFAULT_RATE = 1e-3, 1e-3
#: meta.json keys (= flag dests) this module records; ``--resume`` keeps them.
RECORDED = ("balance", "aux_weight", "z_weight", "bias_rate", "bias_update")


def model_router(model: Model, cfg: Any, biased: bool = False) -> Callable:
    """The router a model uses by default (``biased``: its twin that reads ``expert_bias``), as the
    model declares it (:attr:`fmoe.model.Model.router`).

    Args:
        model: a routed model's declared :class:`fmoe.model.Model`.
        cfg: its config.
        biased: the selection-biased twin (deepseek_v3's router reads the bias already).
    Returns:
        a router equal to the one the model's forward builds (with a zero bias for ``biased``).

    Example:
        >>> from fmoe.models import qwen3_moe
        >>> r = model_router(qwen3_moe.MODEL, qwen3_moe.Config.tiny())
        >>> r(torch.zeros(1, 8)).expert_ids.shape
        torch.Size([1, 2])
    """
    if model.router is None:
        raise ValueError(f"balancing: model {model.name!r} has no router")
    return model.router(cfg, biased=biased)


def routed(registry: Mapping[str, Model]) -> tuple:
    """The names of the models of ``registry`` that route (their :attr:`fmoe.model.Model.routed`)."""
    return tuple(n for n, m in registry.items() if m.routed)


def score_name(model: Model, router_spec: Optional[str], router: Optional[Callable]) -> str:
    """``"softmax"`` or ``"sigmoid"``: the score function of the router the run uses."""
    if router is None:
        return model.router_scores
    from ..routing.spec import parse_spec

    module, name, _ = parse_spec(router_spec) if router_spec else ("", "", {})
    if module == "fmoe.routing":
        return "sigmoid" if name == "sigmoid_topk" else "softmax"
    declared = getattr(router, "scores", "softmax")
    if declared not in ("softmax", "sigmoid"):
        raise ValueError(f"--router {router_spec!r}: its scores attribute must be 'softmax' or 'sigmoid', "
                         f"got {declared!r}")
    return declared


def parse_methods(text: str) -> tuple:
    """The methods of a ``--balance`` value (``ValueError`` naming the bad one).

    Example:
        >>> parse_methods("none")
        ()
    """
    items = tuple(m.strip() for m in str(text).split(",") if m.strip())
    bad = [m for m in items if m not in METHODS]
    if bad or not items:
        raise ValueError(f"--balance {text!r}: {bad[0] if bad else 'empty'} is not a method; choose from "
                         f"{', '.join(METHODS)} (comma-separated)")
    if "none" in items and len(items) > 1:
        raise ValueError(f"--balance {text!r}: 'none' cannot be combined with other methods")
    if len(set(items)) != len(items):
        raise ValueError(f"--balance {text!r} names a method twice")
    if "aux" in items and "global_aux" in items:
        raise ValueError(f"--balance {text!r}: aux and global_aux are two versions of one loss; pick one")
    return () if items == ("none",) else items


def _reads_bias(args: Any) -> bool:
    from ..routing.balance import reads_bias
    from ..routing.spec import from_spec

    return args.router is None or reads_bias(from_spec(args.router, "--router"))


def _no_loss(args: Any) -> Optional[str]:
    """Why a balance loss does not fit the ``--router`` (its ``no_balance_loss``), or None."""
    from ..routing.spec import from_spec

    return None if args.router is None else getattr(from_spec(args.router, "--router"), "no_balance_loss", None)


def resolve(args: Any, error: Callable[[str], Any], registry: Mapping[str, Model]) -> None:
    """Check the balancing flags against the model and router; fill in the resolved values
    (``args.balance`` canonical, unused weights None).

    Args:
        args: the parsed flags (``model``, ``router``, the balancing flags, ``explicit``).
        error: ``ArgumentParser.error`` (called with the message; must not return).
        registry: model name -> declared :class:`fmoe.model.Model` (``fmoe.models``).
    """
    explicit = getattr(args, "explicit", set())
    given = [d for d in ("balance", "aux_weight", "z_weight", "bias_rate", "bias_update")
             if d in explicit and getattr(args, d) is not None]
    flag = lambda d: "--" + d.replace("_", "-")  # noqa: E731
    if args.model not in routed(registry):
        given += ["record_routing"] if vars(args).get("record_routing") else []
        if given:
            error(f"{flag(given[0])}: model {args.model} is dense (no router); balancing flags apply to the MoE "
                  f"models {', '.join(routed(registry))}")
        args.balance, args.aux_weight, args.z_weight, args.bias_rate, args.bias_update = "none", None, None, None, None
        return
    try:
        if args.balance is not None:
            methods = parse_methods(args.balance)
        elif _no_loss(args):                       # expert choice, hash, ...: nothing to balance
            methods = ()
        elif registry[args.model].balance == "bias":
            methods = ("bias",) if _reads_bias(args) else ("aux",)
        else:
            methods = ("aux",)
    except ValueError as e:
        error(str(e))
    if set(LOSS_METHODS) & set(methods) and _no_loss(args):
        error(f"--balance {','.join(methods)} with --router {args.router!r}: {_no_loss(args)}; the loss would "
              "train the router's probabilities without moving the load. Use --balance none (this router's "
              "default) or z")
    for dest, needs in (("aux_weight", LOSS_METHODS), ("z_weight", ("z",)), ("bias_rate", ("bias",)),
                        ("bias_update", ("bias",))):
        value = getattr(args, dest)
        if dest in explicit and value is not None and not set(needs) & set(methods):
            error(f"{flag(dest)} {value}: applies to --balance {' / '.join(needs)}, and this run balances with "
                  f"--balance {','.join(methods) or 'none'}")
        if isinstance(value, float) and (not math.isfinite(value) or value < 0):
            error(f"{flag(dest)} must be a finite number >= 0, got {value}")
    if "bias" in methods and not _reads_bias(args):
        error(f"--balance bias: --router {args.router!r} does not read expert_bias, so the bias would move without "
              "changing the routing; use a router that takes expert_bias (e.g. sigmoid_topk) or another method")
    replaying = bool(args.router) and args.router.split(":")[0] == "replay"
    if (vars(args).get("record_routing") or replaying) and vars(args).get("remat", "none") != "none":
        what = "--record-routing" if vars(args).get("record_routing") else "--router replay"
        error(f"{what} with --remat {args.remat}: "
              "recomputation calls the router again in backward, out of the recorded order; use --remat none")
    if "bias" in methods and args.export_hf and not registry[args.model].hf_expert_bias:
        error(f"--export-hf with --balance bias: the Hugging Face format of {args.model} has no expert bias, so the "
              f"exported model would route differently than it trained; export {', '.join(n for n, m in registry.items() if m.hf_expert_bias)} "
              "models, or balance with a loss")
    args.balance = ",".join(methods) or "none"
    args.aux_weight = (0.01 if args.aux_weight is None else args.aux_weight) if set(LOSS_METHODS) & set(methods) else None
    args.z_weight = (DEFAULT_Z if args.z_weight is None else args.z_weight) if "z" in methods else None
    args.bias_rate = (DEFAULT_RATE if args.bias_rate is None else args.bias_rate) if "bias" in methods else None
    args.bias_update = (args.bias_update or "sign") if "bias" in methods else None


def record(args: Any) -> dict:
    """The ``meta.json`` entries of the resolved balancing settings."""
    return {k: getattr(args, k) for k in RECORDED}


def router_for(args: Any, cfg: Any, router: Optional[Callable], model: Model) -> Optional[Callable]:
    """The router the run's steps use: ``router`` (``--router``) or the model's, wrapped with the
    chosen losses (in the router's score function) and the global-batch sums.

    Args:
        args: the resolved flags (:func:`resolve`).
        cfg: the model's config.
        router: the ``--router`` router, or None (the model's own).
        model: the declared :class:`fmoe.model.Model` of ``args.model``.

    Returns:
        None for a dense model; else a router (the model config's own loss switch must be off).
    """
    from ..routing import with_losses
    from ..routing.balance import SCORES, with_balance_sums

    if not model.routed:
        return router
    methods = parse_methods(args.balance)
    probs = SCORES[score_name(model, args.router, router)]
    base = router if router is not None else model_router(model, cfg, biased="bias" in methods)
    w = args.aux_weight
    wrapped = with_losses(base, load_balance=w if "aux" in methods else None,
                          seq_balance=w if "seq_aux" in methods else None,
                          z=args.z_weight if "z" in methods else None, seq_len=args.seq, probs=probs)
    return with_balance_sums(wrapped, probs) if "global_aux" in methods else wrapped


def step_options(args: Any, cfg: Any, options: dict, model: Model) -> dict:
    """:class:`fmoe.training.step.StepConfig` keywords: ``options`` (the job's other step
    keywords) with the balancing router, bias rate and rule and the global-batch loss weight
    (``model``: the declared :class:`fmoe.model.Model` of ``args.model``)."""
    methods = parse_methods(args.balance) if model.routed else ()
    return {**options, "router": router_for(args, cfg, options.get("router"), model),
            "bias_rate": float(args.bias_rate or 0.0), "bias_update": args.bias_update or "sign",
            "global_balance": float(args.aux_weight) if "global_aux" in methods else 0.0}


def with_recording(args: Any, step_cfg: Any, rank: int) -> tuple[Any, Optional[Callable]]:
    """``(step_cfg, write)``: with ``--record-routing DIR`` the step's router records its ids and
    ``write()`` saves this rank's file (:mod:`fmoe.routing.record`); else ``(step_cfg, None)``."""
    import dataclasses

    from ..routing.record import record_writer, recording

    if not vars(args).get("record_routing"):
        return step_cfg, None
    calls: list = []
    return (dataclasses.replace(step_cfg, router=recording(step_cfg.router, calls)),
            record_writer(calls, args.record_routing, rank, args.router))


def run_router(job: Any) -> Optional[Callable]:
    """The router a job's steps start from (before the balancing wrappers): its step config's, its
    ``--router``, or None (the model's own)."""
    from ..routing.spec import from_spec

    given = getattr(job, "step_config", None)
    if given is not None and given.router is not None:
        return given.router
    return from_spec(job.router, "--router") if job.router else None


def with_expert_bias(full: Any, args: Any) -> Any:
    """``full`` with a zero fp32 ``expert_bias [E]`` in every MoE layer lacking one (``--balance bias``).

    Example:
        >>> import types
        >>> ns = types.SimpleNamespace(model="qwen3_moe", balance="bias")
        >>> p = with_expert_bias({"layers": [{"moe": {"router": torch.zeros(4, 2)}}]}, ns)
        >>> p["layers"][0]["moe"]["expert_bias"].tolist()
        [0.0, 0.0, 0.0, 0.0]
    """
    from ..routing.state import bias_state, init_layer

    if "bias" not in parse_methods(args.balance):      # a dense model resolves to "none"
        return full
    state = bias_state(0.0)                            # the bias as router state: its init, one path
    return {**full, "layers": [{**layer, "moe": init_layer(layer["moe"], state)} if "moe" in layer else layer
                               for layer in full["layers"]]}
