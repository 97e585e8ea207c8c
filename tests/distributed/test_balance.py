"""Load balancing as flags: biased routers, the balance losses, global-batch balance, the
expert-bias update, MaxVio and held-out load statistics, usage errors, distributed parity."""

import argparse
import importlib

import pytest
import torch

import fmoe
from fmoe.routing import balance as B
from fmoe.routing.metrics import load_metrics, maxvio
from helpers import on_ranks
from fmoe.training import balancing
from balance_cases import run, settings

MODELS = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


def test_biased_twins_route_like_their_routers_at_zero_bias():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    for plain, biased in ((fmoe.routing.topk(2, normalize=True), B.biased_topk(2, normalize=True)),
                          (fmoe.routing.topk(3, normalize=False), B.biased_topk(3, normalize=False)),
                          (fmoe.routing.topk_softmax(2), B.biased_topk_softmax(2))):
        a, b = plain(logits), biased(logits, expert_bias=torch.zeros(8))
        assert torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.weights, b.weights)
    # a large bias forces the choice; the weights stay the unbiased scores
    r = B.biased_topk(1, normalize=False)(logits, expert_bias=torch.tensor([0.0] * 7 + [10.0]))
    assert (r.expert_ids == 7).all()
    torch.testing.assert_close(r.weights[:, 0], torch.softmax(logits, -1)[:, 7])
    assert B.reads_bias(B.biased_topk(2)) and not B.reads_bias(fmoe.routing.topk(2))


