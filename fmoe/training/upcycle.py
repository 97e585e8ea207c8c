"""Sparse upcycling (Komatsuzaki et al. 2022): a mixture-of-experts model initialised from a
dense checkpoint, ``--model mixtral --init-hf LLAMA_DIR --upcycle E,K``.

Every weight of the dense model is kept; each dense MLP becomes ``E`` identical experts::

    layers.N.mlp.w_gate_up [2I, D]  ->  layers.N.moe.w_gate_up [E, 2I, D]   (E copies)
    layers.N.mlp.w_down    [D, I]   ->  layers.N.moe.w_down    [E, D, I]
    layers.N.moe.router    [E, D]       new: normal(0, initializer_range), as the paper (a router
                                        trained from scratch; seeded by ``--seed``)

and the config takes the dense one's fields plus ``E`` experts, top-``K``. Because the experts
are identical and the target's router renormalises its top-k weights (Mixtral), the upcycled
model computes the dense model's function at initialisation (``sum_k w_k MLP(x) = MLP(x)``, up
to rounding): training starts from the dense model's loss, and the experts diverge as the
router learns. The dense model must have no attention or MLP biases (the target has none).

Example:
    >>> from fmoe.models import llama, mixtral
    >>> p, cfg = upcycle(llama.init(llama.Config.tiny()), llama.Config.tiny(), mixtral.Config, 4, 2)
    >>> p["layers"][0]["moe"]["w_gate_up"].shape, cfg.num_local_experts
    (torch.Size([4, 256, 64]), 4)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from einops import repeat

__all__ = ["upcycle", "parse_upcycle"]


def parse_upcycle(text: str) -> tuple[int, int]:
    """``(E, K)`` of an ``--upcycle E,K`` value (``ValueError`` naming what is wrong).

    Example:
        >>> parse_upcycle("8,2")
        (8, 2)
    """
    parts = str(text).split(",")
    try:
        E, K = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--upcycle {text!r}: expected E,K (experts, experts per token), e.g. 8,2") from None
    if E < 1 or not 1 <= K <= E:
        raise ValueError(f"--upcycle {text!r}: need E >= 1 and 1 <= K <= E")
    return E, K


def upcycle(dense: dict, dense_cfg: Any, Config: type, num_experts: int, top_k: int, seed: int = 0) -> tuple[dict, Any]:
    """The MoE parameters and config upcycled from a dense (llama) model.

    Args:
        dense: the dense parameter tree (``layers.N.mlp.w_gate_up [2I, D]``, ``w_down [D, I]``).
        dense_cfg: its config (a dataclass; fields shared with ``Config`` are copied).
        Config: the MoE model's config class (Mixtral's: ``num_local_experts``, ``num_experts_per_tok``).
        num_experts: E.
        top_k: K.
        seed: seed of the new routers.
    Returns:
        ``(params, cfg)`` of the MoE model.
    """
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(dense_cfg, flag, False):
            raise ValueError(f"upcycle: the dense model has {flag}=True; the MoE model has no biases")
    fields = {f.name for f in dataclasses.fields(Config)}
    shared = {k: v for k, v in dataclasses.asdict(dense_cfg).items() if k in fields}
    cfg = Config(**shared, num_local_experts=num_experts, num_experts_per_tok=top_k)
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i, layer in enumerate(dense["layers"]):
        mlp = layer["mlp"]
        D = mlp["w_gate_up"].shape[1]
        router = (torch.randn(num_experts, D, generator=g) * cfg.initializer_range).to(mlp["w_gate_up"])  # [E, D]
        moe = {"router": router,
               "w_gate_up": repeat(mlp["w_gate_up"], "i d -> e i d", e=num_experts).clone(),  # [E, 2I, D]
               "w_down": repeat(mlp["w_down"], "d i -> e d i", e=num_experts).clone()}       # [E, D, I]
        layers.append({k: v for k, v in layer.items() if k != "mlp"} | {"moe": moe})
    return {k: v for k, v in dense.items() if k != "layers"} | {"layers": layers}, cfg
