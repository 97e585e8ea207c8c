"""Watching a run (fmoe.training.observe, docs/operating-runs.md): every log row carries each rank's
step time and the bytes its collectives sent; --profile-steps A:B writes a torch.profiler trace
per rank; --tensorboard writes the rows as TensorBoard scalars, or says which extra is missing."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

import fmoe.training
from fmoe.training import JobConfig

FLAGS = dict(model="qwen3_moe", preset="tiny", batch=2, seq=16, quiet=True)


def _rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]


def test_rows_carry_per_rank_step_time_and_bytes_and_the_profile_window_is_traced(tmp_path):
    out = str(tmp_path / "run")
    last = fmoe.training.run(JobConfig(out=out, nproc=2, ep=2, steps=3, profile_steps="2:3", **FLAGS))
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and last["rank_step_time"] == rows[-1]["rank_step_time"]
    for r in rows:
        assert len(r["rank_step_time"]) == 2 and all(0 < t < 600 for t in r["rank_step_time"])
        kinds = r["sent_bytes_by_kind"]
        assert "all_to_all" in kinds and "all_gather" in kinds and "reduce_scatter" in kinds
        assert r["sent_bytes"] == [sum(v[k] for v in kinds.values()) for k in range(2)]
        assert all(b > 0 for b in r["sent_bytes"])
        # the FSDP gathers are the same every step: one rank's weights, sent to the other
        assert kinds["all_gather"][0] == kinds["all_gather"][1] == rows[0]["sent_bytes_by_kind"]["all_gather"][0]
    for rank in range(2):
        trace = json.load(open(os.path.join(out, "profile", f"rank-{rank}.json")))
        assert trace["traceEvents"]


def test_one_process_sends_nothing(tmp_path):
    out = str(tmp_path / "run")
    fmoe.training.run(JobConfig(out=out, steps=1, **FLAGS))
    row = _rows(out)[0]
    assert row["sent_bytes"] == [0] and row["sent_bytes_by_kind"] == {} and row["rank_step_time"][0] > 0


def test_profile_steps_is_checked_when_the_config_is_built():
    for bad in ("3:2", "0:1", "x", "1:2:3"):
        with pytest.raises(ValueError, match=f"--profile-steps must be A:B.*got '{bad}'"):
            JobConfig(profile_steps=bad)


def test_tensorboard_without_the_extra_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"--tensorboard needs the tensorboard package.*pip install 'fmoe\[tensorboard\]'"):
        JobConfig(tensorboard=True)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="the tensorboard extra is not installed")
def test_tensorboard_scalars_are_the_log_rows(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path / "run")
    fmoe.training.run(JobConfig(out=out, steps=2, tensorboard=True, **FLAGS))
    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"])) for r in _rows(out)]
    assert "rank_step_time/rank-0" in events.Tags()["scalars"]
