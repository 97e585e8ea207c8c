"""Operating the training job (docs/operating-runs.md): OUT protection and locking, resume validation, the
non-finite guard, one-line errors and exit codes, signals, ranks dying with their launcher,
loopback-only rendezvous and resources released by a failed spawn."""

import errno
import json
import ipaddress
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import fmoe
from fmoe.testing import spawn
from fmoe.checkpoint import training as ckpt
from fmoe.cli import train as cli
from fmoe.optim import lr_at
from fmoe.training.outdir import OutLock

BASE = ["--model", "llama", "--preset", "tiny", "--batch", "2", "--seq", "16", "--quiet"]


def job(*args, check=None, **kw):
    out = subprocess.run([sys.executable, "-m", "fmoe", "train", *args], capture_output=True, text=True,
                         timeout=600, **kw)
    if check is not None:
        assert out.returncode == check, out.stderr[-3000:]
    return out


def in_process(capsys, code, *args):
    """Run the job in this process (--nproc 1 or a usage error); check its exit code; stderr."""
    try:
        got = cli.main(list(args))
    except SystemExit as e:
        got = e.code
    err = capsys.readouterr().err
    assert got == code, err[-3000:]
    return err


def strict_log(out):
    """Every line of log.jsonl parses as strict JSON (no bare NaN / Infinity)."""
    def no_constant(c):
        raise ValueError(f"non-JSON constant {c}")
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line, parse_constant=no_constant) for line in f]


def load_trained(path):
    """Load a llama-tiny training checkpoint the way --resume does (ckpt.load checks finiteness)."""
    from fmoe.models import llama
    from fmoe.fsdp import data_parallel_plan
    from fmoe.optim.adamw import init as adamw_init
    params = llama.init(llama.MODEL.preset("tiny", 1), seed=5)
    plan = data_parallel_plan(llama.plan(llama.MODEL.preset("tiny", 1)), params, fmoe.Mesh())
    return ckpt.load(path, params, adamw_init(params), ckpt.packed_layout(plan, params))


def one_line(stderr):
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_help_gives_every_flag_a_meaning_and_a_default():
    ap = cli.build_parser()
    text = ap.format_help()
    fmt = ap.formatter_class("fmoe train")
    for a in ap._actions:
        if a.option_strings and a.dest != "help":
            assert a.help and "(default: " in fmt._get_help_string(a), a.dest
    assert "(default: runs/fmoe)" in text and "exit codes" in text and "Schedule rule" in text
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    assert "runs/fmoe" in readme


