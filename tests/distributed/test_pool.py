"""fmoe.testing.Pool: warm ranks with spawn's guarantees, each call on a clean slate."""

import gc
import ipaddress
import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist

import fmoe
from fmoe.testing import Pool


@pytest.fixture(scope="module")
def pool():
    with Pool(4) as p:
        yield p


def _sum(rank, world, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item() * scale


def test_results_in_rank_order_on_the_whole_pool_and_on_fewer_ranks(pool):
    assert pool.run(_sum, 2.0) == [12.0] * 4
    assert pool.run(_sum, 1.0, world=3) == [3.0] * 3
    assert pool.run(lambda rank, world: (rank, world, dist.get_world_size()), world=2) == [(0, 2, 2), (1, 2, 2)]


def _state(rank, world):
    return {"rand": torch.rand(3).tolist(), "py": random.random(), "dtype": str(torch.get_default_dtype()),
            "env": os.environ.get("FMOE_POOL_TEST"), "cwd": os.getcwd(), "grad": torch.is_grad_enabled(),
            "impls": fmoe.ep.registered(), "groups": len(dist.distributed_c10d._world.pg_map),
            "det": torch.are_deterministic_algorithms_enabled()}


def _dirty(rank, world, where):
    torch.manual_seed(123)
    random.seed(5)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    os.environ["FMOE_POOL_TEST"] = "leaked"
    os.chdir(where)
    fmoe.ep.register("leaked_impl", fmoe.ep.get("local"))
    fmoe.Mesh(tp=2, ep=2)                                 # sub-groups of this call's default group
    return _state(rank, world)


def test_state_set_by_one_call_is_not_seen_by_the_next(pool, tmp_path):
    before = pool.run(_state)
    dirty = pool.run(_dirty, str(tmp_path))
    assert dirty[0]["dtype"] == "torch.float64" and dirty[0]["env"] == "leaked"       # the call changed it
    assert "leaked_impl" in dirty[0]["impls"] and dirty[0]["groups"] > before[0]["groups"]
    after = pool.run(_state)
    assert after == before                                 # generators too: each rank's start state


def _say(rank, world, word):
    import sys
    print(f"{word} from rank {rank}")
    print(f"{word} on stderr from rank {rank}", file=sys.stderr)
    os.write(1, f"{word} at fd level from rank {rank}\n".encode())     # C code writes to fd 1 itself
    return rank


def test_each_call_prints_into_the_output_of_its_caller_now(pool, capfd):
    """The pool started in an earlier test (its capture then is closed): a call's prints still
    reach the caller's stdout / stderr of the call (this test's capture), and only that call's."""
    pool.run(_say, "first", world=2)
    out, err = capfd.readouterr()
    for r in (0, 1):
        assert f"first from rank {r}" in out and f"first at fd level from rank {r}" in out, out
        assert f"first on stderr from rank {r}" in err, err
    pool.run(_say, "second")
    out, err = capfd.readouterr()
    assert "first" not in out + err and all(f"second from rank {r}" in out for r in range(4)), out


def _moe_parity(rank, world):
    from moe_cases import check_case

    return check_case(fmoe.Mesh(tp=2, ep=2), "all_to_all", "top2", [5, 3])


def test_dtensor_caches_do_not_carry_one_calls_meshes_into_the_next(pool):
    """DTensor caches sharding decisions and redistribute plans by (equal) DeviceMesh; the pool
    clears them after each call. Without that, test_moe + test_moe_parity + test_routing_parity in
    one session failed ("Could not resolve the process group registered under the name 133");
    this short loop alone passes without it too, so it guards the calls, not the cause."""
    for _ in range(3):
        assert pool.run(_moe_parity) == [[]] * 4


def _train_step_on_a_mesh(rank, world):
    from balance_cases import run, settings

    run("qwen3_moe", settings("qwen3_moe", "aux"), fmoe.Mesh(tp=2, ep=2), steps=1)


def _gloo_workers(rank, world):
    from fmoe.testing.rank_state import gloo_workers

    dist.barrier()
    return gloo_workers()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in Linux's /proc")
@pytest.mark.filterwarnings("error:Pool.run")         # a replaced pool would hide the leak
def test_no_gloo_group_outlives_a_call(pool):
    """A train step on a mesh fills DTensor's redistribute memo (``_gen_transform_infos``) with
    specs whose DeviceMesh holds the mesh's groups; the pool clears it. Before, each such call
    left 6 groups (12 gloo threads) per rank, and a whole suite on one pool piled up hundreds."""
    base = pool.run(_gloo_workers)          # the call's own default group: 2 threads per rank
    pool.run(_train_step_on_a_mesh)
    assert pool.run(_gloo_workers) == base


_KEPT: list = []


def _keep_a_group(rank, world):
    _KEPT.append(dist.new_group([0, 1]))     # module state of the rank: outlives the call


def test_a_call_that_keeps_a_group_alive_gets_fresh_ranks():
    with Pool(2) as p:
        old = p.pids
        with pytest.warns(RuntimeWarning, match=r"_keep_a_group.*rank 0: 1 gloo group\(s\) outlived the call"):
            p.run(_keep_a_group)
        assert all(_gone(pid) for pid in old)
        assert p.run(_gloo_workers) == [2, 2]                 # fresh ranks: the call's group only


def _raise_while_others_block(rank, world):
    if rank == 2:
        raise ValueError("bad shard on this rank")
    dist.barrier()                       # the others wait here for rank 2 forever
    time.sleep(60)


def test_a_failing_rank_is_reraised_with_its_traceback_and_the_pool_goes_on(pool):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"\[rank 2\] bad shard on this rank") as info:
        pool.run(_raise_while_others_block, timeout=60)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 2 and "_raise_while_others_block" in str(info.value.__cause__)
    assert pool.run(_sum, 1.0) == [6.0] * 4


