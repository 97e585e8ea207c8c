"""The install as a user gets it: build a wheel from the repository, install it with its
dependencies into a fresh virtualenv, and use it from a folder outside the source tree.

Steps (each failure exits non-zero with what failed):
1. ``pip wheel --no-deps`` of a clean copy of the tracked files (no stale ``build/`` leaks in);
2. ``python -m venv`` (no system site-packages), ``pip install torch==<the CI's version>`` and the
   wheel with its declared dependencies (no ``-e``, no extras);
3. from an empty working directory: import every module the wheel holds (programs' ``__main__``
   modules aside; the pytest plugin needs pytest, which the ``dev`` extra brings);
4. run the README's main job (the first command of its set-up block that runs ``fmoe``) there and
   check its ``log.jsonl``.
Prints the wheel's size, the install time and the job's last loss.

Usage: ``python .ci/wheel_check.py`` from the repository root (``.ci/run`` calls it).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a module that may fail to import in the bare install, and the one missing package that is allowed
NEEDS_EXTRA = {"fmoe_pytest": "pytest"}


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        sys.exit(f"wheel check: {shlex.join(cmd)[:300]} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def tracked_copy(dest: pathlib.Path) -> None:
    """The files git tracks, plus untracked ones it does not ignore, as they are in the tree."""
    files = run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT).stdout.split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def build_wheel(work: pathlib.Path) -> pathlib.Path:
    src, out = work / "src", work / "wheel"
    tracked_copy(src)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(src)])
    (wheel,) = out.glob("fmoe-*.whl")
    return wheel


def modules_of(wheel: pathlib.Path) -> list[str]:
    names = [n for n in zipfile.ZipFile(wheel).namelist()
             if n.endswith(".py") and (n.startswith("fmoe/") or n == "fmoe_pytest.py")]
    mods = [n[:-3].replace("/", ".").removesuffix(".__init__") for n in names]
    return sorted(m for m in mods if not m.endswith("__main__"))


def main_job_command() -> list[str]:
    """The README's main job: the set-up block's first command that runs fmoe."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    for line in block.splitlines():
        words = shlex.split(line)
        if words[:1] == ["fmoe"] or (words[:2] == ["python", "-m"] and words[2].split(".")[0] == "fmoe"):
            return words
    sys.exit("wheel check: README.md's first bash block has no fmoe command (the main job)")


def main() -> None:
    torch_version = os.environ.get("FMOE_CI_TORCH", "2.13.0")
    with tempfile.TemporaryDirectory(prefix="fmoe-wheel-") as tmp:
        work = pathlib.Path(tmp)
        wheel = build_wheel(work)
        venv = work / "venv"
        run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        t0 = time.perf_counter()
        run([py, "-m", "pip", "install", "--quiet", f"torch=={torch_version}"])
        t1 = time.perf_counter()
        run([py, "-m", "pip", "install", "--quiet", str(wheel)])
        t2 = time.perf_counter()
        outside = work / "user"
        outside.mkdir()
        env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("PYTHONPATH", None)
        probe = (
            "import importlib, json, sys\n"
            f"need = {NEEDS_EXTRA!r}\n"
            "bad = []\n"
            "for m in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except ModuleNotFoundError as e:\n"
            "        if need.get(m) != e.name: bad.append(f'{m}: {e!r}')\n"
            "    except Exception as e:\n"
            "        bad.append(f'{m}: {e!r}')\n"
            "import fmoe; assert '/site-packages/' in fmoe.__file__, fmoe.__file__\n"
            "print(len(json.loads(sys.argv[1])), 'modules;', 'from', fmoe.__file__)\n"
            "sys.exit('\\n'.join(bad) if bad else 0)\n")
        mods = modules_of(wheel)
        print("wheel check: imports:", run([py, "-c", probe, json.dumps(mods)], cwd=outside, env=env).stdout.strip())
        cmd = main_job_command()
        if cmd[0] == "python":
            cmd[0] = py
        job = outside / "job"
        t3 = time.perf_counter()
        run([*cmd, "--out", str(job), "--quiet"], cwd=outside, env=env, timeout=900)
        rows = [json.loads(r) for r in (job / "log.jsonl").read_text().splitlines()]
        if not rows or not all(isinstance(r.get("loss"), float) for r in rows):
            sys.exit(f"wheel check: the main job's log.jsonl has no finite losses: {rows[-1:]}")
        print(f"wheel check: {wheel.name} {wheel.stat().st_size / 1e3:.0f} kB, {len(mods)} modules; install: "
              f"torch {t1 - t0:.1f} s, fmoe + dependencies {t2 - t1:.1f} s; main job ({shlex.join(cmd)}) "
              f"{time.perf_counter() - t3:.1f} s, {len(rows)} steps, last loss {rows[-1]['loss']:.4f}")


if __name__ == "__main__":
    main()