def test_out_is_protected_locked_and_resume_is_validated(tmp_path, capsys):
    out, exp = str(tmp_path / "exp1"), str(tmp_path / "mine")
    in_process(capsys, 0, *BASE, "--steps", "3", "--warmup", "1", "--out", out)
    before = sorted(os.listdir(out))
    assert before == ["log.jsonl", "step-3"]
    # a new run into it, or an export into it, is refused before anything starts
    r = in_process(capsys, 2, *BASE, "--steps", "2", "--out", out)
    assert "holds another run" in r and "--overwrite" in r
    r = in_process(capsys, 2, *BASE, "--steps", "2", "--out", str(tmp_path / "new"), "--export-hf", out)
    assert "not a checkpoint directory" in r
    os.makedirs(exp)
    open(os.path.join(exp, "notes.txt"), "w").write("mine")
    r = in_process(capsys, 2, *BASE, "--steps", "2", "--out", str(tmp_path / "new2"), "--export-hf", exp)
    assert "notes.txt" in r and not os.path.exists(tmp_path / "new2")
    assert sorted(os.listdir(out)) == before and os.listdir(exp) == ["notes.txt"]
    # resume keeps the run's settings: mismatches name both values
    cases = [(["--seed", "1"], "--seed 0", "--seed 1"), (["--model", "mixtral"], "'model' is 'llama'", "--model mixtral"),
             (["--batch", "4"], "--batch 2", "--batch 4"), (["--seq", "8"], "--seq 16", "--seq 8"),
             (["--nproc", "2"], "1 data-parallel batches", "has 2"), (["--steps", "3"], "--steps 3", "step 3"),
             (["--aux-weight", "0.5"], "--aux-weight None", "0.5")]
    for flags, a, b in cases:
        steps = [] if "--steps" in flags else ["--steps", "5"]
        r = in_process(capsys, 2, *BASE, "--out", out, "--resume", out, *flags, *steps)
        assert a in r and b in r, (flags, r[-2000:])
    meta_file = os.path.join(out, "step-3", "meta.json")
    meta = json.load(open(meta_file))
    assert meta["schedule"] == {"kind": "warmup-cosine", "lr": 3e-3, "warmup": 1, "total": 3, "min_ratio": 0.1}
    json.dump({**meta, "step": -3}, open(meta_file, "w"))
    r = in_process(capsys, 2, *BASE, "--out", out, "--resume", out, "--steps", "5")
    assert "'step' must be a non-negative integer, got -3" in r
    json.dump(meta, open(meta_file, "w"))
    # --resume never unpickles: a planted torch .metadata payload is refused, never run
    import pickle
    marker = tmp_path / "pwned"
    payload = type("P", (), {"__reduce__": lambda self: (os.system, (f"touch {marker}",))})
    with open(os.path.join(out, "step-3", ".metadata"), "wb") as f:
        pickle.dump(payload(), f)
    # (the resume below runs with it in place)
    # one job per OUT: a live lock refuses, a stale one is taken over
    with OutLock(out):
        r = in_process(capsys, 1, *BASE, "--out", out, "--resume", out, "--steps", "5")
        assert f"in use by another fmoe train job (pid {os.getpid()}" in one_line(r)
    open(os.path.join(out, ".lock"), "w").write("pid 999999 on a-dead-host")
    in_process(capsys, 0, *BASE, "--out", out, "--resume", out, "--steps", "5")     # extends the run
    rows = strict_log(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and not os.path.exists(os.path.join(out, ".lock"))
    assert not marker.exists()                                   # the planted pickle never ran
    # schedule rule: steps beyond the started run's --steps train at its final lr, no restart
    assert rows[3]["lr"] == rows[4]["lr"] == pytest.approx(lr_at(3, 3e-3, 1, 3)) == pytest.approx(3e-4)
    # resuming an older checkpoint while newer ones exist, or into another run's OUT, is refused
    r = in_process(capsys, 2, *BASE, "--out", out, "--resume", f"{out}/step-3", "--steps", "4")
    assert "holds newer checkpoints (step-5)" in r
    other = str(tmp_path / "other")
    in_process(capsys, 0, *BASE, "--steps", "1", "--out", other)
    r = in_process(capsys, 2, *BASE, "--out", other, "--resume", f"{out}/step-3", "--steps", "4")
    assert f"holds not the run --resume {out}/step-3 continues" in r
    in_process(capsys, 0, *BASE, "--out", out, "--resume", f"{out}/step-3", "--steps", "4", "--overwrite")
    assert sorted(os.listdir(out)) == ["log.jsonl", "step-3", "step-4"]
    assert [r["step"] for r in strict_log(out)] == [1, 2, 3, 4]
    # --overwrite replaces the run's files only
    open(os.path.join(out, "notes.txt"), "w").write("mine")
    in_process(capsys, 0, *BASE, "--steps", "2", "--out", out, "--overwrite", "--export-hf", out)
    assert sorted(os.listdir(out)) == ["config.json", "fmoe.json", "log.jsonl", "model.safetensors", "notes.txt",
                                      "step-2"]
    assert [r["step"] for r in strict_log(out)] == [1, 2]


def test_non_finite_steps_stop_before_the_update_and_never_reach_a_checkpoint(tmp_path, capsys):
    out = str(tmp_path / "nan")
    r = in_process(capsys, 1, *BASE, "--steps", "6", "--lr", "1e6", "--save-every", "1", "--out", out)
    line = one_line(r)
    rows = strict_log(out)
    bad = rows[-1]
    assert f"fmoe train: error: step {bad['step']}: non-finite" in line and "last good checkpoint" in line
    assert bad["nonfinite"] and all(bad[k] is None for k in bad["nonfinite"]) and bad["skipped"] is True
    assert all(r["skipped"] is False and "nonfinite" not in r for r in rows[:-1])
    steps = sorted(n for n in os.listdir(out) if n.startswith("step-"))
    assert steps == [f"step-{s}" for s in range(1, bad["step"])]
    load_trained(ckpt.latest(out))                                   # finite (load checks it)
    # --skip-nonfinite N skips such steps (no update) and goes on
    out2 = str(tmp_path / "skip")
    r = in_process(capsys, 0, *BASE, "--steps", "4", "--lr", "1e6", "--skip-nonfinite", "10", "--out", out2)
    rows = strict_log(out2)
    assert len(rows) == 4 and any(r["skipped"] for r in rows)
    load_trained(os.path.join(out2, "step-4"))


def _children(pid):
    kids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(p))
            except (OSError, IndexError):
                pass
    return kids


