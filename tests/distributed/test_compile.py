"""Compile is the fast path: what ``torch.compile`` of fmoe must keep.

- The expert GEMMs stay grouped under every transform: the compiled ``torch.func.grad`` of a
  64-expert top-2 layer runs exactly the FLOPs of its eager ``grad`` (counted by
  ``torch.utils.flop_counter.FlopCounterMode`` inside the compiled graph), not one masked matmul
  per expert (G times the FLOPs, what fmoe did before);
- a plain ``torch.compile(f)`` is not a ``torch.func`` transform (:func:`fmoe.transforms.func_active`).
"""

from collections import Counter

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils.flop_counter import FlopCounterMode

import fmoe
from fmoe.transforms import func_active


def counting_backend(counts: Counter):
    """AOTAutograd with its graphs (forward, backward) run as Python, each run under a
    ``FlopCounterMode`` whose FLOPs per operator are added to ``counts``."""
    def compiler(gm, _example_inputs):
        def run(*args):
            with FlopCounterMode(display=False) as mode:
                out = gm(*args)
            counts.update(mode.get_flop_counts()["Global"])
            return out
        return make_boxed_func(run)
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def moe_layer(e=64, d=32, i=16, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = {"router": torch.randn(e, d, generator=g), "w_gate_up": torch.randn(e, 2 * i, d, generator=g) / d ** 0.5,
         "w_down": torch.randn(e, d, i, generator=g) / i ** 0.5}
    x = torch.randn(n, d, generator=g)
    return p, lambda p: fmoe.moe(p, x, router=fmoe.routing.topk(2))[0].square().sum()


def test_compiled_grad_of_a_64_expert_layer_costs_its_eager_flops():
    p, loss = moe_layer()
    grad = torch.func.grad(loss)
    with FlopCounterMode(display=False) as eager:
        ref = grad(p)
    counts = Counter()
    out = torch.compile(grad, backend=counting_backend(counts), fullgraph=True)(p)
    assert eager.get_total_flops() > 0
    # the grouped operators carry the expert GEMMs; the masked path had 64 aten.mm per projection
    assert counts[torch.ops.fmoe.grouped_mm] > 0 and counts[torch.ops.fmoe.grouped_wgrad] > 0
    assert counts == Counter(eager.get_flop_counts()["Global"])
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=0, atol=1e-6 * ref[k].abs().max().item())


def test_compiled_backward_of_a_64_expert_layer_costs_its_eager_flops():
    p, loss = moe_layer()
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    with FlopCounterMode(display=False) as eager:
        torch.func.grad(loss)(p)
    counts = Counter()
    torch.compile(loss, backend=counting_backend(counts), fullgraph=True)(leaves).backward()
    assert counts == Counter(eager.get_flop_counts()["Global"])


def test_plain_compile_is_not_a_transform():
    seen = []

    def f(x):
        seen.append(func_active())
        return x * 2

    torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    torch.compile(torch.func.grad(lambda x: f(x).sum()), backend="eager", fullgraph=True)(torch.ones(2))
    assert seen == [False, True]
