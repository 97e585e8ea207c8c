"""Shared test settings: small thread counts keep many gloo ranks workable on 2 cores, under
pytest-xdist workers too (the README's test command runs two).

The fmoe pytest plugin (``fmoe_pytest``: ``@pytest.mark.ranks``, the ``fmoe_pools``
fixture) is loaded through its ``pytest11`` entry point once fmoe is installed; a checkout whose
installed metadata predates the entry point loads it here."""

import os
from importlib.metadata import entry_points

import pytest
import torch

import helpers
from data_cases import train_tokenizer, write_corpus

os.environ.setdefault("OMP_NUM_THREADS", "1")
# pytest-xdist workers share the cores: each takes its share (two workers, two threads each,
# would oversubscribe 2 cores and OpenMP's spinning threads would steal from each other)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

_INSTALLED = any(ep.value.split()[0] == "fmoe_pytest" for ep in entry_points(group="pytest11"))
pytest_plugins = ["pytester"] + ([] if _INSTALLED else ["fmoe_pytest"])


@pytest.fixture(scope="session", autouse=True)
def _warm_ranks(fmoe_pools):
    """``helpers.on_ranks`` runs on the plugin's session pool (started on first use)."""
    helpers.use_pools(fmoe_pools)
    yield
    helpers.use_pools(None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny text corpus and a BPE tokenizer trained on it: ``(root, corpus dir, tokenizer dir)``."""
    root = str(tmp_path_factory.mktemp("data"))
    d = write_corpus(root)
    return root, d, train_tokenizer(root, d)


#: The files whose tests compile with Inductor or run notebooks: 60% of the suite's CPU time, in
#: tests of up to ~3 min each (benchmarks/RESULTS.md). They are collected first, so that under
#: ``-n 2`` the long tests start early and the workers end on short ones, together.
_LONG_FIRST = ("test_transform_matrix.py", "test_compile.py", "test_transforms.py", "test_notebooks.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}

    def key(item):                           # stable sort: other files keep their order, whole
        file = rank.get(item.path.name, len(_LONG_FIRST))
        heavy = file < len(_LONG_FIRST) and ("compile" in item.name or "mesh_cells" in item.name)
        return (not heavy, file)
    items.sort(key=key)
