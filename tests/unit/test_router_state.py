"""Router state is known by where it sits (:func:`fmoe.routing.state.is_state`), not by its name:
ReMoE's ``l1_coef`` is treated as ``expert_bias`` is (fp32 under bf16, no gradient, no optimizer update)."""

import pytest
import torch

import fmoe
from fmoe import routing
from fmoe.optim import adamw
from fmoe.routing.state import is_state
from fmoe.training import StepConfig, router_state
from fmoe.training.forward import compute_params
from fmoe.training.step import train_step


def test_remoe_state_stays_fp32_under_bf16_and_gets_no_optimizer_update():
    from fmoe.models import qwen3_moe

    cfg = qwen3_moe.Config.tiny()
    router = routing.remoe(k=2, l1_init=0.01)
    full = router_state.with_states(qwen3_moe.init(cfg), router)
    params = fmoe.tree.map_with_path(lambda p, t: t.requires_grad_(not is_state(p)), full)
    state = [p for p in fmoe.tree.paths(params) if is_state(p)]
    assert state and all(p.endswith("moe.l1_coef") for p in state), state
    compute = fmoe.tree.flatten(compute_params(params, "bf16"))
    assert [compute[p].dtype for p in state] == [torch.float32] * len(state)          # the master value
    assert compute[state[0].replace("l1_coef", "router")].dtype == torch.bfloat16
    router0 = state[0].replace("l1_coef", "router")
    before = fmoe.tree.flatten(params)[router0].detach().clone()
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    new, opt, m = train_step(qwen3_moe, cfg, params, adamw.init(params), (tokens, tokens), mesh=fmoe.Mesh(),
                             step_cfg=StepConfig(router=router, dtype="bf16"), lr=1e-2)
    flat, moments = fmoe.tree.flatten(new), fmoe.tree.flatten(opt["m"])
    for i, p in enumerate(state):
        assert flat[p].dtype == torch.float32 and not flat[p].requires_grad, p
        assert moments[p].abs().sum() == 0 and fmoe.tree.flatten(opt["v"])[p].abs().sum() == 0, p   # no AdamW step
        want = 0.01 * 1.2 ** (1 if m["active"][i] > 2 else -1 if m["active"][i] < 2 else 0)   # its own update only
        assert float(flat[p]) == pytest.approx(want, rel=1e-6), (p, m["active"][i])
    assert not torch.equal(flat[router0], before)                                    # the weights did train
