"""The pytest plugin: ``@pytest.mark.ranks(n)`` runs a test body on n warm ranks; a rank's
failure is the test's failure, naming the rank."""

import pytest
import torch.distributed as dist


@pytest.mark.ranks(3)
def test_the_body_runs_on_every_rank(rank, world, tmp_path):
    assert world == 3 and dist.get_world_size() == 3 and dist.get_rank() == rank
    (tmp_path / f"rank{rank}").write_text("ran")             # fixtures come from the pytest process
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1", "rank2"]


@pytest.mark.parametrize("world", [5])                      # a parameter named like the fixture wins
def test_a_parameter_named_world_is_left_alone(world):
    assert world == 5


def test_fmoe_pools_runs_functions_on_the_same_ranks(fmoe_pools):
    assert fmoe_pools.run(lambda rank, world: rank, 2) == [0, 1]


USER_TESTS = '''
import pytest, torch, torch.distributed as dist

@pytest.mark.ranks(2)
def test_sum(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == 1.0

@pytest.mark.ranks(2, timeout=60)
def test_fails_on_rank_one(rank):
    if rank == 1:
        raise ValueError("rank one disagrees")
    dist.barrier()
'''


def test_a_users_suite_gets_the_marker_and_per_rank_failures(pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    plugin = [] if pytester._request.config.pluginmanager.has_plugin("fmoe") else ["-p", "fmoe_pytest"]
    result = pytester.runpytest_subprocess(*plugin, "-p", "no:cacheprovider", timeout=600)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*ValueError: [[]rank 1[]] rank one disagrees*"])