def _killed(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    time.sleep(60)


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_rank_killed_mid_call_ends_the_call_and_the_pool_is_rebuilt():
    with Pool(2) as p:
        old, starts = p.pids, p.starts
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 died with exit code -9"):
            p.run(_killed, timeout=60)
        assert time.monotonic() - t0 < 30
        assert all(_gone(pid) for pid in old)                 # the survivors were stopped too
        assert p.run(_sum, 1.0) == [1.0, 1.0] and p.starts == starts + 1


def test_a_hang_times_out_and_the_next_call_gets_fresh_ranks():
    with Pool(2) as p:
        old = p.pids
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after 3"):
            p.run(lambda rank, world: time.sleep(60), timeout=3)
        assert time.monotonic() - t0 < 20
        assert all(_gone(pid) for pid in old)
        assert p.run(_sum, 3.0) == [3.0, 3.0]


def _sockets(rank, world):
    """(state, local ip, remote ip) of this process's TCP sockets, after gloo has connected."""
    from helpers import tcp_sockets
    dist.barrier()
    return tcp_sockets()


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_nothing_listens_or_connects_beyond_loopback(pool):
    per_rank = pool.run(_sockets)
    assert all(per_rank), "gloo's connections were not seen"
    for socks in per_rank:
        for state, local, remote in socks:
            assert ipaddress.ip_address(local).is_loopback, (state, local, remote)
            if state != "0A":                                 # 0A = LISTEN: remote is the wildcard
                assert ipaddress.ip_address(remote).is_loopback, (state, local, remote)


def test_no_process_outlives_the_pool():
    with Pool(2) as p:
        pids = p.pids
        assert p.run(_sum, 1.0) == [1.0, 1.0] and not any(_gone(pid) for pid in pids)
    assert all(_gone(pid) for pid in pids) and p.pids == []
    p2 = Pool(2)                                             # dropped without close: collected
    pids = p2.pids
    del p2
    gc.collect()
    assert all(_gone(pid) for pid in pids)


def test_bad_arguments(pool):
    with pytest.raises(ValueError, match="Pool: world_size must be an int >= 1, got 0"):
        Pool(0)
    with pytest.raises(ValueError, match="world must be <= the pool's 4 ranks, got 5"):
        pool.run(_sum, 1.0, world=5)
    with pytest.raises(TypeError, match="fn must be callable"):
        pool.run("nope")
    closed = Pool(1)
    closed.close()
    with pytest.raises(RuntimeError, match="the pool is closed"):
        closed.run(_sum, 1.0)
