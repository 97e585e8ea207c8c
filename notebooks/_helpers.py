"""A tiny functional MoE language model and its training loop, shared by the routing notebooks.

The notebooks study *routers*, so the model takes the router as an argument. (The models in
``fmoe.models`` build their router from their config inside the MoE layer, so they cannot take a
hand-written one.) Everything is a pure function of a parameter tree, built from ``fmoe.nn`` and
``fmoe.moe``::

    tokens [B, S] -> embed + learned positions
      -> L x [ x + attention(rms_norm(x)) ; x + moe(rms_norm(x), router) ]
      -> rms_norm -> lm_head -> logits [B, S, V]

with ``aux`` of each MoE layer returned beside the logits (load, imbalance, aux losses, drop
rates: see :mod:`fmoe.routing.global_stats`). :func:`train_lm` trains it in one process on the standard
library's source (:class:`fmoe.data.TokenStream`, byte tokens) with fmoe's functional AdamW,
adds every ``fmoe.routing.Loss`` aux term to the loss, and, for a router with an expert bias,
moves the bias with :func:`fmoe.routing.update_bias` after each optimizer step (the bias is
state, not a trained weight, so it stays out of the optimizer).

Example:
    >>> import fmoe
    >>> params = init_lm(dim=16, layers=1, experts=4, hidden=8)
    >>> logits, auxes = lm_forward(params, torch.zeros(2, 5, dtype=torch.long), fmoe.routing.topk(2))
    >>> logits.shape, auxes[0]["load"].sum().item()          # 10 tokens x 2 experts
    (torch.Size([2, 5, 256]), 20)
"""

from __future__ import annotations

import io
import time
from typing import Any, Callable, Optional

import torch
from einops import rearrange

import fmoe
from fmoe import nn
from fmoe.data import TokenStream
from fmoe.routing.aux_losses import total as aux_total
from fmoe.routing.global_stats import stack_layers
from fmoe.routing import update_bias
from fmoe.optim import AdamWConfig, lr_at
from fmoe.optim.adamw import init as adamw_init
from fmoe.optim.adamw import step as adamw_step

__all__ = ["init_lm", "lm_forward", "train_lm", "show", "smooth"]

_CORPUS: dict[int, TokenStream] = {}


def init_lm(vocab: int = 256, dim: int = 32, layers: int = 2, experts: int = 8, hidden: int = 32,
            heads: int = 2, max_seq: int = 64, seed: int = 0, expert_bias: bool = False) -> dict:
    """Random parameters of the tiny MoE LM (the same seed gives the same tree).

    Args:
        vocab: V (256 for byte tokens); dim: D; layers: L; experts: E; hidden: I per expert;
        heads: H attention heads (divides D); max_seq: longest sequence (learned positions).
        seed: random seed.
        expert_bias: add a zero ``moe.expert_bias [E]`` per layer (for ``fmoe.routing.sigmoid_topk``).
    Returns:
        ``{"embed", "pos", "layers": [{"attn_norm", "wqkv", "wo", "moe_norm", "moe": {...}}], "norm", "head"}``.

    Example:
        >>> init_lm(layers=1)["layers"][0]["moe"]["w_gate_up"].shape      # [E, 2I, D]
        torch.Size([8, 64, 32])
    """
    if dim % heads:
        raise ValueError(f"init_lm: heads={heads} must divide dim={dim}")
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, fan_in: torch.randn(*shape, generator=g) / fan_in ** 0.5  # noqa: E731

    def layer() -> dict:
        moe = {"router": rnd(experts, dim, fan_in=dim),                            # [E, D]
               "w_gate_up": rnd(experts, 2 * hidden, dim, fan_in=dim),             # [E, 2I, D]
               "w_down": rnd(experts, dim, hidden, fan_in=hidden * 2)}             # [E, D, I]
        if expert_bias:
            moe["expert_bias"] = torch.zeros(experts)                               # [E] state
        return {"attn_norm": torch.ones(dim), "wqkv": rnd(3 * dim, dim, fan_in=dim),
                "wo": rnd(dim, dim, fan_in=dim * 2), "moe_norm": torch.ones(dim), "moe": moe}

    return {"embed": rnd(vocab, dim, fan_in=dim), "pos": rnd(max_seq, dim, fan_in=dim * 4),
            "layers": [layer() for _ in range(layers)], "norm": torch.ones(dim),
            "head": rnd(vocab, dim, fan_in=dim)}


