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


def _source_files() -> set:
    """What a wheel must hold: every module and package-data file under ``fmoe/``, and ``models/``
    as ``fmoe/models/`` (git's view of the tree: tracked and untracked-but-not-ignored files)."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    want = set()
    for rel in files:
        if not os.path.isfile(os.path.join(ROOT, rel)):
            continue                                  # deleted in the working tree, not yet in git
        if rel.startswith("fmoe/") and (rel.endswith(".py") or rel.endswith("py.typed")):
            want.add(rel)
        elif rel.startswith("models/") and rel.endswith(".py"):
            want.add("fmoe/" + rel)
    return want


def test_the_wheel_holds_exactly_the_source_tree(tmp_path):
    """A wheel built from the tree holds every module of it (package discovery cannot drift) and
    nothing else of the package (no stale file from an earlier build)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    want = _source_files()
    src = tmp_path / "src"
    for rel in {f for f in subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                                          capture_output=True, text=True, check=True).stdout.split()
                if os.path.isfile(os.path.join(ROOT, f))}:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), src / rel)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("fmoe-*.whl")
    held = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("fmoe/") or n == "fmoe_pytest.py"}
    want.add("fmoe_pytest.py")                        # the pytest plugin, a top-level module
    assert held == want, (f"in the tree, not in the wheel: {sorted(want - held)}; "
                          f"in the wheel, not in the tree: {sorted(held - want)}")
    assert {"fmoe/__init__.py", "fmoe/models/__init__.py", "fmoe/optim/__init__.py",
            "fmoe/training/__init__.py"} <= held


def test_import_fmoe_does_not_import_the_test_harness():
    """``import fmoe`` loads no test harness (pool, spawn, launcher): ``fmoe.testing`` is imported
    on first use. The pytest plugin (entry point ``fmoe_pytest``, a top-level module) imports
    neither torch nor fmoe when it loads, nor when an unrelated test runs: an unrelated pytest run
    in an environment with fmoe installed pays for one small module."""
    import subprocess
    import sys

    code = ("import sys, fmoe; before = sorted(m for m in sys.modules if m.startswith(('fmoe.testing', 'fmoe.launch')));"
            " fmoe.testing.spawn; print(before, 'fmoe.testing' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["[]", "True"], out.stdout + out.stderr
    plugins = _pyproject()["project"]["entry-points"]["pytest11"]
    assert plugins == {"fmoe": "fmoe_pytest"}
    code = ("import sys, fmoe_pytest, pytest; fmoe_pytest.Pools();"
            " print(sorted(m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('torch', 'fmoe', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["[]"], out.stdout + out.stderr



def test_one_console_script_runs_the_commands():
    """``fmoe`` is the one console script, the same program as ``python -m fmoe`` (``fmoe.cli.main``;
    tests/cli/test_commands.py starts both)."""
    from fmoe.cli import main

    assert _pyproject()["project"]["scripts"] == {"fmoe": "fmoe.cli:main"} and callable(main)
