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


def commented_examples(text: str) -> list[int]:
    """Lines of ``text`` that are a ``>>> #`` example: a call written as a comment runs nothing."""
    return [i for i, line in enumerate(text.splitlines(), 1) if line.strip().startswith(">>> #")]


def test_no_example_is_a_comment():
    """Every example runs (above); none is a ``>>> #`` comment that only looks like one."""
    import pathlib

    roots = [pathlib.Path(fmoe.__file__).parent, pathlib.Path(fmoe.models.__file__).parent]
    found = [f"{p.name}:{i}" for root in roots for p in sorted(root.rglob("*.py")) for i in commented_examples(p.read_text())]
    assert found == []
    assert commented_examples('"""\nExample:\n    >>> # y = f(x)\n    >>> f(1)\n    2\n"""') == [3]