def lm_forward(params: dict, tokens: torch.Tensor, router: Callable, *, mesh: Optional[fmoe.Mesh] = None,
               heads: int = 2, impl: str = "auto", token_ids: bool = False) -> tuple[torch.Tensor, list[dict]]:
    """Logits of the tiny LM and the aux dict of every MoE layer.

    Args:
        params: tree from :func:`init_lm` (plain, or placed by ``fmoe.shard``).
        tokens: ``[B, S]`` int64 ids.
        router: any ``router(logits[T, E]) -> fmoe.routing.Routing``, used by every layer.
        mesh: ``fmoe.Mesh`` when the experts are sharded, else None.
        heads: H, as given to :func:`init_lm`.
        impl: MoE dispatch implementation (``"auto"``, ``"all_to_all"``, ``"all_reduce"``).
        token_ids: pass ``router_inputs={"token_ids": tokens}`` (hash routing needs it).
    Returns:
        ``(logits [B, S, V], [aux of layer 0, aux of layer 1, ...])``.

    Example:
        >>> import fmoe
        >>> p = init_lm(dim=8, layers=1, experts=4, hidden=4)        # heads=2
        >>> lm_forward(p, torch.ones(1, 3, dtype=torch.long), fmoe.routing.topk(1))[0].shape
        torch.Size([1, 3, 256])
    """
    B, S = tokens.shape
    inputs = {"token_ids": rearrange(tokens, "b s -> (b s)")} if token_ids else None
    x = nn.embedding(tokens, params["embed"]) + params["pos"][:S]                  # [B, S, D]
    auxes = []
    for layer in params["layers"]:
        qkv = nn.linear(nn.rms_norm(x, layer["attn_norm"]), layer["wqkv"])           # [B, S, 3D]
        q, k, v = rearrange(qkv, "b s (three h d) -> three b s h d", three=3, h=heads)
        o = nn.attention(q, k, v, causal=True)                                      # [B, S, H, D/H]
        x = x + nn.linear(rearrange(o, "b s h d -> b s (h d)"), layer["wo"])
        h = rearrange(nn.rms_norm(x, layer["moe_norm"]), "b s d -> (b s) d")         # [T, D]
        y, aux = fmoe.moe(layer["moe"], h, router=router, mesh=mesh, impl=impl, router_inputs=inputs)
        x = x + rearrange(y, "(b s) d -> b s d", b=B)
        auxes.append(aux)
    return nn.linear(nn.rms_norm(x, params["norm"]), params["head"]), auxes        # [B, S, V]


def _corpus(max_bytes: int) -> TokenStream:
    if max_bytes not in _CORPUS:
        _CORPUS[max_bytes] = TokenStream.stdlib(max_bytes=max_bytes)
    return _CORPUS[max_bytes]


