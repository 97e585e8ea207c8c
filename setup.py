"""Package discovery for setuptools: every package under ``fmoe/``, ``models/`` installed as
``fmoe.models`` (the model files live at the top of the repository, beside ``fmoe/``), and the
pytest plugin ``fmoe_pytest`` (a top-level module: loading it must not import the package).

Found from the tree at build time, so a new package cannot be left out of the wheel; the
metadata and dependencies are in ``pyproject.toml``. ``tests/unit/test_packaging.py`` compares a
built wheel's file list with the source tree.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["fmoe", "fmoe.*"])
    + ["fmoe.models"] + [f"fmoe.models.{p}" for p in find_packages("models")],
    package_dir={"fmoe.models": "models"},
    py_modules=["fmoe_pytest"],
)
