"""The fmoe pytest plugin (entry point ``pytest11: fmoe``): test bodies on warm gloo ranks.

A top-level module of the fmoe distribution, beside the ``fmoe`` package and not inside it, so
that every pytest run in an environment with fmoe installed pays only for this file: importing
``fmoe`` imports torch (seconds), and this module imports neither until a test asks for ranks
(``tests/unit/test_packaging.py`` checks ``sys.modules`` after loading it). Disable it with
``-p no:fmoe``.

Installed with fmoe, so a user's suite gets, without any import:

- ``@pytest.mark.ranks(4)`` (optionally ``timeout=`` seconds, default 120): the test body runs on
  ranks ``0..3`` of the session's warm :class:`fmoe.testing.Pool`, with the default gloo group
  set up; a test that asks for the fixtures ``rank`` and ``world`` gets this rank's values. A
  failure on any rank is the test's failure, with the rank (``[rank 2] ...``) and its remote
  traceback; a dead or hung rank fails the test within its timeout and the next test gets
  fresh ranks. Other fixtures are set up in the pytest process and sent to the ranks (they
  must be picklable).
- ``fmoe_pools``, a session fixture: ``fmoe_pools.run(fn, world, *args, timeout=...)`` runs
  ``fn(rank, world, *args)`` on the same warm ranks (one pool for the session, grown to the
  largest world asked for; smaller worlds use its first ranks).

Example (a user's test file)::

    import pytest, torch, torch.distributed as dist

    @pytest.mark.ranks(4)
    def test_all_reduce(rank, world):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        assert t.item() == sum(range(world))

The ranks import the test module by name (as pytest does), without pytest's assertion rewriting:
a failing ``assert`` on a rank shows its line, not the compared values.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest

__all__ = ["Pools"]


class Pools:
    """The session's warm ranks: one :class:`fmoe.testing.Pool` of at least ``min_size`` ranks,
    started on first use (torch and fmoe are imported then) and replaced by a bigger one when a
    test asks for more ranks than it has (smaller worlds run on its first ranks).

    Example:
        >>> Pools().pool is None            # nothing started, nothing heavy imported
        True
    """

    def __init__(self, min_size: int = 4) -> None:
        self.pool: Optional[Any] = None
        self.min_size = min_size

    def get(self, world: int) -> Any:
        """A :class:`fmoe.testing.Pool` with at least ``world`` ranks."""
        if self.pool is None or self.pool.size < world:
            from fmoe.testing.pool import Pool        # the first test that asks for ranks pays for torch

            self.close()
            self.pool = Pool(max(world, self.min_size))
        return self.pool

    def run(self, fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, **kw: Any) -> list[Any]:
        """``fn(rank, world, *args)`` on ``world`` warm ranks (:meth:`fmoe.testing.Pool.run`)."""
        return self.get(world).run(fn, *args, timeout=timeout, world=world, **kw)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


_POOLS = pytest.StashKey[Pools]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ranks(n, timeout=120): run the test body on n warm gloo ranks "
                                       "(fmoe.testing.Pool); fixtures rank and world give the rank's place")
    config.stash[_POOLS] = Pools()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _POOLS in config.stash:
        config.stash[_POOLS].close()


@pytest.fixture(scope="session")
def fmoe_pools(request: pytest.FixtureRequest) -> Pools:
    """The session's warm ranks (see :class:`Pools`)."""
    return request.config.stash[_POOLS]


@pytest.fixture
def rank() -> int:
    """This rank, in a ``@pytest.mark.ranks`` test (0 outside one)."""
    return 0


@pytest.fixture
def world() -> int:
    """The number of ranks of a ``@pytest.mark.ranks`` test (1 outside one)."""
    return 1


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Optional[bool]:
    marker = pyfuncitem.get_closest_marker("ranks")
    if marker is None:
        return None
    n = marker.args[0] if marker.args else marker.kwargs.get("n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: @pytest.mark.ranks(n) needs an int n >= 1, got {n!r}")
    timeout = marker.kwargs.get("timeout", 120.0)
    defs = pyfuncitem._fixtureinfo.name2fixturedefs
    ours = {name for name in ("rank", "world")            # our fixtures, not a parameter of that name
            if name in defs and getattr(defs[name][-1].func, "__module__", None) == __name__}
    kwargs = {a: pyfuncitem.funcargs[a] for a in pyfuncitem._fixtureinfo.argnames}
    pyfuncitem.config.stash[_POOLS].run(_body, n, pyfuncitem.obj, kwargs, ours, timeout=timeout)
    return True


def _body(rank: int, world: int, test: Callable[..., Any], kwargs: dict, ours: set) -> None:
    place = {"rank": rank, "world": world}
    test(**{k: place[k] if k in ours else v for k, v in kwargs.items()})