def train_lm(router: Callable, *, steps: int = 100, batch: int = 8, seq: int = 32, lr: float = 3e-3,
             warmup: int = 10, aux_weight: float = 1.0, bias_rate: Optional[float] = None,
             token_ids: bool = False, seed: int = 0, corpus_bytes: int = 2_000_000,
             **model: Any) -> dict:
    """Train the tiny LM with ``router`` in one process; return its per-step history.

    Args:
        router: the router of every MoE layer.
        steps: optimizer steps; batch, seq: B sequences of S byte tokens per step.
        lr: peak learning rate (linear warmup for ``warmup`` steps, cosine decay to 10%).
        aux_weight: weight of the router's ``Loss`` aux terms (already weighted by the router).
        bias_rate: if set, the model gets ``moe.expert_bias`` and after each optimizer step
            ``update_bias(params, {layer: aux["load"]}, bias_rate)`` moves it.
        token_ids: give the router the token ids (hash routing).
        seed: model and data seed.
        corpus_bytes: bytes of the standard library read as the corpus.
        **model: passed to :func:`init_lm` (dim, layers, experts, hidden, heads).
    Returns:
        ``{"loss": [steps], "aux_loss": [steps], "params", "seconds"}`` plus every tensor entry
        of the layers' aux stacked as ``[steps, L, ...]``: ``load [steps, L, E]``,
        ``imbalance [steps, L]``, the router's own entries (``drop_rate``, ``*_loss``, ...).

    Example:
        >>> import fmoe
        >>> h = train_lm(fmoe.routing.topk(2), steps=2, dim=16, layers=1, hidden=8, corpus_bytes=20_000)
        >>> h["load"].shape
        torch.Size([2, 1, 8])
    """
    params = init_lm(seed=seed, max_seq=max(seq, 64), expert_bias=bias_rate is not None, **model)
    flat = fmoe.tree.flatten(params)
    state = {p: t for p, t in flat.items() if p.endswith("expert_bias")}          # not trained
    trainable = {p: t.requires_grad_(True) for p, t in flat.items() if p not in state}
    opt = adamw_init(trainable)
    cfg = AdamWConfig(weight_decay=0.0)
    data = _corpus(corpus_bytes)
    hist: dict[str, list] = {"loss": [], "aux_loss": []}
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        tokens, targets = data.batch(step, 0, batch, seq, seed)                    # [B, S] each
        tree = fmoe.tree.unflatten({**trainable, **state}, like=params)
        logits, auxes = lm_forward(tree, tokens, router, heads=model.get("heads", 2), token_ids=token_ids)
        lm_loss = nn.cross_entropy(logits, targets)
        extra = aux_total(auxes)
        grads = torch.autograd.grad(lm_loss + aux_weight * extra, list(trainable.values()))
        trainable, opt, _ = adamw_step(dict(zip(trainable, grads)), opt, trainable,
                                       lr_at(step, lr, warmup, steps), cfg)
        if bias_rate is not None:
            loads = {f"layers.{i}.moe": a["load"] for i, a in enumerate(auxes)}
            moved = fmoe.tree.flatten(update_bias(tree, loads, bias_rate))
            state = {p: moved[p] for p in state}
        hist["loss"].append(lm_loss.detach())
        hist["aux_loss"].append(extra.detach())
        for key, value in stack_layers(auxes).items():                             # [L, ...] each
            hist.setdefault(key, []).append(value)
    out = {k: torch.stack(v) for k, v in hist.items()}
    out["params"] = fmoe.tree.unflatten({**trainable, **state}, like=params)
    out["seconds"] = time.perf_counter() - t0
    return out


def smooth(values: torch.Tensor, window: int = 10) -> torch.Tensor:
    """Trailing moving average (the first points average what exists so far).

    Example:
        >>> smooth(torch.tensor([0.0, 2.0, 4.0]), 2).tolist()
        [0.0, 1.0, 3.0]
    """
    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    c = torch.cat([torch.zeros(1, dtype=v.dtype), v.cumsum(0)])
    idx = torch.arange(1, v.numel() + 1)
    lo = (idx - window).clamp(min=0)
    return ((c[idx] - c[lo]) / (idx - lo)).float()


def show(fig: Any) -> None:
    """Display a matplotlib figure as a PNG in the notebook (works with the Agg backend), then
    close it. Outside IPython it does nothing but close the figure.

    Example:
        >>> import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
        >>> show(plt.figure())
    """
    import matplotlib.pyplot as plt

    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:                                   # plain Python: nothing to show on
        plt.close(fig)
        return
    if get_ipython() is not None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        display(Image(buf.getvalue()))
    plt.close(fig)
