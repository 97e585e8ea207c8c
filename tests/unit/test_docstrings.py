"""Every ``Example:`` in a docstring of the package runs and prints what it says (doctest).

The examples are the documentation a user copies first; this keeps them true as code moves."""

import doctest
import importlib
import pkgutil

import pytest
import torch

import fmoe
import fmoe.models

MODULES = sorted({"fmoe", *(m.name for pkg in (fmoe, fmoe.models)
                            for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
                  })
MODULES = [n for n in MODULES if not n.endswith("__main__")]


def test_the_walk_sees_the_package():
    assert {"fmoe.experts", "fmoe.ep.contract", "fmoe.fsdp.gather", "fmoe.models.qwen3_moe"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"torch": torch}, report=False,
                             optionflags=doctest.ELLIPSIS | doctest.IGNORE_EXCEPTION_DETAIL)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (python -m doctest -v)"
