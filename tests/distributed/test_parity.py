"""fmoe.testing.assert_parity: passes on correct code (even and uneven batches, an empty one) and
names the leaf of a planted bug: a gradient x2 on one mesh, a wrong gradient placement."""

import pytest
import torch
from einops import rearrange

import fmoe
from fmoe import P
from fmoe.testing import Pool, assert_parity

E, D, I, H = 8, 16, 8, 4


@pytest.fixture(scope="module")
def pool():
    with Pool(4) as p:
        yield p


def moe_params():
    g = torch.Generator().manual_seed(0)
    return {"router": torch.randn(E, D, generator=g), "w_gate_up": torch.randn(E, 2 * I, D, generator=g) / D ** 0.5,
            "w_down": torch.randn(E, D, I, generator=g) / I ** 0.5}


MOE_PLAN = fmoe.Plan({"w_*": P("ep", None, None)}, default=P())


def layer(params, x, mesh=None):
    return fmoe.moe(params, x, router=fmoe.routing.topk(2), mesh=mesh)[0]


def doubled_on_tp2(params, x, mesh=None):
    if mesh is not None and mesh.tp == 2:                    # the planted bug: grad of w_down x2
        w = params["w_down"]
        params = dict(params, w_down=w + (w - w.detach()))
    return layer(params, x, mesh)


@pytest.mark.parametrize("tokens", [32, 30, 3])             # even; uneven; fewer tokens than batches
def test_a_correct_layer_passes_on_every_mesh(pool, tokens):
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(1))
    assert_parity(layer, moe_params(), x, MOE_PLAN, meshes=["tp1/ep4", "tp2/ep2", "tp1/ep2", "tp2/ep2/dp2"],
                  pool=pool)


def test_a_gradient_x2_on_one_mesh_is_caught_naming_leaf_and_mesh(pool):
    x = torch.randn(32, D, generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError) as info:
        assert_parity(doubled_on_tp2, moe_params(), x, MOE_PLAN, meshes=["tp1/ep4", "tp2/ep2"], pool=pool)
    msg = str(info.value)
    assert "worst: tp2/ep2 rank" in msg and ": grad params.w_down" in msg and "this rank's slice" in msg, msg
    assert "tp1/ep4" not in msg and "grad params.w_gate_up" not in msg and "output" not in msg, msg
    assert "4 of 40 checks differ" in msg, msg              # 4 ranks x w_down; 10 checks per rank


def head_scale(params, x, mesh=None, partial_grad=("tp",)):
    """Attention-like: heads sharded over tp, a replicated per-head-dim scale, rowwise output."""
    h = fmoe.nn.linear(x, params["w_in"])                    # [T, H*hd / tp] (colwise)
    h = rearrange(h, "t (h d) -> t h d", d=params["scale"].shape[0])
    scale = fmoe.to_local(params["scale"], partial_grad=partial_grad if mesh is not None else ())
    h = rearrange(h * scale, "t h d -> t (h d)")
    return fmoe.nn.linear(h, params["w_out"])                # [T, D] (rowwise, all-reduced)


def forgets_partial(params, x, mesh=None):
    return head_scale(params, x, mesh, partial_grad=())      # the planted bug: grad placed Replicate


def dense_params():
    g = torch.Generator().manual_seed(2)
    return {"w_in": torch.randn(H * I, D, generator=g) / D ** 0.5, "w_out": torch.randn(D, H * I, generator=g) / I,
            "scale": 1 + torch.rand(I, generator=g)}


DENSE_PLAN = fmoe.Plan({"w_in": P("tp", None), "w_out": P(None, "tp")}, default=P())


def test_a_wrong_gradient_placement_is_caught_naming_the_leaf(pool):
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(3))
    assert_parity(head_scale, dense_params(), x, DENSE_PLAN, meshes=["tp2", "tp4", "tp2/fsdp2"], pool=pool)
    with pytest.raises(AssertionError) as info:
        assert_parity(forgets_partial, dense_params(), x, DENSE_PLAN, meshes=["tp2", "tp4"], pool=pool)
    msg = str(info.value)
    assert "grad params.scale" in msg.partition("\n")[0] and "fsdp=R, tp=R, ranks summed" in msg, msg   # not P()
    assert all("grad params.scale" in line for line in msg.splitlines()[1:]), msg


def test_bad_meshes_are_refused_before_any_rank_starts():
    x = torch.randn(4, D)
    with pytest.raises(ValueError, match=r"mesh 'tp2/xp2': bad part 'xp2'"):
        assert_parity(layer, moe_params(), x, MOE_PLAN, meshes=["tp2/xp2"])
    with pytest.raises(ValueError, match=r"mesh 'tp3' on 4 ranks"):
        assert_parity(layer, moe_params(), x, MOE_PLAN, meshes=["tp1/ep4", "tp3"])
    with pytest.raises(ValueError, match="meshes must be a non-empty list"):
        assert_parity(layer, moe_params(), x, MOE_PLAN, meshes="tp1/ep4")


# ----------------------------------------------------------------- one rank differs; per-batch routers
def off_on_rank1(params, x, mesh=None):
    """The planted bug: rank 1's output is off by 1e-2 (the other ranks agree with one process)."""
    y = layer(params, x, mesh)
    return y + 1e-2 if mesh is not None and mesh.rank == 1 else y


def grad_off_on_rank1(params, x, mesh=None):
    """The planted bug: equal outputs everywhere, rank 1's w_down gradient (its experts' shard) x2."""
    if mesh is not None and mesh.rank == 1:
        w = params["w_down"]
        params = dict(params, w_down=w + (w - w.detach()))
    return layer(params, x, mesh)


