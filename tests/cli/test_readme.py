"""The README's Python examples run (docs that lie are bugs)."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "__main__" in b]


def test_readme_has_setup_commands():
    text = README.read_text()
    assert 'pip install torch==2.13.0 && pip install -e ".[dev]"' in text
    assert "python -m pytest -q -n 2 tests" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest -q -n 2 tests" in ci, "CI runs the README's test command"


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i, tmp_path):
    script = tmp_path / f"example_{i}.py"
    script.write_text(BLOCKS[i])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()
