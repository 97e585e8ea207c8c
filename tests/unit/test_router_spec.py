"""Routers named by text (``--router``, ``meta.json``): built-ins with checked keys, user code as a
router or a factory (with or without arguments), and what the errors say."""

import sys
import types

import pytest
import torch

from fmoe import routing
from fmoe.routing import ROUTERS, Routing, from_spec, parse_spec


def test_built_in_names_are_routers_only():
    assert "aux_losses" not in ROUTERS and "balance" not in ROUTERS and "update_bias" not in ROUTERS
    for name in ROUTERS:
        assert callable(getattr(routing, name))
    with pytest.raises(ValueError, match="'aux_losses' is not a built-in scheme; choose from topk, topk_softmax"):
        from_spec("aux_losses")


def test_unknown_key_lists_the_valid_keys():
    with pytest.raises(ValueError, match="unexpected keyword argument 'cf'; expert_choice takes capacity_factor, "
                                         "k, max_experts"):
        from_spec("expert_choice:cf=2")
    with pytest.raises(ValueError, match=r"--router 'switch:capacity=1': unexpected keyword argument 'capacity'; "
                                         "switch takes capacity_factor, k, normalize"):
        from_spec("switch:capacity=1", "--router")
    r = from_spec("expert_choice:capacity_factor=2.0,k=1")
    assert r(torch.zeros(4, 4)).weights.shape[0] == 4


@pytest.fixture()
def user_module():
    mod = types.ModuleType("user_routers_i35")

    def top1(logits):
        w, ids = torch.softmax(logits, -1).max(-1, keepdim=True)
        return Routing(w, ids, {})

    def make(scale=1.0):                      # a factory: every argument has a default
        def router(logits):
            return top1(logits * scale)
        router.scale = scale
        return router

    mod.top1, mod.make, mod.value = top1, make, 3
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_user_router_factory_with_and_without_arguments(user_module):
    assert from_spec("user_routers_i35:top1") is user_module.top1            # the router itself
    assert from_spec("user_routers_i35:make").scale == 1.0                   # zero-argument factory: called
    assert from_spec("user_routers_i35:make:scale=0.5").scale == 0.5
    assert from_spec("user_routers_i35:make")(torch.zeros(2, 3)).expert_ids.shape == (2, 1)
    with pytest.raises(ValueError, match="unexpected keyword argument 'k'; make takes scale"):
        from_spec("user_routers_i35:make:k=2")
    with pytest.raises(ValueError, match="user_routers_i35.value is not callable"):
        from_spec("user_routers_i35:value")
    with pytest.raises(ValueError, match="cannot import 'nope'"):
        from_spec("user_routers_i35:nope")


def test_parse_spec_values_and_errors():
    assert parse_spec("sigmoid_topk:k=2,scale=2.5") == ("fmoe.routing", "sigmoid_topk", {"k": 2, "scale": 2.5})
    assert parse_spec("replay:record=runs/a") == ("fmoe.routing", "replay", {"record": "runs/a"})
    with pytest.raises(ValueError, match="'x' is not key=value"):
        parse_spec("topk:k=2,x")
    with pytest.raises(ValueError, match="expected NAME"):
        parse_spec(" ")


def test_routers_a_balance_loss_does_not_fit_say_why():
    assert "balanced by construction" in routing.expert_choice(2.0).no_balance_loss
    for r in (routing.hash_router(), routing.balanced(), routing.random_topk()):
        assert "do not depend on the router's scores" in r.no_balance_loss
    for r in (routing.topk(2), routing.switch(1.0), routing.sigmoid_topk(2)):
        assert not hasattr(r, "no_balance_loss")
