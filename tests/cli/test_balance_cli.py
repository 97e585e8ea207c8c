"""Balancing from the command line: only a bias the router reads moves (and is exported), the
settings are recorded and kept on resume."""

import json
import os

import pytest
import torch

from fmoe.models import deepseek_v3
from train_cases import read_log, train_cli

BASE = ["--model", "deepseek_v3", "--preset", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--quiet"]


def test_bias_moves_and_is_exported_only_when_balancing_with_it(tmp_path):
    from fmoe.cli.train import parse_args
    from fmoe.training import JobConfigError, resolve

    runs = {"bias": ["--balance", "bias", "--bias-rate", "0.01"], "aux": ["--balance", "aux"]}
    exported = {}
    for name, flags in runs.items():
        out, exp = str(tmp_path / name), str(tmp_path / f"{name}-hf")
        train_cli(*BASE, *flags, "--out", out, "--export-hf", exp)
        meta = json.load(open(os.path.join(out, "step-2", "meta.json")))
        assert meta["balance"] == name and (meta["bias_rate"] == 0.01) == (name == "bias")
        assert (meta["aux_weight"] == 0.01) == (name == "aux")
        params, _ = deepseek_v3.load_hf(exp)
        exported[name] = [layer["moe"]["expert_bias"] for layer in params["layers"] if "moe" in layer]
        rows = read_log(out)
        assert all("maxvio" in r and "eval_maxvio" not in r for r in rows)
        assert rows[-1]["expert_bias_absmax"] == pytest.approx([float(b.abs().max()) for b in exported[name]])
    # the loss-free run moved its bias by two sign steps of 0.01 (each entry -0.02, 0 or 0.02); the
    # aux run's router reads the bias but nothing moves it: exported as initialised (zeros)
    for b in exported["bias"]:
        steps = b / 0.01
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 2 + 1e-4
    assert any(b.abs().max() > 0.015 for b in exported["bias"])
    assert all(torch.equal(b, torch.zeros_like(b)) for b in exported["aux"])
    # resume keeps the balancing settings
    for flags, match in ((["--balance", "aux"], "trained with --balance 'bias'"),
                         (["--bias-rate", "0.5"], "trained with --bias-rate 0.01")):
        with pytest.raises(JobConfigError, match=match):
            resolve(parse_args(BASE[:-5] + ["--steps", "3", "--resume", str(tmp_path / "bias"), "--out",
                                            str(tmp_path / "bias"), *flags]))
    args = resolve(parse_args(BASE[:-5] + ["--steps", "3", "--resume", str(tmp_path / "bias"), "--out",
                                           str(tmp_path / "bias")]))
    assert (args.balance, args.bias_rate, args.bias_update, args.aux_weight) == ("bias", 0.01, "sign", None)
