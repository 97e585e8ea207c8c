"""Sparse upcycling: a mixtral model made from a dense llama equals it at initialisation."""

import torch

from fmoe.models import llama, mixtral
from fmoe.training.upcycle import parse_upcycle, upcycle
from train_cases import read_log, train_cli


def test_upcycled_model_equals_the_dense_model_at_init():
    cfg = llama.Config.tiny()
    dense = llama.init(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    want = llama.forward(dense, tokens, cfg)
    for E, K in ((4, 2), (8, 1), (3, 3)):
        params, mcfg = upcycle(dense, cfg, mixtral.Config, E, K, seed=1)
        assert (mcfg.num_local_experts, mcfg.num_experts_per_tok, mcfg.intermediate_size) == (E, K, cfg.intermediate_size)
        got = mixtral.forward(params, tokens, mcfg)
        # top-k of identical experts, weights summing to 1: the dense MLP up to fp32 rounding
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(p["moe"]["w_down"][e], d["mlp"]["w_down"])
                   for p, d in zip(params["layers"], dense["layers"]) for e in range(E))


def test_parse_upcycle_refuses_bad_values():
    import pytest

    assert parse_upcycle("8,2") == (8, 2)
    for bad in ("8", "2,8", "a,b", "0,0"):
        with pytest.raises(ValueError, match="--upcycle"):
            parse_upcycle(bad)


def test_upcycle_from_the_command_line_starts_at_the_dense_loss(tmp_path):
    from fmoe.data import open_data

    cfg = llama.Config.tiny()
    cfg = type(cfg)(**{**cfg.__dict__, "vocab_size": 256})
    dense = llama.init(cfg, seed=0)
    llama.save_hf(dense, cfg, str(tmp_path / "dense"))
    out = str(tmp_path / "run")
    train_cli("--model", "mixtral", "--init-hf", str(tmp_path / "dense"), "--upcycle", "4,2", "--tokenizer", "bytes",
              "--steps", "1", "--batch", "2", "--seq", "16", "--quiet", "--out", out)
    x, y = open_data(None).split(0.05)[0].batch(1, 0, 2, 16, seed=0, num_batches=1)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(llama.forward(dense, x, cfg).flatten(0, 1), y.flatten()).item()
    assert abs(read_log(out)[0]["loss"] - want) <= 1e-5 * want
    bad = train_cli("--model", "qwen3_moe", "--upcycle", "4,2", "--out", str(tmp_path / "x"), check=False)
    assert bad.returncode == 2 and "upcycles a dense llama checkpoint into mixtral" in bad.stderr
