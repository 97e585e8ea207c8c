import os
import time

import pytest
import torch
import torch.distributed as dist

from fmoe.testing import spawn


def _sum(rank, world, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item() * scale


def _raise_while_others_block(rank, world):
    if rank == 2:
        raise ValueError("bad shard on this rank")
    dist.barrier()                       # the others wait here for rank 2 forever
    time.sleep(60)


def _die(rank, world):
    if rank == 1:
        os._exit(3)
    dist.barrier()
    time.sleep(60)


def _sleep(rank, world):
    time.sleep(60)


def test_returns_results_in_rank_order():
    assert spawn(_sum, 3, 2.0) == [6.0, 6.0, 6.0]


def test_closure_functions_travel():                 # as defined in a notebook cell
    offset = 5
    assert spawn(lambda rank, world: rank + offset, 2) == [5, 6]


def test_rank_exception_is_reraised_with_rank_even_when_others_block():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"\[rank 2\] bad shard on this rank") as info:
        spawn(_raise_while_others_block, 3, timeout=60)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 2 and "bad shard" in str(info.value.__cause__)
    assert "_raise_while_others_block" in str(info.value.__cause__)     # remote traceback


def test_dead_rank_ends_run():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 died with exit code 3"):
        spawn(_die, 2, timeout=60)
    assert time.monotonic() - t0 < 30


def test_timeout_kills_all_ranks():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after 5"):
        spawn(_sleep, 2, timeout=5)
    assert time.monotonic() - t0 < 20


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        spawn(_sum, 0)
    with pytest.raises(TypeError, match="fn must be callable"):
        spawn("nope", 2)


def _speak(rank, world):
    import sys
    print(f"out of rank {rank} {os.environ.get('FMOE_TEST_MARK')}")
    print(f"err of rank {rank}", file=sys.stderr)
    return os.environ.get("FMOE_TEST_MARK")


@pytest.mark.parametrize("launch", [1, 2])
def test_ranks_write_to_the_callers_stdio_and_see_its_environment_at_each_launch(launch, capfd, monkeypatch):
    """Ranks are forked from a fork server started by an earlier launch (fmoe.launch.context):
    they still print to the caller's stdout / stderr of *this* launch (pytest's capture of this
    test), and see the environment as it is now."""
    monkeypatch.setenv("FMOE_TEST_MARK", f"launch-{launch}")
    assert spawn(_speak, 2) == [f"launch-{launch}"] * 2
    out, err = capfd.readouterr()
    assert f"out of rank 0 launch-{launch}" in out and f"out of rank 1 launch-{launch}" in out, out
    assert "err of rank 0" in err and "err of rank 1" in err, err
