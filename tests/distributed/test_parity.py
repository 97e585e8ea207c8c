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
    assert "worst: tp2/ep2 rank 0: grad params.w_down" in msg, msg
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
    assert "grad params.scale" in msg.partition("\n")[0] and "placement P()" in msg, msg
    assert all("grad params.scale" in line for line in msg.splitlines()[1:]), msg


def test_bad_meshes_are_refused_before_any_rank_starts():
    x = torch.randn(4, D)
    with pytest.raises(ValueError, match=r"mesh 'tp2/xp2': bad part 'xp2'"):
        assert_parity(layer, moe_params(), x, MOE_PLAN, meshes=["tp2/xp2"])
    with pytest.raises(ValueError, match=r"mesh 'tp3' on 4 ranks"):
        assert_parity(layer, moe_params(), x, MOE_PLAN, meshes=["tp1/ep4", "tp3"])
    with pytest.raises(ValueError, match="meshes must be a non-empty list"):
        assert_parity(layer, moe_params(), x, MOE_PLAN, meshes="tp1/ep4")
