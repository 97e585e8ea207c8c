"""Package metadata: one version (``fmoe.__version__``, read by setuptools), a typed package, a
license, and a lint configuration that ``.ci/run`` applies."""

import os

import pytest

import fmoe

tomllib = pytest.importorskip("tomllib")   # Python >= 3.11 reads pyproject.toml without a dependency

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_version_is_written_once():
    meta = _pyproject()
    assert "version" not in meta["project"] and meta["project"]["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fmoe.__version__"}
    assert isinstance(fmoe.__version__, str) and fmoe.__version__.count(".") == 2


def test_typed_licensed_and_linted():
    meta = _pyproject()
    assert os.path.isfile(os.path.join(ROOT, "fmoe", "py.typed"))
    assert meta["tool"]["setuptools"]["package-data"]["fmoe"] == ["py.typed"]
    assert meta["project"]["license"] == "MIT" and meta["project"]["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert f.readline().strip() == "MIT License"
    assert "RUF100" in meta["tool"]["ruff"]["lint"]["select"]             # every noqa names a rule that fires
    assert any(d.startswith("ruff") for d in meta["project"]["optional-dependencies"]["dev"])
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "ruff check ." in f.read()
