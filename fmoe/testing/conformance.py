"""``check_model``: the conformance suite of a model, one call (transformers' ``ModelTesterMixin``,
run on meshes).

A model author (and fmoe, on every shipped family: ``tests/distributed/test_conformance.py``)
checks a :class:`fmoe.model.Model` with the same code path. In this order, each a named check of
:data:`CHECKS`:

- ``"plan"``: the default plan splits whole heads (and fused gate/up halves) for every mesh's
  tp (:meth:`~fmoe.model.Model.check_plan`), and each of its rules matches a parameter;
- ``"hf"`` (with ``hf_class``): a transformers model built from ``cfg.to_hf()`` (weights redrawn
  larger than the init, norms near one: routing far from uniform) is saved with
  ``save_pretrained``; ``load_hf`` reads the same config (and the redrawn buffers into the state
  leaves) and ``forward`` gives its logits (an MoE model: one aux per MoE layer, each token routed
  ``K`` times); the
  gradient of one cross-entropy loss equals transformers' for every parameter, compared in the
  checkpoint layout (``save_hf`` of the gradient tree vs ``save_pretrained`` of ``.grad``, key for
  key); ``save_hf`` writes transformers' keys and ``from_pretrained`` of it gives transformers'
  logits again, bit for bit. With the config's ``pad_token_id``, the pad token is in the batch (its embedding row
  gets no gradient on either side);
- ``"generate"`` (with ``hf_class`` and the model's ``init_cache``): greedy
  :func:`fmoe.generate` of two prompts of different lengths equals transformers' ``generate``
  token for token;
- ``"meshes"``: :func:`fmoe.testing.assert_parity` of the logits over ``meshes`` (the model's
  default plan with the training's data-parallel splits, so ``"tp2/ep2"`` on 4 ranks is FSDP
  too; ``"tp2/sp"`` is sequence parallelism): every rank's output and every gathered gradient
  equal one process;
- ``"grad"``: ``torch.func.grad`` of the loss equals ``.backward()``;
- ``"compile"``: ``torch.compile(forward, backend=compile_backend)`` gives eager's logits
  (``torch.compiler.reset()`` first, so many models compile in one process);
- ``"remat"``: under each of the model's ``remat_blocks`` policies (:func:`fmoe.nn.remat.policy`)
  logits and gradients equal the plain run.

A router-state leaf (:func:`fmoe.routing.state.is_state`, e.g. ``expert_bias``) is state, not a parameter (as the trainer has it): it gets no
gradient, and the checkpoint comparison writes its value on both sides.

Tolerance: fp32 throughout; a tensor passes when ``max |got - want| <= rtol * max |want|``
(``rtol`` 1e-5, about 84 fp32 eps: sums taken in another order through a few layers of width 64
differ by ~3e-6 of the scale; a wrong scale or a missing term is off by O(1)). The result maps
each check to its worst ``max |got - want| / max |want|``, the numbers to report.

Example:
    >>> from fmoe.models import llama
    >>> worst = check_model(llama, meshes=(), checks=("plan", "grad"))
    >>> sorted(worst), worst["grad"] < 1e-5
    (['grad', 'plan'], True)
"""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any, Callable, Optional, Sequence

import torch

from fmoe import tree as _tree
from fmoe.model import Model, model_of
from fmoe.model.generate import generate, left_pad
from fmoe.nn import cross_entropy, remat
from fmoe.routing.state import is_state
from fmoe.testing.parity import assert_parity, parse_mesh
from fmoe.testing.pool import Pool

__all__ = ["check_model", "CHECKS"]

#: every check, in the order they run.
CHECKS = ("plan", "hf", "generate", "meshes", "grad", "compile", "remat")
PROMPTS = ([5, 9, 13, 2, 7, 1, 3], [4, 8, 15])     # two lengths: left padding, masked keys


