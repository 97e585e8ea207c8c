"""``fmoe train --config job.toml`` (fmoe.training.jobfile): the file's keys are the settings'
names, flags override it, the job file reproduces the flags' run bitwise, and a bad file is a
usage error naming the file, the key and what is valid."""

from __future__ import annotations

import json
import os

import pytest

from fmoe.cli.train import main, parse_args

FLAGS = ["--model", "qwen3_moe", "--preset", "tiny", "--batch", "2", "--seq", "16", "--nproc", "2", "--ep", "2",
         "--steps", "3", "--lr", "0.01", "--bias-rate", "0.002", "--balance", "aux,bias", "--quiet"]
TOML = ('model = "qwen3_moe"\npreset = "tiny"\nbatch = 2\nseq = 16\nnproc = 2\nep = 2\nsteps = 3\nlr = 0.01\n'
        'bias_rate = 0.002\nbalance = "aux,bias"\nquiet = true\n')


def _run_files(out):
    rows = [json.loads(r) for r in open(os.path.join(out, "log.jsonl"))]
    step = os.path.join(out, "step-3")
    files = {n: open(os.path.join(step, n), "rb").read() for n in os.listdir(step) if n.endswith(".safetensors")}
    return [(r["loss"], r["grad_norm"]) for r in rows], files


def test_the_job_file_reproduces_the_flags_run_bitwise(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(TOML)
    assert main([*FLAGS, "--out", str(tmp_path / "flags")]) == 0
    assert main(["--config", str(job), "--out", str(tmp_path / "file")]) == 0
    (a_rows, a_files), (b_rows, b_files) = _run_files(str(tmp_path / "flags")), _run_files(str(tmp_path / "file"))
    assert len(a_rows) == 3 and a_rows == b_rows                       # losses and norms equal bitwise
    assert len(a_files) == 2 and a_files == b_files                    # byte-identical checkpoint files


def test_flags_override_the_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(TOML)
    cfg = parse_args(["--config", str(job), "--lr", "0.003", "--steps", "7"])
    assert (cfg.lr, cfg.steps, cfg.bias_rate, cfg.nproc, cfg.quiet) == (0.003, 7, 0.002, 2, True)
    assert parse_args(["--config", str(job)]).lr == 0.01


@pytest.mark.parametrize("text, message", [
    ('lrr = 0.1\n', "'lrr' is not a job setting; did you mean 'lr'?"),
    ('bias-rate = 0.1\n', "'bias-rate' is not a job setting; did you mean 'bias_rate'?"),
    ('steps = 0\n', "--steps must be an integer >= 1, got 0"),
    ('lr = "fast"\n', "--lr must be a finite number > 0, got 'fast'"),
    ('[mesh]\ntp = 2\n', "'mesh' is not a job setting"),
    ('steps = [1, 2]\n', "steps must be a single value, got a TOML list"),
    ('steps = \n', "not valid TOML"),
])
def test_a_bad_job_file_is_a_usage_error_naming_file_and_key(tmp_path, capsys, text, message):
    job = tmp_path / "job.toml"
    job.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(job)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {job}: " in err and message in err


def test_a_missing_job_file_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "nope.toml")])
    assert "cannot read it (No such file or directory)" in capsys.readouterr().err
