"""Router replay: recorded ids come back exactly; weights (and router gradients) are the live ones."""

import os

import pytest
import torch

import fmoe
from fmoe.models import qwen3_moe
from fmoe.routing.record import load_record, recording, replay, save_record
from train_cases import read_log, train_cli


def _loss_and_router_grads(params, cfg, tokens, router):
    leaves = fmoe.tree.map_with_path(lambda _, t: t.detach().requires_grad_(True), params)
    logits = qwen3_moe.forward(leaves, tokens, cfg, router=router)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), [layer["moe"]["router"].grad for layer in leaves["layers"]]


def test_replay_gives_the_recorded_ids_and_the_live_router_gradients(tmp_path):
    cfg = qwen3_moe.Config.tiny()
    params = qwen3_moe.init(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    live = fmoe.routing.topk(cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob)
    calls = []
    loss, grads = _loss_and_router_grads(params, cfg, tokens, recording(live, calls))
    assert len(calls) == cfg.num_hidden_layers
    save_record(calls, tmp_path / "r.safetensors")
    assert [c.dtype for c in load_record(tmp_path / "r.safetensors")] == [torch.int64] * len(calls)
    again = []
    loss2, grads2 = _loss_and_router_grads(params, cfg, tokens, recording(replay(tmp_path / "r.safetensors"), again))
    assert all(torch.equal(a, b) for a, b in zip(calls, again))
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    assert all(g.abs().sum() > 0 for g in grads2)                       # router gradients flow
    # other params: the live router would choose otherwise; replay keeps the recorded ids
    moved = fmoe.tree.map_with_path(lambda p, t: t + 0.5 * torch.randn_like(t) if p.endswith("router") else t, params)
    fresh, replayed = [], []
    _loss_and_router_grads(moved, cfg, tokens, recording(live, fresh))
    _loss_and_router_grads(moved, cfg, tokens, recording(replay(calls), replayed))
    assert not all(torch.equal(a, b) for a, b in zip(calls, fresh))
    assert all(torch.equal(a, b) for a, b in zip(calls, replayed))
    with pytest.raises(ValueError, match="the record holds 2 router calls; this is call 3"):
        r = replay(calls)
        for _ in range(3):
            r(torch.zeros(24, cfg.num_experts))


def test_record_and_replay_from_the_command_line(tmp_path):
    a, b, rec, rec2 = (str(tmp_path / n) for n in ("a", "b", "rec", "rec2"))
    base = ["--model", "qwen3_moe", "--preset", "tiny", "--nproc", "2", "--ep", "2", "--steps", "2", "--batch", "2",
            "--seq", "16", "--quiet"]
    train_cli(*base, "--record-routing", rec, "--out", a)
    assert sorted(os.listdir(rec)) == ["rank-0.safetensors", "rank-1.safetensors"]
    train_cli(*base, "--router", f"replay:record={rec}", "--record-routing", rec2, "--out", b)
    for r in range(2):
        want, got = (load_record(os.path.join(d, f"rank-{r}.safetensors")) for d in (rec, rec2))
        assert len(want) == 2 * 2 and all(torch.equal(x, y) for x, y in zip(want, got))   # 2 steps x 2 layers
    ra, rb = read_log(a), read_log(b)
    assert ra[0]["loss"] == rb[0]["loss"] and ra[0]["expert_load"] == rb[0]["expert_load"]
    bad = train_cli(*base, "--router", f"replay:record={rec}", "--remat", "layer", "--out", str(tmp_path / "c"),
                    check=False)
    assert bad.returncode == 2 and "recomputation calls the router again" in bad.stderr


def test_a_record_names_its_router_and_replays_a_user_router_bitwise_or_refuses(tmp_path):
    """The record stores the router's spec: a user router (its own score function) is replayed by
    calling it, bitwise the live run (loss and router gradients); a replay that would reweight it
    with another formula, or a call where it now chooses other experts, is refused naming it. A
    built-in's formula comes from the record (sigmoid_topk replays as sigmoid)."""
    from router_cases import own_top2

    cfg = qwen3_moe.Config.tiny()
    params = qwen3_moe.init(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    loss, grads = _loss_and_router_grads(params, cfg, tokens, recording(own_top2, calls))
    save_record(calls, tmp_path / "own.safetensors", router="router_cases:own_top2")
    loss2, grads2 = _loss_and_router_grads(params, cfg, tokens,
                                           fmoe.routing.from_spec(f"replay:record={tmp_path / 'own.safetensors'}"))
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    with pytest.raises(ValueError, match=r"made by router 'router_cases:own_top2' \(its own score function\); "
                                         r"replaying it with scores='softmax'"):
        replay(tmp_path / "own.safetensors", scores="softmax")
    moved = fmoe.tree.map_with_path(lambda p, t: t + torch.randn_like(t) if p.endswith("router") else t, params)
    with pytest.raises(ValueError, match=r"call 1: the recorded router 'router_cases:own_top2' now chooses other"):
        _loss_and_router_grads(moved, cfg, tokens, replay(tmp_path / "own.safetensors", resolve=fmoe.routing.from_spec))
    save_record(calls, tmp_path / "sig.safetensors", router="sigmoid_topk:k=2")
    with pytest.raises(ValueError, match=r"made by router 'sigmoid_topk:k=2' \(sigmoid scores\)"):
        replay(tmp_path / "sig.safetensors", scores="softmax")
    r = replay(tmp_path / "sig.safetensors")(torch.zeros(24, cfg.num_experts))
    assert torch.allclose(r.weights, torch.full((24, 2), 0.5))               # sigmoid, renormalized