def _descendants(pid):
    """Every process below ``pid``: the ranks are children of its fork server (fmoe.launch.context)."""
    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(cond, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_ranks_die_with_the_launcher(tmp_path, sig, code):
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-m", "fmoe", "train", *BASE, "--nproc", "2", "--steps", "100000",
                          "--save-every", "2", "--out", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = os.path.join(out, "log.jsonl")
        assert _wait_for(lambda: os.path.exists(log) and len(open(log).readlines()) >= 3, 300)
        ranks = [k for k in _descendants(p.pid) if "multiprocessing" in open(f"/proc/{k}/cmdline").read()
                 or "spawn_main" in open(f"/proc/{k}/cmdline").read()]
        assert len(ranks) >= 2                  # the ranks (and the fork server that started them)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        assert p.returncode == code
        if sig == signal.SIGTERM:
            assert one_line(err).startswith("fmoe train: error: stopped by SIGTERM")
        assert _wait_for(lambda: not any(_alive(k) for k in ranks), 10), "ranks outlived the launcher"
        n = len(open(log).readlines())
        time.sleep(1.5)
        assert len(open(log).readlines()) == n                      # nobody trains on
        for name in os.listdir(out):                                # complete checkpoints only
            if name.startswith("step-"):
                assert os.path.isfile(os.path.join(out, name, "meta.json"))
    finally:
        if p.poll() is None:
            p.kill()


def test_sigint_in_one_process_exits_130(tmp_path):
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-m", "fmoe", "train", *BASE, "--steps", "100000", "--out", out],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = os.path.join(out, "log.jsonl")
    assert _wait_for(lambda: os.path.exists(log) and len(open(log).readlines()) >= 1, 300)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and one_line(err).startswith("fmoe train: error: stopped by SIGINT")
    assert not os.path.exists(os.path.join(out, ".lock"))


def test_checkpoint_failures_are_one_line_errors(tmp_path, monkeypatch, capsys):
    """torch's CheckpointException (a BaseException), a full disk and a read-only OUT each end the
    job with one line and exit 1 (run in this process: --nproc 1)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def full_disk(*a, **k):
        raise CheckpointException("save failed", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    monkeypatch.setattr(dcp, "save", full_disk)
    out = str(tmp_path / "run")
    assert cli.main([*BASE, "--steps", "1", "--out", out]) == 1
    err = capsys.readouterr().err
    assert one_line(err) == f"fmoe train: error: no space left on device writing {out}/step-1"

    def other(*a, **k):
        raise CheckpointException("save failed", {0: (RuntimeError("boom"), None)})

    monkeypatch.setattr(dcp, "save", other)
    assert cli.main([*BASE, "--steps", "1", "--out", str(tmp_path / "r2")]) == 1
    assert "failed on rank(s) [0]: RuntimeError: boom" in one_line(capsys.readouterr().err)
    assert cli.main([*BASE, "--steps", "1", "--out", str(tmp_path / "r3"), "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err
    # not enough room for a checkpoint: refused before the first step
    monkeypatch.setattr("fmoe.training.outdir.shutil.disk_usage", lambda p: type("U", (), {"free": 1000})())
    assert cli.main([*BASE, "--steps", "1", "--out", str(tmp_path / "r4")]) == 1
    assert "no space left on device for a checkpoint in" in one_line(capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "r4" / "log.jsonl")
    # a read-only OUT
    ro = str(tmp_path / "ro")
    real_open = os.open

    def ro_open(path, flags, *a):
        if os.fspath(path).startswith(ro) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", ro_open)
    assert cli.main([*BASE, "--steps", "1", "--out", ro]) == 1
    assert one_line(capsys.readouterr().err) == f"fmoe train: error: cannot write --out {ro}: Read-only file system"


# ------------------------------------------------------------------------------ spawn harness
def _listening(rank, world):
    import warnings

    import torch.distributed as dist
    warnings.warn("`thing` is deprecated", FutureWarning, stacklevel=1)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.all_reduce(t, group=fmoe.Mesh(tp=2).group("tp"))
    from helpers import tcp_sockets
    return [local for state, local, _ in tcp_sockets() if state == "0A"]       # LISTEN


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="reads Linux /proc/net/tcp")
def test_ranks_listen_on_loopback_only_and_warn_once(capfd):
    for found in spawn(_listening, 2):
        assert found and all(ipaddress.ip_address(addr).is_loopback for addr in found), found
    assert capfd.readouterr().err.count("FutureWarning: `thing` is deprecated") == 1   # not once per rank


def _fail(rank, world):
    raise ValueError("planned failure")


def _resources():
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        sems = sum("/dev/shm/sem." in line for line in f)
    return fds, sems


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux /proc")
def test_a_failed_spawn_releases_fds_and_semaphores():
    import gc
    spawn(lambda r, w: r, 1)                                  # warm-up: lazily created globals
    gc.collect()
    gc.disable()                                              # nothing may wait for the collector
    try:
        before = _resources()
        with pytest.raises(ValueError, match="planned failure"):
            spawn(_fail, 2)
        assert _resources() == before
    finally:
        gc.enable()


PARENT = """
import os, sys, time
from fmoe.testing import spawn
def sleeper(rank, world, d):
    open(os.path.join(d, f"rank{rank}"), "w").write(str(os.getpid()))
    time.sleep(600)
spawn(sleeper, 2, sys.argv[1], timeout=600)
"""


def test_spawned_ranks_exit_when_their_parent_is_killed(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)])
    try:
        files = [tmp_path / "rank0", tmp_path / "rank1"]
        assert _wait_for(lambda: all(f.exists() and f.read_text() for f in files), 120)
        pids = [int(f.read_text()) for f in files]
        p.kill()
        p.wait()
        assert _wait_for(lambda: not any(_alive(k) for k in pids), 10), "orphaned ranks"
    finally:
        if p.poll() is None:
            p.kill()


def test_notebooks_readme_clears_outputs_with_installed_tools_only(tmp_path):
    import importlib.util
    import re

    import nbformat
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    text = open(os.path.join(root, "notebooks", "README.md")).read()
    assert "nbconvert" not in text or importlib.util.find_spec("nbconvert") is not None
    script = re.search(r"```bash\n(python - <<'EOF'\n.*?\nEOF)\n```", text, re.S).group(1)
    (tmp_path / "notebooks").mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    nb.cells[0].outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=1)]
    nb.cells[0].execution_count = 1
    nbformat.write(nb, str(tmp_path / "notebooks" / "x.ipynb"))
    subprocess.run(["bash", "-c", script.replace("python -", f"{sys.executable} -", 1)], cwd=tmp_path, check=True)
    cell = nbformat.read(str(tmp_path / "notebooks" / "x.ipynb"), as_version=4).cells[0]
    assert cell.outputs == [] and cell.execution_count is None


def test_init_hf_of_a_bf16_checkpoint_trains_fp32_masters_and_moments(tmp_path, capsys):
    from safetensors import safe_open

    from fmoe.models import llama
    import dataclasses
    cfg = dataclasses.replace(llama.Config.tiny(), vocab_size=256)
    params = fmoe.tree.map_with_path(lambda p, t: t.to(torch.bfloat16), llama.init(cfg))
    llama.save_hf(params, cfg, str(tmp_path / "bf16"))
    out = str(tmp_path / "run")
    assert cli.main([*BASE, "--steps", "1", "--init-hf", str(tmp_path / "bf16"), "--out", out]) == 0
    meta = json.load(open(os.path.join(out, "step-1", "meta.json")))
    assert meta["param_dtype"] == "float32"
    dtypes = set()
    for name in meta["files"]:
        with safe_open(os.path.join(out, "step-1", name), "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys() if not k.endswith("opt.step")}
    assert dtypes == {"F32"}                     # params and both AdamW moments


def _mount_tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_a_real_full_disk_and_a_real_read_only_out(tmp_path):
    """The same one-liners on real filesystems: a tmpfs just too small for the checkpoint (the
    save fails mid-way and removes its partial directory, so the disk is usable again) and a
    read-only tmpfs."""
    from fmoe.models import llama
    params = llama.init(llama.MODEL.preset("tiny", 1))
    need = 3 * sum(t.numel() * t.element_size() for t in fmoe.tree.leaves(params))
    full = tmp_path / "full"
    if not _mount_tmpfs(full, f"size={need + 12 * 1024}"):
        pytest.skip("needs permission to mount a tmpfs (root in a privileged environment)")
    try:
        out = str(full / "run")
        r = job(*BASE, "--steps", "2", "--out", out, check=1)
        assert one_line(r.stderr) == f"fmoe train: error: no space left on device writing {out}/step-2"
        assert sorted(os.listdir(out)) == ["log.jsonl"]      # no step-2, no partial save, no lock left
    finally:
        subprocess.run(["umount", str(full)])
    ro = tmp_path / "ro"
    assert _mount_tmpfs(ro, "ro,size=64k")
    try:
        r = job(*BASE, "--steps", "2", "--out", str(ro / "run"), check=1)
        assert one_line(r.stderr) == f"fmoe train: error: cannot write --out {ro / 'run'}: Read-only file system"
    finally:
        subprocess.run(["umount", str(ro)])
