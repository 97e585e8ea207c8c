"""What a warm pool rank restores after each call: the process state a call may change and the
next call must not see (environment, working directory, ``sys.path``, warning filters, torch's
defaults and random generators, ``fmoe.ep`` registrations, Dynamo and DTensor caches,
``torch.distributed``'s memos), and the count of gloo worker threads that tells a call whose
groups outlived it (:mod:`fmoe.testing.pool` retires such ranks).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

__all__ = ["RankState", "gloo_workers"]


class RankState:
    """The process state a call may change and the next call must not see."""

    @classmethod
    def capture(cls) -> "RankState":
        import random

        import torch

        import fmoe.ep

        s = cls()
        s.environ, s.cwd, s.path = dict(os.environ), os.getcwd(), list(sys.path)
        s.filters = list(warnings.filters)
        s.dtype, s.grad = torch.get_default_dtype(), torch.is_grad_enabled()
        s.deterministic = torch.are_deterministic_algorithms_enabled()
        s.torch_rng, s.py_rng = torch.get_rng_state(), random.getstate()
        np = sys.modules.get("numpy")
        s.np_rng = np.random.get_state() if np is not None else None
        s.impls = {n: fmoe.ep.declared(n) for n in fmoe.ep.registered()}   # with declared properties
        s.memos = (0, [])
        return s

    def restore(self) -> None:
        import random

        import torch

        import fmoe.ep

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = [p for p in sys.path if p not in self.path] + self.path
        warnings.filters[:] = self.filters
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            sys.modules["numpy"].random.set_state(self.np_rng)
        for name in set(fmoe.ep.registered()) - set(self.impls):
            del fmoe.ep._REGISTRY[name]     # the registry has no public unregister
        for name, d in sorted(self.impls.items(), key=lambda kv: kv[1].one_rank is not None):
            fmoe.ep.register(name, d.impl, shared_batch=d.shared_batch, one_rank=d.one_rank)
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()
        if "torch.distributed.tensor" in sys.modules:
            # DTensor caches its sharding decisions and redistribute plans by DeviceMesh, and an
            # equal mesh of the next call would find the plan that holds this call's (destroyed)
            # groups: "Could not resolve the process group registered under the name ..."
            from torch.distributed.tensor import _redistribute, debug

            debug._clear_sharding_prop_cache()
            _redistribute.clear_redistribute_planner_cache()
        # Every other memo of torch.distributed (``_gen_transform_infos``, ``MeshTopoInfo``, ...)
        # keys on DTensorSpecs, whose DeviceMesh holds its process groups: a kept mesh keeps its
        # gloo groups' threads alive, and hundreds of them slow every later call.
        self.memos = _distributed_memos(self.memos)
        for memo in self.memos[1]:
            memo.cache_clear()


def _distributed_memos(known: tuple[int, list]) -> tuple[int, list]:
    """``(number of torch.distributed modules, their functools caches)``: the caches of the
    imported ``torch.distributed`` modules (functions and the static methods of their classes),
    searched again only when more modules have been imported than ``known`` counted."""
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("torch.distributed") and m is not None]
    if len(mods) != known[0]:
        found = []
        for m in mods:
            for v in list(vars(m).values()):     # type(), not isinstance: no deprecated __class__
                ours = issubclass(type(v), type) and vars(v).get("__module__") == m.__name__
                for f in [v, *(vars(v).values() if ours else ())]:
                    f = f.__func__ if type(f) in (staticmethod, classmethod) else f
                    if type(f) is functools._lru_cache_wrapper:
                        found.append(f)
        known = (len(mods), found)
    return known


def gloo_workers() -> int:
    """This process's live gloo worker threads (``pt_gloo_runloop``, two per live gloo group;
    Linux ``/proc``, 0 elsewhere). Between calls there are none unless a group outlived its call."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return 0
    n = 0
    for t in os.listdir(tasks):
        try:
            with open(f"{tasks}/{t}/comm") as f:
                n += f.read().strip() == "pt_gloo_runloop"
        except OSError:
            pass
    return n
