"""The one entry point: the ``fmoe`` console script and ``python -m fmoe`` are the same program,
whose commands are train, generate, memory, data and plot (real processes, as a user starts them)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from fmoe.cli import COMMANDS, main

SCRIPT = shutil.which("fmoe", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def run(*args, timeout=300):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def test_the_commands():
    assert list(COMMANDS) == ["train", "generate", "memory", "data", "plot"]


@pytest.mark.parametrize("entry", ["script", "module"])
def test_help_lists_the_commands(entry):
    start = [SCRIPT] if entry == "script" else [sys.executable, "-m", "fmoe"]
    assert start[0], "the fmoe console script is installed (pip install -e .)"
    top = run(*start, "--help")
    assert top.returncode == 0
    for name in COMMANDS:
        assert f"  {name} " in top.stdout
    if entry == "script":
        bad = run(*start, "plan")
        assert bad.returncode == 2 and "unknown command 'plan'" in bad.stderr


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0 and f"usage: fmoe {name}" in capsys.readouterr().out
    assert main([]) == 2


def test_train_and_memory_from_the_console_script(tmp_path):
    out = str(tmp_path / "run")
    r = run(SCRIPT, "train", "--model", "llama", "--steps", "2", "--batch", "2", "--seq", "16", "--quiet",
            "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    final = json.loads(r.stdout.strip().splitlines()[-1])["final"]
    assert final["step"] == 2 and os.path.isdir(os.path.join(out, "step-2"))
    bad = run(SCRIPT, "train", "--tp", "0", "--out", out)
    assert bad.returncode == 2 and "fmoe train: error: --tp must be an integer >= 1, got 0" in bad.stderr
    plan = run(sys.executable, "-m", "fmoe", "memory", "--nproc", "2", "--ep", "2", "--json")
    assert plan.returncode == 0 and len(json.loads(plan.stdout)["ranks"]) == 2