@pytest.mark.parametrize("name", MODELS)
def test_trainer_routers_equal_each_models_own(name):
    """balancing.model_router is the model's default router (and its biased twin at a zero bias)."""
    model = importlib.import_module(f"fmoe.models.{name}")
    cfg = model.Config.tiny()
    params = model.init(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    want = model.forward(params, tokens, cfg)
    got = model.forward(params, tokens, cfg, router=balancing.model_router(model.MODEL, cfg))
    assert torch.equal(want, got)
    ns = argparse.Namespace(model=name, balance="bias")
    biased = model.forward(balancing.with_expert_bias(params, ns), tokens, cfg,
                           router=balancing.model_router(model.MODEL, cfg, biased=True))
    assert torch.equal(want, biased)


def test_maxvio_dead_experts_and_percentiles_by_hand():
    loads = [torch.tensor([4, 4, 4, 4]), torch.tensor([10, 2, 4, 0]), torch.tensor([3, 3, 3, 7])]
    # mean 4 each: maxvio = (max - 4) / 4
    m = load_metrics(loads, "eval_")
    assert m["eval_maxvio"] == [0.0, 1.5, 0.75]
    assert m["eval_dead_experts"] == [0, 1, 0]
    assert m["eval_maxvio_max"] == 1.5 and abs(m["eval_maxvio_mean"] - 0.75) < 1e-12
    assert m["eval_maxvio_p50"] == 0.75 and abs(m["eval_maxvio_p90"] - (0.75 + 0.8 * 0.75)) < 1e-12
    assert maxvio(torch.zeros(4, dtype=torch.long)).item() == 0.0


def test_bias_update_rules_by_hand():
    load = torch.tensor([6.0, 2.0, 0.0, 4.0])                      # mean 3
    sign = fmoe.routing.update_bias(torch.zeros(4), load, rate=0.1)
    prop = fmoe.routing.update_bias(torch.zeros(4), load, rate=0.1, rule="proportional")
    torch.testing.assert_close(sign, torch.tensor([-0.1, 0.1, 0.1, -0.1]))
    torch.testing.assert_close(prop, torch.tensor([-0.1, 1 / 30, 0.1, -1 / 30]))
    with pytest.raises(ValueError, match="rule must be one of"):
        fmoe.routing.update_bias(torch.zeros(4), load, rule="linear")


def test_global_balance_is_the_loss_over_the_whole_step():
    """global_aux: two micro-batches of 2 rows train exactly like one micro-batch of the 4 rows
    (the per-micro-batch aux does not); with one micro-batch its loss is the aux loss."""
    g, a = settings("qwen3_moe", "global_aux"), settings("qwen3_moe", "aux")
    whole = run("qwen3_moe", g, None, num_batches=1, rows=4)
    split = run("qwen3_moe", g, None, num_batches=1, rows=4, grad_accum=2)
    torch.testing.assert_close(torch.tensor(split[0]), torch.tensor(whole[0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(split[1]), torch.tensor(whole[1]), rtol=1e-5, atol=0)
    for k in whole[2]:
        assert (split[2][k] - whole[2][k]).abs().max() <= 3e-4, k
    assert split[3][0]["expert_load"] == whole[3][0]["expert_load"]      # summed over micro-batches
    assert split[3][0]["maxvio"] == whole[3][0]["maxvio"]
    micro = run("qwen3_moe", a, None, num_batches=1, rows=4, grad_accum=2)
    assert abs(micro[3][0]["load_balance_loss"] - whole[3][0]["global_balance_loss"]) > 1e-6
    aux = run("qwen3_moe", a, None, steps=1, num_batches=1, rows=4)
    assert abs(whole[3][0]["global_balance_loss"] - aux[3][0]["load_balance_loss"]) <= 1e-6


def test_usage_errors(tmp_path, capsys):
    from fmoe.cli.train import main, parse_args
    from fmoe.training import resolve

    base = ["--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "o")]
    cases = [(["--model", "llama", "--balance", "aux"], "--balance: model llama is dense"),
             (["--model", "llama", "--bias-rate", "0.1"], "--bias-rate: model llama is dense"),
             (["--model", "qwen3_moe", "--bias-rate", "0.1"], "--bias-rate 0.1: applies to --balance bias"),
             (["--model", "deepseek_v3", "--aux-weight", "0.1"], "--aux-weight 0.1: applies to --balance aux"),
             (["--model", "qwen3_moe", "--balance", "bias", "--z-weight", "1"], "--z-weight 1.0: applies to"),
             (["--model", "qwen3_moe", "--balance", "bias", "--router", "topk:k=2"], "does not read expert_bias"),
             (["--model", "qwen3_moe", "--balance", "bias", "--export-hf", str(tmp_path / "e")],
              "has no expert bias"),
             (["--model", "qwen3_moe", "--balance", "aux,global_aux"], "pick one"),
             (["--model", "qwen3_moe", "--balance", "lossfree"], "lossfree is not a method; choose from none, aux"),
             (["--model", "qwen3_moe", "--balance", "bias", "--bias-rate", "-1"], "--bias-rate must be a finite"),
             (["--model", "qwen3_moe", "--balance", "aux", "--router", "expert_choice:capacity_factor=2.0"],
              "balanced by construction"),
             (["--model", "qwen3_moe", "--balance", "seq_aux", "--router", "balanced:k=2"],
              "do not depend on the router's scores")]
    for flags, match in cases:
        with pytest.raises(SystemExit) as e:
            main(base + flags)                  # refused before anything starts
        err = capsys.readouterr().err
        assert e.value.code == 2 and match in err, (flags, err[-600:])
    # resolved: the weights that apply, None for the rest
    args = resolve(parse_args(base + ["--model", "deepseek_v3"]))
    assert (args.balance, args.aux_weight, args.bias_rate, args.bias_update) == ("bias", None, 1e-3, "sign")
    args = resolve(parse_args(base + ["--model", "deepseek_v3", "--router", "topk:k=2"]))
    assert (args.balance, args.aux_weight, args.bias_rate) == ("aux", 0.01, None)    # the bias stays frozen
    args = resolve(parse_args(base + ["--model", "llama"]))
    assert (args.balance, args.aux_weight) == ("none", None)
    args = resolve(parse_args(base + ["--model", "qwen3_moe", "--router", "expert_choice:capacity_factor=2.0"]))
    assert (args.balance, args.aux_weight) == ("none", None)        # nothing for a loss to balance
    args = resolve(parse_args(base + ["--model", "qwen3_moe", "--router", "expert_choice", "--balance", "z"]))
    assert (args.balance, args.z_weight) == ("z", 1e-3)


def test_aux_losses_use_the_routers_score_function():
    args = settings("qwen3_moe", "aux", router="sigmoid_topk:k=2")
    r = balancing.router_for(args, None, fmoe.routing.sigmoid_topk(2),
                             importlib.import_module("fmoe.models.qwen3_moe").MODEL)
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    got = r(logits).aux["load_balance_loss"].value.local()
    ids = fmoe.routing.sigmoid_topk(2)(logits).expert_ids
    want = 0.05 * fmoe.routing.aux_losses.load_balance_loss(fmoe.routing.aux_losses.normalized_sigmoid(logits), ids).local()
    torch.testing.assert_close(got, want)


def test_eval_load_statistics_against_a_hand_count():
    from fmoe.training.evaluate import evaluate
    from fmoe.models import qwen3_moe
    from train_cases import corpus

    cfg = qwen3_moe.MODEL.preset("tiny", 1)
    params = qwen3_moe.init(cfg, seed=0)
    data = corpus()
    got = evaluate(qwen3_moe, cfg, params, data, mesh=fmoe.Mesh(), batches=3, batch=2, seq=16)
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.long)
    with torch.no_grad():
        for i in range(3):
            x, _ = data.batch(i + 1, 0, 2, 16, 0, num_batches=1)
            _, aux = qwen3_moe.forward(params, x, cfg, return_aux=True)
            for l, layer in enumerate(aux["moe"]):
                counts[l] += layer["tokens_per_expert"]             # every slot has a weight > 0
    want = ((counts.amax(1) - counts.double().mean(1)) / counts.double().mean(1)).tolist()
    assert got["eval_maxvio"] == pytest.approx(want, rel=1e-12)
    assert got["eval_dead_experts"] == (counts == 0).sum(1).tolist()


CASES = [("qwen3_moe", "aux", {}, 1), ("qwen3_moe", "seq_aux,z", {}, 1), ("qwen3_moe", "global_aux", {}, 2),
         ("qwen3_moe", "bias", {"bias_rate": 1e-2}, 1),
         ("mixtral", "bias", {"bias_rate": 1e-2, "bias_update": "proportional"}, 1),
         ("gpt_oss", "bias,aux", {"bias_rate": 1e-2}, 1), ("deepseek_v3", "bias,seq_aux", {"bias_rate": 1e-2}, 1)]
MESHES = [dict(tp=1, ep=4), dict(tp=2, ep=2)]


def _ranks(rank, world):
    out = []
    for kw in MESHES:
        mesh = fmoe.Mesh(**kw)
        for name, balance, flags, ga in CASES:
            losses, norms, params, _ = run(name, settings(name, balance, **flags), mesh, grad_accum=ga, rows=2 * ga)
            out.append((kw, mesh.num_batches, name, balance, losses, norms, params))
    return out


def test_each_method_on_four_ranks_equals_one_process():
    """Losses (with the aux terms), gradient norms and parameters after 2 steps, the expert bias
    included, on two meshes (4 batches; 2 batches with tp=2) against one process on the union."""
    results = on_ranks(_ranks, 4, timeout=900)[0]
    flags = {(n, b): (f, ga) for n, b, f, ga in CASES}
    for kw, nb, name, balance, losses, norms, params in results:
        f, ga = flags[(name, balance)]
        rl, rn, rp, _ = run(name, settings(name, balance, **f), None, num_batches=nb, rows=2 * ga)
        what = f"{name} --balance {balance} on {kw}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(rl), rtol=1e-5, atol=0, msg=what)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(rn), rtol=1e-4, atol=0, msg=what)
        for k in rp:
            diff = (params[k] - rp[k]).abs()        # Adam's 1/sqrt(v): see tests/distributed/test_train.py
            assert diff.max() <= 3e-4, (what, k, diff.max().item())
            if k.endswith("expert_bias"):
                assert torch.equal(params[k], rp[k]) and rp[k].abs().max() > 0, (what, k)
