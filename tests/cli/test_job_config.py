"""``fmoe.training.JobConfig`` and ``fmoe.training.run``: the main job as a typed config and one
call, the same job as ``fmoe train`` with the same flags (in this process: no Python start)."""

import dataclasses
import re

import pytest

import fmoe.training
from fmoe.cli.train import build_parser, parse_args
from fmoe.optim import AdamWConfig
from fmoe.routing.balance import biased_topk
from fmoe.training import JobConfig, JobConfigError
from fmoe.training.job import FIELDS
from train_cases import read_log, train_cli

FLAGS = dict(model="qwen3_moe", preset="tiny", steps=3, batch=2, seq=16, warmup=1, balance="bias,z", bias_rate=1e-2,
             quiet=True)


def test_run_is_the_program_with_a_config(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    last = fmoe.training.run(JobConfig(out=a, **FLAGS))
    train_cli("--model", "qwen3_moe", "--preset", "tiny", "--steps", "3", "--batch", "2", "--seq", "16", "--warmup", "1",
              "--balance", "bias,z", "--bias-rate", "0.01", "--quiet", "--out", b)
    rows_a, rows_b = read_log(a), read_log(b)
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    assert [r["expert_bias_absmax"] for r in rows_a] == [r["expert_bias_absmax"] for r in rows_b]
    assert last["step"] == 3 and last["loss"] == rows_a[-1]["loss"]
    # a StepConfig replaces the settings' one (router included): no bias update, another clip, no z-loss
    own = fmoe.training.StepConfig(opt=AdamWConfig(max_grad_norm=0.1), bias_rate=0.0, router=biased_topk(2))
    fmoe.training.run(JobConfig(out=c, **FLAGS), step_config=own)
    rows_c = read_log(c)
    assert rows_c[0]["loss"] == rows_a[0]["loss"] and rows_c[-1]["loss"] != rows_a[-1]["loss"]
    assert all(v == 0.0 for r in rows_c for v in r["expert_bias_absmax"]) and "z_loss" not in rows_c[0]


def test_each_field_is_checked_when_the_config_is_built():
    for kwargs, match in ((dict(lr=-1.0), "--lr must be a finite number > 0, got -1.0"),
                          (dict(bias_rate=float("nan")), "--bias-rate must be a finite number >= 0, got nan"),
                          (dict(tp=0), "--tp must be an integer >= 1, got 0"),
                          (dict(batch=2.0), "--batch must be an integer >= 1, got 2.0"),
                          (dict(seed=2**64), f"--seed must be an integer in [0, {2**63 - 1}]"),
                          (dict(model="gpt5"), "--model: unknown model 'gpt5'; fmoe.models has ['qwen3_moe', 'mixtral'"),
                          (dict(eval_fraction=1.0), "--eval-fraction must be in (0, 1), got 1.0"),
                          (dict(quiet="yes"), "--quiet is a switch"),
                          (dict(out=""), "--out must be a non-empty string")):
        with pytest.raises(ValueError, match=re.escape(match)):
            JobConfig(**kwargs)
    with pytest.raises(TypeError, match="stpes"):
        JobConfig(stpes=3)
    cfg = JobConfig(lr=1)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.get("batch") == 4 and cfg.batch is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 2.0


def test_what_needs_several_fields_is_an_error_before_anything_starts(tmp_path):
    out = tmp_path / "o"
    for cfg, match in ((JobConfig(model="llama", balance="aux", out=str(out)), "--balance: model llama is dense"),
                       (JobConfig(nproc=4, tp=3, out=str(out)), "--nproc 4 must be divisible by --tp"),
                       (JobConfig(resume=str(tmp_path / "none"), out=str(out)), "does not exist")):
        with pytest.raises(JobConfigError, match=match):
            fmoe.training.run(cfg)
    with pytest.raises(TypeError, match="step_config must be a fmoe.training.StepConfig"):
        fmoe.training.run(JobConfig(out=str(out)), step_config={"bias_rate": 0})
    with pytest.raises(TypeError, match="JobConfig"):
        fmoe.training.run({"model": "llama"})
    assert not out.exists()


def test_the_flags_are_the_fields():
    ap = build_parser()
    dests = {a.dest for a in ap._actions if a.option_strings and a.dest not in ("help", "config")}   # --config FILE
    assert dests == set(FIELDS)                                                                      # holds fields
    for a in ap._actions:
        if a.option_strings and a.dest not in ("help", "config"):
            name = "--" + a.dest.replace("_", "-")             # a switch also has its --no- form
            assert a.option_strings == ([name, "--no-" + name[2:]] if FIELDS[a.dest].metadata["check"][0] == "bool"
                                        else [name])
    cfg = parse_args(["--bias-rate", "0.01", "--nproc", "2", "--ep", "2", "--overwrite", "--eval-fraction", "0.1"])
    assert cfg == JobConfig(bias_rate=0.01, nproc=2, ep=2, overwrite=True, eval_fraction=0.1)   # once refused: '0.1'
