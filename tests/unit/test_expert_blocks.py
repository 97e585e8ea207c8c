"""The blocked expert path (``fmoe.experts.blocked.weighted_expert_sum``): gather, SwiGLU, routing
weight and scatter-add per expert block must give the plain autograd result of the definition,
forward, backward (rows, weights, both expert matrices), double backward and under
``torch.func.grad``; fp32, rtol 1e-5. Blocks of 1 and 2 rows force the weight gradients to
accumulate over several blocks of one expert; idle experts get zero gradients.
"""

import pytest
import torch

import fmoe
from fmoe.experts.blocked import weighted_expert_sum

D, I = 8, 4


def definition(rows, row_of, counts, wgu, wd, scale):
    """Assignment by assignment: ``out[row_of[a]] += scale[a] * expert_e(rows[row_of[a]])``."""
    out = torch.zeros_like(rows)
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    for a in range(row_of.shape[0]):
        e, r = int(experts[a]), int(row_of[a])
        gate, up = (wgu[e] @ rows[r]).chunk(2)
        y = wd[e] @ (torch.nn.functional.silu(gate) * up)
        out = out.index_add(0, row_of[a:a + 1], (y if scale is None else scale[a] * y).unsqueeze(0))
    return out


def case(counts, n_rows, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    base = torch.randn(n_rows, D + 3, generator=g)
    rows = base[:, :D] if strided else base[:, :D].contiguous()              # a column view: row stride D + 3
    row_of = (torch.randint(0, n_rows, (sum(counts),), generator=g) if n_rows
              else torch.zeros(0, dtype=torch.long))
    wgu, wd = torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    scale = torch.rand(sum(counts), generator=g)
    return rows, row_of, wgu, wd, scale, torch.randn(n_rows, D, generator=g)


@pytest.mark.parametrize("counts,n_rows", [([3, 0, 5, 1], 6), ([0, 0, 0], 4), ([7], 3), ([2, 2], 0 + 9)])
@pytest.mark.parametrize("block_rows", [1, 2, 2048])
@pytest.mark.parametrize("with_scale", [True, False])
def test_matches_definition_forward_and_backward(counts, n_rows, block_rows, with_scale):
    rows, row_of, wgu, wd, scale, gout = case(counts, n_rows, seed=sum(counts) + block_rows, strided=True)
    scale = scale if with_scale else None
    results = []
    for fn in (lambda *a: weighted_expert_sum(*a[:5], scale=a[5], block_rows=block_rows),
               lambda *a: definition(a[0], a[1], a[2], a[3], a[4], a[5])):
        leaves = [t.detach().clone().requires_grad_() for t in (rows, wgu, wd)]
        sc = scale.clone().requires_grad_() if with_scale else None
        y = fn(leaves[0], row_of, counts, leaves[1], leaves[2], sc)
        inputs = leaves + ([sc] if with_scale else [])
        results.append((y, torch.autograd.grad(y, inputs, gout, allow_unused=True) if y.requires_grad
                        else [None] * len(inputs)))      # the definition with no assignment: constant 0
    (y, grads), (y_ref, grads_ref) = results
    # atol: a row sums up to 7 weighted expert outputs of O(1), in another order than the definition
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=4e-6)
    for got, want in zip(grads, grads_ref):
        assert got is not None                       # idle experts and unused rows: zeros, never None
        # atol: entries near 0 are differences of O(10) terms summed in another order (fp32 eps * 10 * n)
        torch.testing.assert_close(got, torch.zeros_like(got) if want is None else want, rtol=1e-5, atol=1e-5)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(grads[1][e], torch.zeros(2 * I, D)) and torch.equal(grads[2][e], torch.zeros(D, I))


def test_double_backward_matches_definition():
    counts = [3, 0, 4]
    rows, row_of, wgu, wd, scale, gout = case(counts, 5, seed=3)
    outs = []
    for fn in (lambda *a: weighted_expert_sum(*a[:5], scale=a[5], block_rows=2), definition):
        leaves = [t.clone().requires_grad_() for t in (rows, wgu, wd, scale)]
        y = fn(leaves[0], row_of, counts, leaves[1], leaves[2], leaves[3])
        g = torch.autograd.grad((y * gout).sum(), leaves, create_graph=True)
        penalty = sum(t.square().sum() for t in g)                    # a gradient penalty: d/dw of |grad|^2
        outs.append(torch.autograd.grad(penalty, leaves))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_under_torch_func_grad():
    counts = [2, 3]
    rows, row_of, wgu, wd, scale, gout = case(counts, 4, seed=5)
    f = lambda w: (weighted_expert_sum(rows, row_of, counts, w, wd, scale=scale, block_rows=2) * gout).sum()  # noqa: E731
    r = lambda w: (definition(rows, row_of, counts, w, wd, scale) * gout).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.grad(f)(wgu), torch.func.grad(r)(wgu), rtol=1e-5, atol=1e-6)


def test_moe_uses_the_blocked_path_on_cpu_and_matches_grouped():
    """``fmoe.moe`` on CPU with plain SwiGLU experts runs the blocked path (``matmul="loop"``,
    or ``"auto"`` from ``BLOCKED_MIN_ROWS`` rows per expert on), and its outputs and gradients
    equal the whole-tensor grouped path."""
    g = torch.Generator().manual_seed(0)
    E = 4
    p = {"router": torch.randn(E, D, generator=g), "w_gate_up": torch.randn(E, 2 * I, D, generator=g),
         "w_down": torch.randn(E, D, I, generator=g)}
    x = torch.randn(9, D, generator=g)
    experts = fmoe.experts.LocalExperts({k: p[k] for k in ("w_gate_up", "w_down")}, 0, E)
    many = fmoe.experts.BLOCKED_MIN_ROWS * E
    assert experts.blocked(x, many) and not experts.blocked(x, many - 1)
    assert fmoe.experts.LocalExperts(experts.weights, 0, E, matmul="loop").blocked(x, 1)
    assert not fmoe.experts.LocalExperts(experts.weights, 0, E, matmul="grouped").blocked(x, many)
    got = []
    for matmul in ("loop", "grouped"):
        leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
        xi = x.clone().requires_grad_()
        y, _ = fmoe.moe(leaves, xi, router=fmoe.routing.topk(2), matmul=matmul)
        got.append((y, torch.autograd.grad(y.square().sum(), [xi, *leaves.values()])))
    torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[0][1], got[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_input_is_named():
    rows, wgu, wd = torch.randn(3, D), torch.randn(2, 2 * I, D), torch.randn(2, D, I)
    with pytest.raises(ValueError, match=r"counts \[1, 1\] do not fit 2 experts and 3 assignments"):
        weighted_expert_sum(rows, torch.tensor([0, 1, 2]), [1, 1], wgu, wd)
    with pytest.raises(ValueError, match=r"scale must have shape \(2,\)"):
        weighted_expert_sum(rows, torch.tensor([0, 1]), [1, 1], wgu, wd, scale=torch.ones(3))
    with pytest.raises(ValueError, match="block_rows must be a positive int, got 0"):
        weighted_expert_sum(rows, torch.tensor([0, 1]), [1, 1], wgu, wd, block_rows=0)
