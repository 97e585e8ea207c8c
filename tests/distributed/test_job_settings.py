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


def _fail(rank, world):
    import os

    from fmoe.collectives import barrier
    from fmoe.training.failure import PeerFailed, annotate

    os.environ["GROUP_RANK"] = str(rank // 2)                   # two "nodes" of two ranks
    if rank == 3:
        own = ValueError("bad batch")
        assert annotate(own, rank) is own                       # the first failure: recorded, kept
    barrier()
    if rank == 3:
        return None
    echo = annotate(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:1234"), rank)
    assert isinstance(echo, PeerFailed)
    return str(echo), echo.same_node


def test_an_echo_names_the_first_failing_rank_and_node():
    out = on_ranks(_fail, 4)
    for rank in range(3):
        msg, same_node = out[rank]
        assert msg == "stopped because rank 3 (node 1) failed first: ValueError: bad batch"
        assert same_node == (rank == 2)                         # node 1 prints rank 3's own error instead


def test_an_echo_without_a_record_says_a_peer_ended_unreported():
    from fmoe.training.failure import PeerFailed, annotate

    e = annotate(RuntimeError("Connection reset by peer"), 0, wait=0.1)
    assert isinstance(e, PeerFailed) and e.first is None and "ended without reporting" in str(e)
    own = KeyError("x")
    assert annotate(own, 0) is own


def _node_line(rank, world):
    import os

    from fmoe.collectives import barrier
    from fmoe.training.failure import NodeStopped, PeerFailed, annotate, leave_node_line, node_reason

    os.environ["GROUP_RANK"] = str(rank // 2)                   # two "nodes" of two ranks
    os.environ["LOCAL_RANK"] = str(rank % 2)
    try:
        if rank == 1:                                           # node 0's sibling: found the peer failure first
            leave_node_line(PeerFailed("stopped: a peer rank ended without reporting an error", None, False))
        if rank == 3:                                           # node 1's first failure: that rank printed it
            assert annotate(ValueError("bad batch"), rank) is not None
            leave_node_line(PeerFailed("stopped because rank 3 (node 1) failed first: X", "r", True))
        barrier()
        if rank == 1:
            leave_node_line(PeerFailed("a later echo", None, False))  # first writer wins
        barrier()
        stop = KeyboardInterrupt()                              # the signal torchrun sends the printing rank
        reason = node_reason(stop)
        got = (type(reason).__name__, str(reason), getattr(reason, "same_node", None)) if reason is not None else None
        assert node_reason(ValueError("own")) is None           # an error of its own is not replaced
        assert not isinstance(reason, NodeStopped) or rank % 2 == 0
        return got
    finally:
        del os.environ["LOCAL_RANK"]


def test_a_printing_rank_stopped_by_torchrun_ends_with_its_siblings_error_line():
    out = on_ranks(_node_line, 4)
    assert out[0] == ("NodeStopped", "PeerFailed: stopped: a peer rank ended without reporting an error", None)
    assert out[1] is None and out[3] is None                    # not printing ranks
    assert out[2] == ("PeerFailed", "stopped because rank 3 (node 1) failed first", True)   # rank 3 printed it
