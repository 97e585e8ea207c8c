"""Every collective's forward and backward against a single-process computation of the same math."""

import torch
import torch.distributed as dist

from fmoe import collectives as C
from helpers import on_ranks

W = 4


def rows(src, n, d=3):
    return torch.arange(n * d, dtype=torch.float32).view(n, d) + 100 * src


def splits(src, dst):
    return (src + 2 * dst) % 3          # includes zeros: some pairs exchange nothing


def weights(rank, n, d=3):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(17 + rank))


def _check(rank, world):
    g = dist.group.WORLD
    res = {}
    # all_to_all: uneven + empty splits; total loss = sum over ranks of (received * W_rank)
    x = rows(rank, sum(splits(rank, s) for s in range(world))).requires_grad_(True)
    in_s = [splits(rank, s) for s in range(world)]
    out_s = [splits(s, rank) for s in range(world)]
    y = C.all_to_all(x, out_s, in_s, g)
    want_y = torch.cat([rows(s, sum(splits(s, q) for q in range(world)))[sum(splits(s, q) for q in range(rank)):][:splits(s, rank)] for s in range(world)])
    res["a2a_fwd"] = torch.equal(y, want_y)
    (y * weights(rank, y.shape[0])).sum().backward()
    # reference grad of x on this rank: each row is multiplied by the weight row of its receiver
    want = torch.cat([weights(s, sum(splits(q, s) for q in range(world)))[sum(splits(q, s) for q in range(rank)):][:splits(rank, s)] for s in range(world)])
    res["a2a_bwd"] = torch.allclose(x.grad, want, rtol=0, atol=0)
    fg = torch.func.grad(lambda t: (C.all_to_all(t, out_s, in_s, g) * weights(rank, y.shape[0])).sum())(x.detach())
    res["a2a_func_grad"] = torch.equal(fg, want)
    # all_reduce: replicated output, identical loss on every rank -> grad is W
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = C.all_reduce(x, g)
    res["ar_fwd"] = torch.equal(y, torch.full((2, 3), float(sum(range(1, world + 1)))))
    (y * weights(0, 2)).sum().backward()
    res["ar_bwd"] = torch.equal(x.grad, weights(0, 2))
    # grad_sum: each rank's partial loss (y * W_rank); total grad = sum_r W_r
    x = torch.ones(2, 3, requires_grad=True)
    (C.grad_sum(x, g) * weights(rank, 2)).sum().backward()
    res["copy_bwd"] = torch.allclose(x.grad, sum(weights(r, 2) for r in range(world)), atol=1e-6)
    # all_gather, uneven (rank 0 holds 0 rows): exact adjoint = reduce-scatter
    sizes = [r for r in range(world)]
    x = rows(rank, sizes[rank]).requires_grad_(True)
    y = C.all_gather(x, g)
    res["ag_fwd"] = torch.equal(y, torch.cat([rows(r, sizes[r]) for r in range(world)]))
    (y * weights(rank, y.shape[0])).sum().backward()
    tot = sum(weights(r, sum(sizes)) for r in range(world))
    res["ag_bwd"] = torch.allclose(x.grad, tot[sum(sizes[:rank]):sum(sizes[:rank + 1])], atol=1e-6)
    # equal sizes: same gradient as torch.distributed.nn.functional.all_gather
    x1 = rows(rank, 2).requires_grad_(True)
    x2 = rows(rank, 2).requires_grad_(True)
    (C.all_gather(x1, g, dim=1, sizes=[3] * world) * torch.arange(3.0 * world)).sum().backward()
    ref = torch.cat(torch.distributed.nn.functional.all_gather(x2), dim=1)
    (ref * torch.arange(3.0 * world)).sum().backward()
    res["ag_vs_torch"] = torch.allclose(x1.grad, x2.grad)
    # gather_slices: each rank computes the same loss; grad = own slice of W
    x = rows(rank, sizes[rank]).requires_grad_(True)
    (C.gather_slices(x, g) * weights(0, sum(sizes))).sum().backward()
    res["gr_bwd"] = torch.equal(x.grad, weights(0, sum(sizes))[sum(sizes[:rank]):sum(sizes[:rank + 1])])
    # reduce_scatter: y_r = sum_s x_s[slice r]; grad x_s = concat_r W_r
    x = rows(rank, 2 * world).requires_grad_(True)
    y = C.reduce_scatter(x, g)
    res["rs_fwd"] = torch.equal(y, sum(rows(s, 2 * world) for s in range(world))[2 * rank:2 * rank + 2])
    (y * weights(rank, 2)).sum().backward()
    res["rs_bwd"] = torch.equal(x.grad, torch.cat([weights(r, 2) for r in range(world)]))
    res["sizes"] = C.all_gather_sizes(rank * 2, g) == [0, 2, 4, 6]
    return res


def test_collectives_forward_backward_on_four_ranks():
    for rank, res in enumerate(on_ranks(_check, W)):
        assert all(res.values()), (rank, {k: v for k, v in res.items() if not v})


def test_single_process_collectives_are_identity():
    x = torch.randn(3, 2, requires_grad=True)
    for fn in (C.all_reduce, C.grad_sum, C.all_gather, C.gather_slices, C.reduce_scatter):
        assert fn(x, None) is x
    assert C.all_to_all(x, [3], [3], None) is x
