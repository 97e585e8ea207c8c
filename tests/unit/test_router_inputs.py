"""Every model offers its routers the inputs the contract names (``fmoe.routing.OFFERED``): the
token ids of the rows a router scores and the decoder layer's index; a router receives them when
it declares them, so ``hash_router`` routes by token id on every family through the library."""

import pytest
import torch

import fmoe
import fmoe.models
from fmoe.routing import hash_router, token_hash, topk

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "olmoe")


def _families():
    for name in FAMILIES:
        try:
            yield fmoe.models.get(name)
        except (KeyError, ValueError):          # a family not shipped in this checkout
            continue


@pytest.mark.parametrize("model", list(_families()), ids=lambda m: m.name)
def test_every_family_hands_its_routers_token_ids_and_the_layer(model):
    cfg = model.Config.tiny()
    params = model.init(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    seen = []

    def spy(logits, *, token_ids, layer, expert_bias=None):     # deepseek_v3's params hold an expert bias
        seen.append((layer, token_ids))
        return hash_router(k=2, seed=layer)(logits, token_ids=token_ids)

    _, aux = model.forward(params, tokens, cfg, router=spy, return_aux=True)
    moe_layers = [i for i, layer in enumerate(params["layers"]) if "moe" in layer]
    assert [layer for layer, _ in seen] == moe_layers
    E = aux["moe"][0]["load"].numel()
    for (layer, ids), a in zip(seen, aux["moe"]):
        assert torch.equal(ids, tokens.reshape(-1))
        want = sum(torch.bincount(token_hash(ids, E, layer * 2 + j), minlength=E) for j in range(2))
        assert torch.equal(a["load"], want)
    plain = lambda logits, expert_bias=None: topk(2)(logits)     # noqa: E731  (declares no offered input)
    _, aux = model.forward(params, tokens, cfg, router=plain, return_aux=True)
    assert int(aux["moe"][0]["load"].sum()) == 2 * tokens.numel()
