"""``--dp-batches N``: one process reads exactly the batches of an N-rank run and trains as it does
(each rank's batch its own micro-batches), so it is that run's one-process reference."""

import pytest

import fmoe.training
from fmoe.training import JobConfig
from train_cases import read_log

FLAGS = dict(model="qwen3_moe", preset="tiny", steps=5, batch=2, seq=16, warmup=1, quiet=True, balance="none",
             router="topk:k=2", eval_every=1, eval_batches=2)


def test_one_process_reads_the_batches_of_two_ranks(tmp_path):
    ranks = read_log(_run(tmp_path / "two", nproc=2))
    one = read_log(_run(tmp_path / "one", nproc=1, dp_batches=2))
    plain = read_log(_run(tmp_path / "plain", nproc=1, grad_accum=2))          # other data: not a reference
    assert one[0]["tokens"] == ranks[0]["tokens"] == plain[0]["tokens"]
    assert one[0]["loss"] == pytest.approx(ranks[0]["loss"], rel=1e-6, abs=0)   # step 1: same batches, same weights
    assert abs(plain[0]["loss"] - ranks[0]["loss"]) > 1e-3
    assert one[0]["expert_load"] == ranks[0]["expert_load"]                     # every routing decision agrees
    assert one[0]["eval_loss"] == pytest.approx(ranks[0]["eval_loss"], rel=1e-6)  # the same held-out pieces
    assert one[0]["eval_maxvio"] == ranks[0]["eval_maxvio"]
    for a, b in zip(one, ranks):                                                # 5 steps within fp32 tolerance
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)


def test_dp_batches_runs_in_one_process_only(tmp_path):
    with pytest.raises(ValueError, match="--dp-batches 2: one process reads the batches of 2 ranks"):
        fmoe.training.run(JobConfig(out=str(tmp_path / "x"), nproc=2, dp_batches=2, **FLAGS))


def _run(out, **flags):
    fmoe.training.run(JobConfig(out=str(out), **FLAGS, **flags))
    return out
