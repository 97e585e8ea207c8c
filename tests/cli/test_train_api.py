"""``fmoe.train.run(**settings)``: the CLI's job as a library call, same settings, same result."""

import pytest

import fmoe.train
from fmoe.routing.balance import biased_topk
from fmoe.optim import AdamWConfig
from train_cases import read_log, train_cli

FLAGS = dict(model="qwen3_moe", preset="tiny", steps=3, batch=2, seq=16, warmup=1, balance="bias,z", bias_rate=1e-2,
             quiet=True)


def test_run_is_the_cli_with_keywords(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    last = fmoe.train.run(out=a, **FLAGS)
    train_cli("--model", "qwen3_moe", "--preset", "tiny", "--steps", "3", "--batch", "2", "--seq", "16", "--warmup", "1",
              "--balance", "bias,z", "--bias-rate", "0.01", "--quiet", "--out", b)
    rows_a, rows_b = read_log(a), read_log(b)
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    assert [r["expert_bias_absmax"] for r in rows_a] == [r["expert_bias_absmax"] for r in rows_b]
    assert last["step"] == 3 and last["loss"] == rows_a[-1]["loss"]
    # a StepConfig replaces the flags' one (router included): no bias update, another clip, no z-loss
    own = fmoe.training.StepConfig(opt=AdamWConfig(max_grad_norm=0.1), bias_rate=0.0, router=biased_topk(2))
    fmoe.train.run(out=c, step_config=own, **FLAGS)
    rows_c = read_log(c)
    assert rows_c[0]["loss"] == rows_a[0]["loss"] and rows_c[-1]["loss"] != rows_a[-1]["loss"]
    assert all(v == 0.0 for r in rows_c for v in r["expert_bias_absmax"]) and "z_loss" not in rows_c[0]


def test_bad_settings_are_errors_before_anything_starts(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ValueError, match="--balance: model llama is dense"):
        fmoe.train.run(model="llama", balance="aux", out=str(out))
    with pytest.raises(TypeError, match="unknown setting 'stpes'"):
        fmoe.train.run(stpes=3, out=str(out))
    with pytest.raises(TypeError, match="quiet is a switch"):
        fmoe.train.run(quiet="yes", out=str(out))
    with pytest.raises(TypeError, match="step_config must be a fmoe.training.StepConfig"):
        fmoe.train.run(step_config={"bias_rate": 0}, out=str(out))
    assert not out.exists()