def check_model(model: Any, cfg: Any = None, hf_class: Any = None,
                meshes: Sequence[str] = ("tp1/ep4", "tp2/ep2", "tp2/sp"), *, params: Optional[dict] = None,
                checks: Sequence[str] = CHECKS, batch: int = 4, seq: int = 12, new_tokens: int = 20,
                compile_backend: str = "aot_eager", rtol: float = 1e-5, seed: int = 0,
                pool: Optional[Pool] = None) -> dict[str, float]:
    """Run the conformance checks (module docstring) on ``model``; ``AssertionError`` naming the
    check and the tensor at the first failure.

    Args:
        model: a :class:`fmoe.model.Model` or a model module declaring ``MODEL``.
        cfg: its config (default ``Config.tiny()``).
        hf_class: transformers' ``...ForCausalLM`` class (or its name) for ``"hf"`` and
            ``"generate"`` (None: those checks are skipped).
        meshes: :func:`fmoe.testing.assert_parity` mesh strings (``"tp2/ep2"``, ``"tp2/sp"``, ...).
        params: the parameters (default: ``init`` plus noise, so that biases and norms are not at
            their init; with ``hf_class`` the transformers model's, and ``params`` must be None).
        checks: the names of :data:`CHECKS` to run.
        batch, seq: the token batch ``[batch, seq]`` (``batch`` at least every mesh's data-parallel batches).
        new_tokens: greedy tokens generated per prompt.
        compile_backend: the ``torch.compile`` backend (``"aot_eager"``: forward and backward
            graphs without code generation; ``"inductor"``: kernels too, slower to compile).
        rtol: the tolerance relative to each tensor's largest entry.
        seed: seed of the tokens and the redrawn weights.
        pool: a :class:`fmoe.testing.Pool` for the meshes (default: one for the call).
    Returns:
        check name -> worst ``max |got - want| / max |want|`` over its tensors (0.0 for ``"plan"``).
    """
    model = model_of(model)
    cfg = model.Config.tiny() if cfg is None else cfg
    if params is not None and hf_class is not None:
        raise ValueError("check_model: give params or hf_class, not both (with hf_class the parameters are the "
                         "transformers model's)")
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ValueError(f"check_model: unknown checks {unknown}; valid: {list(CHECKS)}")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    if cfg.pad_token_id is not None:
        tokens[:, ::3] = cfg.pad_token_id                   # the pad row's gradient is compared too
    worst: dict[str, float] = {}
    if "plan" in checks:
        for spec in meshes:
            model.check_plan(cfg, tp=parse_mesh(spec).get("tp", 1))
        model.plan(cfg).resolve(model.init(cfg))
        worst["plan"] = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        if hf_class is not None and {"hf", "generate"} & set(checks):
            hf = _hf_model(hf_class, cfg, seed)
            hf.save_pretrained(os.path.join(tmp, "hf"))
            loaded, loaded_cfg = model.load_hf(os.path.join(tmp, "hf"))
            assert loaded_cfg == cfg, f"check_model hf: load_hf read {loaded_cfg}, not {cfg}"
            zero = [k for k, t in _tree.flatten(loaded).items() if is_state(k) and not t.abs().sum() > 0]
            assert not zero, f"check_model hf: state leaves {zero} did not load the redrawn buffers"
            params = loaded
            if "generate" in checks and model.init_cache is not None:
                worst["generate"] = _generate(model, params, cfg, hf, new_tokens)
            if "hf" in checks:
                worst["hf"] = _hf_parity(model, params, cfg, hf, tokens, tmp, rtol)
    if params is None:
        g = torch.Generator().manual_seed(seed)
        params = _tree.map_with_path(lambda _, t: t + 0.1 * torch.randn(t.shape, generator=g), model.init(cfg, seed))
    forward = functools.partial(_logits, model, cfg)
    if "meshes" in checks and meshes:
        assert_parity(forward, params, tokens, functools.partial(_plan, model, cfg), meshes=meshes, rtol=rtol, pool=pool)
        worst["meshes"] = rtol          # assert_parity reports no number: every error is within rtol of its scale
    eager = _run(forward, params, tokens)
    if "grad" in checks:
        state = {k: t for k, t in _tree.flatten(_detached(params)).items() if is_state(k)}
        trained = {k: t for k, t in _tree.flatten(_detached(params)).items() if not is_state(k)}
        grads = torch.func.grad(lambda p: _loss(forward(_tree.unflatten({**p, **state}), tokens), tokens))(trained)
        want = {k: g for k, g in _tree.flatten(eager["grads"]).items() if not is_state(k)}
        worst["grad"] = _compare("grad", grads, want, rtol)
    if "compile" in checks:
        torch.compiler.reset()
        compiled = torch.compile(forward, backend=compile_backend)
        with torch.no_grad():
            worst["compile"] = _compare("compile", {"logits": compiled(params, tokens)}, {"logits": eager["logits"]}, rtol)
    if "remat" in checks:
        worst["remat"] = 0.0
        for kind in model.remat_blocks:
            with remat.policy(kind):
                worst["remat"] = max(worst["remat"], _compare(f"remat {kind}", _run(forward, params, tokens), eager,
                                                              rtol))
    return worst


def _logits(model: Model, cfg: Any, params: dict, tokens: torch.Tensor, mesh: Any = None) -> torch.Tensor:
    return model.forward(params, tokens, cfg, mesh)


def _plan(model: Model, cfg: Any, mesh: Any) -> Any:
    return model.build_plan(cfg, mesh=mesh, data_parallel=True)


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return cross_entropy(logits[:, :-1], tokens[:, 1:])


def _detached(params: dict) -> dict:
    return _tree.map_with_path(lambda _, t: t.detach().clone(), params)


def _run(forward: Callable, params: dict, tokens: torch.Tensor) -> dict:
    """Logits and the loss's gradient of every parameter, by ``.backward()`` (a state leaf: its value)."""
    p = _tree.map_with_path(lambda k, t: t.detach().clone().requires_grad_(not is_state(k)), params)
    logits = forward(p, tokens)
    _loss(logits, tokens).backward()
    return {"logits": logits.detach(), "grads": _tree.map_with_path(lambda k, t: t.detach() if is_state(k) else t.grad, p)}


