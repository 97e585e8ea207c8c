"""Every rank of a job agrees on one settings digest before the first step
(fmoe.training.settings): equal settings pass with one digest on every rank; any difference is a
SettingsMismatch on every rank naming the settings and the ranks of each value."""

from __future__ import annotations

import pytest
from helpers import on_ranks

from fmoe.training.settings import SettingsMismatch, check_same, differences, digest, rank_ranges


def _settings(rank: int) -> dict:
    return {"model": "qwen3_moe", "lr": 0.003 if rank < 2 else 0.03, "steps": 10, "threads": rank + 1}


def _check(rank, world, same):
    s = _settings(0 if same else rank)
    s["threads"] = rank + 1                 # a local setting: may differ between nodes
    try:
        return ("ok", check_same(s))
    except SettingsMismatch as e:
        return ("mismatch", str(e))


def test_equal_settings_give_one_digest_on_every_rank():
    out = on_ranks(_check, 4, True)
    assert {kind for kind, _ in out} == {"ok"}
    assert len({d for _, d in out}) == 1
    assert out[0][1] == digest({k: v for k, v in _settings(0).items() if k != "threads"})


def test_different_lr_is_refused_on_every_rank_naming_lr_and_ranks():
    out = on_ranks(_check, 4, False)
    assert [kind for kind, _ in out] == ["mismatch"] * 4
    assert len({msg for _, msg in out}) == 1
    msg = out[0][1]
    assert "lr: rank 0-1 0.003, rank 2-3 0.03" in msg
    assert "threads" not in msg and "steps" not in msg


def test_differences_and_ranges():
    assert differences([{"a": 1, "b": 2}, {"a": 1, "b": 2}]) == []
    assert differences([{"a": 1}, {"a": 2}, {"a": 1}]) == ["a: rank 0,2 1, rank 1 2"]
    assert differences([{"a": 1}, {}]) == ["a: rank 0 1, rank 1 <unset>"]
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert digest({"x": 1, "y": 2}) == digest({"y": 2, "x": 1}) != digest({"x": 1, "y": 3})


def test_one_process_returns_the_digest():
    assert check_same({"lr": 0.1, "quiet": True}) == digest({"lr": 0.1})


@pytest.mark.parametrize("bad", [{"steps": 12}, {"out": "elsewhere"}])
def test_any_job_setting_counts(bad):
    def fn(rank, world):
        s = {"steps": 10, "out": "runs/a"}
        if rank == 1:
            s.update(bad)
        with pytest.raises(SettingsMismatch, match=next(iter(bad))):
            check_same(s)
        return True

    assert on_ranks(fn, 2) == [True, True]