def test_a_one_rank_difference_fails_within_seconds_naming_mesh_rank_and_leaf(pool):
    """Every rank votes on running backward: the ranks whose output matched do not enter the
    backward all-to-all alone (once: a transport error after a hang)."""
    import time

    x = torch.randn(32, D, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    with pytest.raises(AssertionError) as info:
        assert_parity(off_on_rank1, moe_params(), x, MOE_PLAN, meshes=["tp1/ep2"], world=2, pool=pool)
    msg = str(info.value)
    assert "worst: tp1/ep2 rank 1: output: max |diff| 1.00e-02" in msg and "rank 0" not in msg, msg
    assert "gradients not compared" in msg, msg
    with pytest.raises(AssertionError) as info:
        assert_parity(grad_off_on_rank1, moe_params(), x, MOE_PLAN, meshes=["tp1/ep2"], world=2, pool=pool)
    msg = str(info.value)
    assert "worst: tp1/ep2 rank 1: grad params.w_down" in msg and "output" not in msg, msg   # its own slice
    assert "rank 0" not in msg and "this rank's slice" in msg, msg
    assert time.perf_counter() - t0 < 30, "a parity failure must not wait for a timeout"


def z_penalty_router(value_bug=False, grad_bug=False):
    """Top-2 with a z penalty of the global batch; planted on rank 1: the value off by 1e-3, or the
    same value with a doubled gradient."""
    import torch.distributed as dist

    def router(logits):
        r = fmoe.routing.topk(2)(logits)
        sq = torch.logsumexp(logits.float(), -1).square().sum()
        on_rank1 = dist.is_initialized() and dist.get_rank() == 1
        if grad_bug and on_rank1:
            sq = sq + (sq - sq.detach())
        z = fmoe.routing.global_stats.GlobalStat({"sq": sq, "t": sq.new_tensor(float(len(logits)))},
                                                 lambda s: 1e-2 * s["sq"] / s["t"])
        aux = {"z_penalty": fmoe.routing.Loss(z)}
        if value_bug:
            aux["z_penalty"] = fmoe.routing.Loss(fmoe.routing.global_stats.GlobalStat(
                {"sq": sq, "t": sq.new_tensor(float(len(logits)))},
                lambda s: 1e-2 * s["sq"] / s["t"] + (1e-3 if on_rank1 else 0.0)))
        return fmoe.routing.Routing(r.weights, r.expert_ids, aux)

    return router


def aux_layer(params, x, mesh=None, **bugs):
    return fmoe.moe(params, x, router=z_penalty_router(**bugs), mesh=mesh)


def test_aux_values_and_aux_loss_gradients_are_compared_naming_key_and_rank(pool):
    """aux=True: a correct router passes (values and gradients of its aux loss on every mesh); a
    value off on rank 1 names the key and rank 1; a doubled aux-loss gradient on rank 1 names the
    key, the leaf and rank 1: the router's gradient, the sum of every rank's share, differs (ranks
    summed), and so does rank 1's own share against its batch's share in one process."""
    from functools import partial

    x = torch.randn(32, D, generator=torch.Generator().manual_seed(1))
    assert_parity(aux_layer, moe_params(), x, MOE_PLAN, meshes=["tp1/ep4", "tp2/ep2"], pool=pool, aux=True)
    with pytest.raises(AssertionError) as info:
        assert_parity(partial(aux_layer, value_bug=True), moe_params(), x, MOE_PLAN, meshes=["tp1/ep2"], world=2,
                      pool=pool, aux=True)
    msg = str(info.value)
    assert "worst: tp1/ep2 rank 1: aux z_penalty" in msg and "rank 0" not in msg, msg
    with pytest.raises(AssertionError) as info:
        assert_parity(partial(aux_layer, grad_bug=True), moe_params(), x, MOE_PLAN, meshes=["tp1/ep2"], world=2,
                      pool=pool, aux=True)
    msg = str(info.value)
    assert "tp1/ep2 (ranks summed): grad of aux z_penalty: params.router" in msg, msg
    assert "tp1/ep2 rank 1: grad of aux z_penalty: params.router" in msg and "rank 0" not in msg, msg
    assert "this rank's share (batch 1 of 2)" in msg, msg
    assert "fsdp=P(sum)" in msg and ": aux z_penalty" not in msg and "grad params." not in msg, msg


def switch_layer(params, x, mesh=None):
    return fmoe.moe(params, x, router=fmoe.routing.switch(1.0, k=2), mesh=mesh)[0]


def expert_choice_layer(params, x, mesh=None):
    return fmoe.moe(params, x, router=fmoe.routing.expert_choice(2.0), mesh=mesh)[0]


@pytest.mark.parametrize("fn", [switch_layer, expert_choice_layer], ids=["switch", "expert_choice"])
def test_routers_that_decide_per_batch_pass_against_a_per_batch_reference(pool, fn):
    """Capacity binds within each data-parallel batch: the union reference differs, the
    per-batch one (one process, each batch in turn) is what the mesh computes."""
    x = torch.randn(32, D, generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError, match="tp1/ep2 rank"):
        assert_parity(fn, moe_params(), x, MOE_PLAN, meshes=["tp1/ep2"], world=2, pool=pool)
    assert_parity(fn, moe_params(), x, MOE_PLAN, meshes=["tp1/ep2", "tp2/ep2", "tp1/ep4"], pool=pool, per_batch=True)


def test_a_second_call_leaves_no_gloo_group_behind():
    """Two calls in one process, each with its own pool: no 'gloo group(s) outlived the call'."""
    import warnings

    x = torch.randn(8, D, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert_parity(layer, moe_params(), x, MOE_PLAN, meshes=["tp1/ep2"], world=2)
    assert not [w for w in caught if "outlived" in str(w.message)], [str(w.message) for w in caught]