def _compare(check: str, got: dict, want: dict, rtol: float) -> float:
    """The worst ``max |got - want| / max |want|`` over the leaves; ``AssertionError`` above ``rtol``."""
    got, want = _tree.flatten(got), _tree.flatten(want)
    if sorted(got) != sorted(want):
        raise AssertionError(f"check_model {check}: tensors {sorted(set(got) ^ set(want))} on one side only")
    worst = 0.0
    for key, w in want.items():
        g = got[key]
        if g is None or tuple(g.shape) != tuple(w.shape):
            raise AssertionError(f"check_model {check}: {key} is {None if g is None else tuple(g.shape)}, "
                                 f"expected shape {tuple(w.shape)}")
        scale = w.abs().max().item() if w.numel() else 0.0
        err = (g.double() - w.double()).abs().max().item() if w.numel() else 0.0
        ratio = err / scale if scale else (0.0 if err == 0 else float("inf"))
        if ratio > rtol:
            raise AssertionError(f"check_model {check}: {key}: max |diff| {err:.3g} is {ratio:.3g} of the scale "
                                 f"{scale:.3g} (tolerance {rtol:.1e})")
        worst = max(worst, ratio)
    return worst


def _hf_model(hf_class: Any, cfg: Any, seed: int) -> Any:
    """transformers' model of ``cfg.to_hf()`` in fp32 with eager attention, weights (and persistent
    float buffers, e.g. DeepSeek-V3's expert bias: uniform in [0, 0.5)) redrawn."""
    import transformers

    cls = getattr(transformers, hf_class) if isinstance(hf_class, str) else hf_class
    hf = cls(cls.config_class(**cfg.to_hf(), attn_implementation="eager")).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1 + noise if "norm" in name else noise)
        saved = hf.state_dict()
        for name, b in hf.named_buffers():
            if name in saved and b.is_floating_point():
                b.copy_(torch.rand(b.shape, generator=g) * 0.5)
    return hf


def _read_all(path: str) -> dict:
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _hf_parity(model: Model, params: dict, cfg: Any, hf: Any, tokens: torch.Tensor, tmp: str, rtol: float) -> float:
    """Logits, every gradient in the checkpoint layout, and ``save_hf`` -> ``from_pretrained``."""
    ours = _run(functools.partial(_logits, model, cfg), params, tokens)
    theirs = hf(tokens).logits
    _loss(theirs, tokens).backward()
    worst = _compare("hf logits", {"logits": ours["logits"]}, {"logits": theirs.detach()}, rtol)
    if model.routed:                                        # one aux per MoE layer, every token routed K times
        _, aux = model.forward(params, tokens, cfg, return_aux=True)
        layers = sum("moe" in layer for layer in params["layers"])
        counts = [int(a["tokens_per_expert"].sum()) for a in aux["moe"]]
        assert counts == [tokens.numel() * model.widths(cfg).K] * layers, \
            f"check_model hf: tokens per expert of the {layers} MoE layers sum to {counts}"
    model.save_hf(ours["grads"], cfg, os.path.join(tmp, "fmoe_grads"))
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad)
    hf.save_pretrained(os.path.join(tmp, "hf_grads"))
    worst = max(worst, _compare("hf gradients", _read_all(os.path.join(tmp, "fmoe_grads")),
                                _read_all(os.path.join(tmp, "hf_grads")), rtol))
    model.save_hf(params, cfg, os.path.join(tmp, "fmoe"))
    keys = sorted(_read_all(os.path.join(tmp, "fmoe"))), sorted(_read_all(os.path.join(tmp, "hf")))
    assert keys[0] == keys[1], f"check_model hf: save_hf wrote other keys than save_pretrained: {set(keys[0]) ^ set(keys[1])}"
    back = type(hf).from_pretrained(os.path.join(tmp, "fmoe"), attn_implementation="eager").eval()
    with torch.no_grad():
        again = back(tokens).logits
    assert torch.equal(again, theirs.detach()), "check_model hf: save_hf -> from_pretrained changes transformers' logits"
    return worst


def _generate(model: Model, params: dict, cfg: Any, hf: Any, new_tokens: int) -> float:
    """Greedy ids of :func:`fmoe.generate` equal transformers' ``generate`` (0.0), else ``AssertionError``."""
    ours = generate(model, params, cfg, PROMPTS, new_tokens)
    tokens, positions = left_pad(PROMPTS)
    theirs = hf.generate(tokens, attention_mask=(positions >= 0).long(), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    assert torch.equal(ours, theirs), f"check_model generate: greedy ids differ\nfmoe {ours.tolist()}\nhf   {theirs.tolist()}"
    S = tokens.shape[1]
    assert all(len(set(row[S:].tolist())) > 3 for row in ours), \
        f"check_model generate: a degenerate continuation proves little: {ours[:, S:].tolist()}"
    return 0.0
