"""``--resume`` takes the mesh from the checkpoint unless given (fmoe.training.resume.take_mesh):
``fmoe train --resume OUT --steps N`` continues a 2-rank ep2 run on its own mesh, bit for bit; a
mesh flag given still chooses the mesh (resharded, same data-parallel batches) or is refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import fmoe.training
from fmoe.training import JobConfig
from fmoe.training.resolve import resolve
from train_cases import read_log, train_cli

BASE = ["--model", "qwen3_moe", "--preset", "tiny", "--batch", "2", "--seq", "16", "--quiet"]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """A 2-rank ep2 run of 4 steps, checkpoints at 2 and 4 (uninterrupted)."""
    out = str(tmp_path_factory.mktemp("mesh") / "a")
    fmoe.training.run(JobConfig(model="qwen3_moe", preset="tiny", batch=2, seq=16, quiet=True, nproc=2, ep=2,
                                steps=4, save_every=2, out=out))
    return out


def _cut_at_step_2(run_a, dest):
    """A copy of run A as it was after step 2 (its step-4 checkpoint removed; the log is trimmed by
    the resumed job)."""
    shutil.copytree(run_a, dest)
    shutil.rmtree(os.path.join(dest, "step-4"))
    return dest


def _mesh(out, step=4):
    return json.load(open(os.path.join(out, f"step-{step}", "meta.json")))["mesh"]


def test_resume_with_only_out_and_steps_continues_on_the_checkpoints_mesh_bitwise(run_a, tmp_path):
    b = _cut_at_step_2(run_a, str(tmp_path / "b"))
    job = resolve(JobConfig(resume=b, steps=4))
    assert (job.nproc, job.world, job.tp, job.ep, job.dp_replicate) == (2, 2, 1, 2, 1)
    train_cli("--resume", b, "--steps", "4", "--quiet")
    assert [r["loss"] for r in read_log(b)] == [r["loss"] for r in read_log(run_a)]
    assert _mesh(b) == _mesh(run_a) == {**_mesh(run_a), "world": 2, "ep": 2, "tp": 1}


def test_a_mesh_flag_given_still_chooses_the_mesh(run_a, tmp_path):
    c = _cut_at_step_2(run_a, str(tmp_path / "c"))
    train_cli("--resume", c, "--steps", "4", "--ep", "1", "--quiet")     # --nproc 2 from the checkpoint
    assert _mesh(c)["ep"] == 1 and _mesh(c)["world"] == 2
    got, want = [r["loss"] for r in read_log(c)[2:]], [r["loss"] for r in read_log(run_a)[2:]]
    assert got == pytest.approx(want, rel=1e-4)                         # resharded: the same data, ~ the same losses
    # a given --tp brings --ep = --tp (not the checkpoint's ep): 4 ranks as tp2, the same 2 batches
    job = resolve(JobConfig(resume=c, steps=6, nproc=4, tp=2))
    assert (job.world, job.tp, job.ep) == (4, 2, 2)
    # another number of data-parallel batches is refused, as before
    out = train_cli("--resume", c, "--steps", "6", "--nproc", "1", check=False)
    assert out.returncode == 2 and "data-parallel batches" in out.stderr


def test_a_mesh_the_checkpoint_fills_in_is_named_when_it_does_not_fit(run_a, tmp_path):
    # --tp 2 given on 2 ranks from the checkpoint: the error says where --nproc came from
    out = train_cli("--resume", run_a, "--steps", "6", "--tp", "2", "--dp-replicate", "2", check=False)
    assert out.returncode == 2
    assert "(--nproc 2 taken from the checkpoint" in out.stderr and "step-4" in out.stderr
