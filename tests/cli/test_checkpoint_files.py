"""The job's checkpoint files (docs/operating-runs.md): two identical runs write byte-identical
files; meta.json records the resolved settings, their digest, the versions and the threads;
``--keep-last N`` keeps exactly the N newest complete checkpoints, never the resumed one."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fmoe
import fmoe.training
from fmoe.training import JobConfig
from fmoe.training.settings import digest

FLAGS = dict(model="llama", preset="tiny", batch=2, seq=16, quiet=True)


def _files(step_dir: str) -> dict:
    return {n: open(os.path.join(step_dir, n), "rb").read() for n in sorted(os.listdir(step_dir))}


def test_two_identical_runs_write_byte_identical_checkpoint_files(tmp_path):
    runs = [str(tmp_path / r) for r in "ab"]
    for out in runs:
        fmoe.training.run(JobConfig(out=out, nproc=2, steps=2, save_every=1, **FLAGS))
    for step in ("step-1", "step-2"):
        a, b = (_files(os.path.join(out, step)) for out in runs)
        assert sorted(a) == sorted(b) and sum(n.endswith(".safetensors") for n in a) == 2
        for name in a:
            if name != "meta.json":
                assert a[name] == b[name], f"{step}/{name} differs between identical runs"
        ma, mb = (json.loads(m["meta.json"]) for m in (a, b))
        assert ma["settings"].pop("out") == runs[0] and mb["settings"].pop("out") == runs[1]
        assert ma.pop("settings_digest") != mb.pop("settings_digest")      # the digest covers OUT
        assert ma == mb                                    # the files' SHA-256s included
    meta = json.load(open(os.path.join(runs[0], "step-2", "meta.json")))
    assert meta["versions"] == {"torch": torch.__version__, "fmoe": fmoe.__version__,
                                "python": meta["versions"]["python"]}
    assert meta["settings"]["lr"] == 3e-3 and meta["settings"]["steps"] == 2 and meta["settings"]["world"] == 2
    assert meta["settings_digest"] == digest(meta["settings"])
    assert isinstance(meta["threads"], int) and isinstance(meta["interop_threads"], int)


def _steps(out: str) -> list:
    return sorted(os.listdir(out))


def test_keep_last_keeps_exactly_the_newest_complete_checkpoints_never_the_resumed_one(tmp_path):
    out = str(tmp_path / "run")
    fmoe.training.run(JobConfig(out=out, steps=5, save_every=1, keep_last=2, **FLAGS))
    assert [n for n in _steps(out) if "step-" in n] == ["step-4", "step-5"]      # no hidden leftovers
    assert all(os.path.isfile(os.path.join(out, s, "meta.json")) for s in ("step-4", "step-5"))
    rows = [json.loads(r)["step"] for r in open(os.path.join(out, "log.jsonl"))]
    assert rows == [1, 2, 3, 4, 5]
    # continue from step-4 (the newer step-5 is dropped by --overwrite): step-4 stays while the job runs on
    fmoe.training.run(JobConfig(out=out, resume=os.path.join(out, "step-4"), overwrite=True, steps=8, save_every=1,
                                keep_last=2, **FLAGS))
    assert [n for n in _steps(out) if "step-" in n] == ["step-4", "step-7", "step-8"]


def test_a_run_without_a_complete_checkpoint_is_not_offered_to_resume(tmp_path):
    from fmoe.training import JobConfigError
    from fmoe.training.resolve import resolve

    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (out / ".step-1.tmp-1-ab").mkdir()                  # its only save was cut short
    with pytest.raises(JobConfigError, match="no complete checkpoint to continue from") as e:
        resolve(JobConfig(out=str(out), **FLAGS))
    assert "--resume" not in str(e.value) and "--overwrite" in str(e.value)
    fmoe.training.run(JobConfig(out=str(tmp_path / "done"), steps=1, **FLAGS))
    with pytest.raises(JobConfigError, match=f"pass --resume {tmp_path / 'done'} to continue it"):
        resolve(JobConfig(out=str(tmp_path / "done"), **FLAGS))
