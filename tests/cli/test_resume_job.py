"""A resume is the run it continues (fmoe.training.resume): every setting restored, changeable or
refused (one walk over every JobConfig field), the batch shape of a pipeline, the data by content,
nothing non-finite saved, and what a run writes beside its log (TensorBoard, profiles) owned by it.

The walk and the refusals read only ``meta.json`` (``resolve``: nothing starts); the reproductions
of issue 44 train a few steps of qwen3_moe tiny in this process."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest

import fmoe.training
from fmoe.training import JobConfig, JobConfigError, resume
from fmoe.training.job import DEFAULTS, FIELDS, flag
from fmoe.training.resolve import resolve
from train_cases import read_log, train_cli

BASE = ["--model", "qwen3_moe", "--preset", "tiny", "--seq", "32", "--quiet", "--threads", "1"]

#: setting -> (the value the crafted checkpoint records, another value given on resume)
KEPT = {"model": ("qwen3_moe", "llama"), "preset": ("tiny", "small"), "seed": (3, 4), "batch": (2, 4),
        "seq": (32, 16), "data": (None, "DATA"), "tokenizer": (None, "TOKENIZER"), "eval_fraction": (0.1, 0.2),
        "eval_seed": (7, 0), "lr": (2e-3, 3e-3), "warmup": (1, 5), "weight_decay": (0.05, 0.1), "clip": (0.5, 1.0),
        "grad_accum": (1, 2), "microbatches": (None, 2), "dp_batches": (1, 2), "router": ("topk:k=2", "topk:k=1"),
        "balance": ("aux,z", "aux"), "aux_weight": (0.02, 0.03), "z_weight": (0.002, 0.003), "bias_rate": (None, 0.01),
        "bias_update": (None, "sign"), "dtype": ("bf16", "fp32"), "master_dtype": ("bf16", "fp32"),
        "optim_dtype": ("bf16", "fp32")}
CHANGEABLE = {"steps": (4, 6), "save_every": (1, 3), "keep_last": (2, 0), "eval_every": (1, 2), "eval_batches": (2, 3),
              "profile_steps": ("2:3", "3:3"), "tensorboard": (False, True), "memory_gb": (50.0, 60.0),
              "skip_nonfinite": (1, 0), "impl": ("all_to_all", "local"), "compile": (False, True),
              "remat": ("none", "layer"), "loss_chunks": (2, 4), "optim_in_backward": (False, True),
              "pp_schedule": ("gpipe", "1f1b"), "device": ("cpu", "auto"), "timeout": (600.0, 900.0)}
FOLLOWERS = {"sp": False, "pp_layers": None}
FRESH = {"resume": None, "out": "elsewhere", "overwrite": True, "export_hf": "hf", "record_routing": "rec",
         "data_changed": True, "router_changed": True, "threads": 2, "quiet": True, "debug": True}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 2-step run of qwen3_moe tiny on one process, checkpoints step-1 and step-2."""
    out = str(tmp_path_factory.mktemp("resume") / "base")
    fmoe.training.run(JobConfig(model="qwen3_moe", preset="tiny", batch=2, seq=32, steps=2, save_every=1, quiet=True,
                                threads=1, out=out))
    return out


def _craft(base, dest, settings=None, mesh=None, step=1):
    """A copy of ``base`` whose step-``step`` meta.json records other settings / mesh."""
    shutil.copytree(base, dest)
    shutil.rmtree(os.path.join(dest, "step-2"))                   # (cut after step 1)
    file = os.path.join(dest, f"step-{step}", "meta.json")
    meta = json.load(open(file))
    meta["settings"].update(settings or {})
    meta["mesh"].update(mesh or {})
    json.dump(meta, open(file, "w"))
    return os.path.join(dest, f"step-{step}")


def test_every_setting_is_restored_changeable_or_refused(base, tmp_path, corpus):
    groups = [set(KEPT), set(CHANGEABLE), set(resume.MESH), set(FOLLOWERS), set(FRESH), set(resume.REFUSED)]
    assert sum(map(len, groups)) == len(set().union(*groups)) and set().union(*groups) == set(FIELDS)
    assert (set(resume.KEPT), set(resume.CHANGEABLE), set(resume.FRESH), set(resume.MESH_FOLLOWERS)) == \
        (set(KEPT), set(CHANGEABLE), set(FRESH), set(FOLLOWERS))
    recorded = {n: v for n, (v, _) in {**KEPT, **CHANGEABLE}.items()}
    ckpt = _craft(base, str(tmp_path / "run"), {**recorded, **FOLLOWERS, **FRESH})
    job = resolve(JobConfig(resume=ckpt))
    for name, value in recorded.items():                       # restored: never a default
        assert getattr(job, name) == value, (name, getattr(job, name), value)
    assert (job.nproc, job.world, job.tp, job.ep, job.pp, job.sp, job.pp_layers) == (1, 1, 1, 1, 1, False, None)
    assert job.out == str(tmp_path / "run") and not job.overwrite and job.export_hf is None      # this invocation's
    assert (job.record_routing, job.data_changed, job.threads, job.quiet, job.debug) == (None, False, None, False, False)
    data = os.path.join(corpus[1], "b.txt")
    others = {**{n: o for n, (_, o) in KEPT.items()}, "data": data, "tokenizer": corpus[2]}
    for name, other in others.items():                         # refused by name
        with pytest.raises(JobConfigError, match=flag(name).replace("-", r"\-")) as e:
            resolve(JobConfig(resume=ckpt, **{name: other}))
        assert "\n" not in str(e.value)
    for name, (_, other) in CHANGEABLE.items():                # may change
        assert getattr(resolve(JobConfig(resume=ckpt, **{name: other})), name) == other, name
    for name, value in (("init_hf", str(tmp_path)), ("upcycle", "8,2")):     # refused: the weights are the checkpoint's
        with pytest.raises(JobConfigError, match=flag(name)):
            resolve(JobConfig(resume=ckpt, **{name: value}))
    upcycled = _craft(base, str(tmp_path / "up"), {"upcycle": "4,2"})        # the run's own: its command line again
    assert resolve(JobConfig(resume=upcycled, upcycle="4,2")).upcycle == "4,2"
    with pytest.raises(JobConfigError, match="--upcycle 8,2 chooses the starting weights"):
        resolve(JobConfig(resume=upcycled, upcycle="8,2"))


def test_a_pipeline_resumes_from_its_own_command_line_or_none(base, tmp_path):
    """``--pp 2 --nproc 2 --batch 4`` (2 micro-batches of 2 rows) continues with ``--resume OUT
    --steps N`` (on pp2), with its original command line plus ``--resume``, and on one process as
    ``--batch 2 --grad-accum 2``; another batch shape is refused naming the flag."""
    ckpt = _craft(base, str(tmp_path / "pp"), {"pp": 2, "batch": 4, "microbatches": 2, "world": 2, "pp_layers": "1,1",
                                               "grad_accum": 1},
                  mesh={"world": 2, "pp": 2, "num_batches": 1})
    shape = lambda j: (j.nproc, j.pp, j.batch, j.microbatches, j.grad_accum, j.pp_layers)   # noqa: E731
    assert shape(resolve(JobConfig(resume=ckpt, steps=3))) == (2, 2, 4, 2, 1, "1,1")
    assert shape(resolve(JobConfig(resume=ckpt, steps=3, nproc=2, pp=2, batch=4))) == (2, 2, 4, 2, 1, "1,1")
    assert shape(resolve(JobConfig(resume=ckpt, steps=3, nproc=2, pp=2, batch=4, microbatches=2))) == \
        (2, 2, 4, 2, 1, "1,1")
    assert shape(resolve(JobConfig(resume=ckpt, steps=3, nproc=1))) == (1, 1, 2, None, 2, None)
    assert shape(resolve(JobConfig(resume=ckpt, steps=3, nproc=1, batch=2, grad_accum=2))) == (1, 1, 2, None, 2, None)
    for flags in (dict(nproc=1, batch=4), dict(batch=2), dict(microbatches=4), dict(nproc=1, grad_accum=4)):
        with pytest.raises(JobConfigError, match="a resumed run keeps its batches") as e:
            resolve(JobConfig(resume=ckpt, steps=3, **flags))
        assert all(f"{flag(k)} {v}" in str(e.value) for k, v in flags.items() if k != "nproc"), str(e.value)
    # a one-process --grad-accum 2 checkpoint resumes on pp2 with --batch 4 (the rows of both micro-batches)
    ga = _craft(base, str(tmp_path / "ga"), {"batch": 2, "grad_accum": 2})
    assert shape(resolve(JobConfig(resume=ga, steps=3, nproc=2, pp=2, batch=4))) == (2, 2, 4, 2, 1, None)
    # context parallelism is mesh too: taken with --nproc from the checkpoint, dropped with --nproc 1
    cp = _craft(base, str(tmp_path / "cp"), mesh={"world": 2, "cp": 2, "num_batches": 2})
    assert [(j.nproc, j.cp) for j in (resolve(JobConfig(resume=cp, steps=3)),
                                      resolve(JobConfig(resume=cp, steps=3, nproc=1)))] == [(2, 2), (1, 1)]
    # routing recorded under a pipeline would pair a replay with the wrong layers: refused
    with pytest.raises(JobConfigError, match="--record-routing with --pp 2"):
        resolve(JobConfig(resume=ckpt, steps=3, record_routing=str(tmp_path / "rec")))


def test_dp_batches_eval_seed_and_eval_fraction_survive_a_resume(tmp_path):
    """Issue 44's reproductions 1, 4, 5: a ``--dp-batches 2 --eval-seed 7 --eval-fraction 0.1`` run
    (given on the command line) resumed from step 2 with only ``--resume`` logs the uninterrupted
    run's losses and held-out losses bit for bit (before: 128 tokens a step, eval seed 0)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train_cli(*BASE, "--batch", "2", "--dp-batches", "2", "--eval-seed", "7", "--eval-fraction", "0.1", "--eval-every",
              "2", "--eval-batches", "1", "--steps", "4", "--save-every", "2", "--out", a)
    train_cli("--resume", os.path.join(a, "step-2"), "--out", b, "--quiet")        # --steps 4: the run's own
    whole, resumed = read_log(a), read_log(b)
    assert [r["step"] for r in resumed] == [3, 4] and resumed[0]["tokens"] == whole[2]["tokens"] == 128
    for key in ("loss", "grad_norm", "eval_loss"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in whole[2:]], key
    meta = json.load(open(os.path.join(b, "step-4", "meta.json")))["settings"]
    assert (meta["dp_batches"], meta["eval_seed"], meta["eval_fraction"]) == (2, 7, 0.1)


def test_the_data_is_recorded_by_content(tmp_path, monkeypatch, capsys):
    """Issue 44's reproduction 3: ``--data`` is recorded as an absolute path with its digest; a
    resume from another directory finds it, a same-named file elsewhere or an edited corpus is
    refused naming the file."""
    here, there = tmp_path / "here", tmp_path / "there"
    for d, text in ((here, "the quick brown fox jumps over the lazy dog. " * 40), (there, "lorem ipsum dolor " * 90)):
        d.mkdir()
        (d / "c.txt").write_text(text)
    monkeypatch.chdir(here)
    out = str(tmp_path / "run")
    fmoe.training.run(JobConfig(model="qwen3_moe", preset="tiny", batch=2, seq=32, steps=1, quiet=True, threads=1,
                                data="c.txt", eval_fraction=0.2, out=out))
    settings = json.load(open(os.path.join(out, "step-1", "meta.json")))["settings"]
    assert settings["data"] == str(here / "c.txt") and len(settings["data_digest"]) == 64
    monkeypatch.chdir(there)                                   # same name, another corpus
    assert resolve(JobConfig(resume=out, steps=2)).data == str(here / "c.txt")
    with pytest.raises(JobConfigError, match=r"--data '.*there/c.txt' .* is not the data the run trained on"):
        resolve(JobConfig(resume=out, steps=2, data="c.txt"))
    shutil.copy(here / "c.txt", tmp_path / "moved.txt")        # moved: the same data
    assert resolve(JobConfig(resume=out, steps=2, data=str(tmp_path / "moved.txt"))).data_digest == \
        settings["data_digest"]
    (here / "c.txt").write_text("edited in place " * 60)
    with pytest.raises(JobConfigError, match=r"here/c.txt' \(digest [0-9a-f]{64}\) is not the data"):
        resolve(JobConfig(resume=out, steps=2))
    job = resolve(JobConfig(resume=out, steps=2, data_changed=True))       # accepted when asked, and said
    assert job.data_digest != settings["data_digest"] and "--data-changed: --data" in capsys.readouterr().err
    from fmoe.data import data_digest, write_shards                # shards: their header, with a digest per shard
    one, two = (write_shards(str(tmp_path / n), [np.arange(n_, dtype=np.uint16)], vocab_size=300)
                for n, n_ in (("s1", 50), ("s2", 51)))
    assert "sha256" in one.header["shards"][0] and data_digest(one.path) != data_digest(two.path)


def test_nothing_non_finite_is_saved(tmp_path, capsys):
    """Issue 44's reproduction 2: an update that overflows the weights ends the run with exit 1
    naming the first non-finite leaf; no checkpoint is written (the last good one is named);
    ``--optim-in-backward --clip 0`` cannot skip a whole step, so with ``--skip-nonfinite`` it is
    refused."""
    out = str(tmp_path / "inf")
    got = train_cli(*BASE, "--batch", "2", "--lr", "1e300", "--warmup", "0", "--steps", "2", "--save-every", "1",
                    "--skip-nonfinite", "1", "--out", out, check=False)
    lines = [ln for ln in got.stderr.splitlines() if "error" in ln]
    assert got.returncode == 1 and len(lines) == 1, got.stderr[-2000:]
    assert "holds non-finite values" in lines[0] and "'params." in lines[0] and "was not written" in lines[0]
    assert not [n for n in os.listdir(out) if n.startswith("step-")]
    refused = train_cli(*BASE, "--optim-in-backward", "--clip", "0", "--skip-nonfinite", "5", "--out", out,
                        check=False)
    assert refused.returncode == 2 and "--skip-nonfinite 5" in refused.stderr.splitlines()[-1]
    from fmoe.checkpoint.finite import first_nonfinite
    import torch
    assert first_nonfinite({"a": torch.ones(3), "b": torch.tensor([0.0, math.nan]), "c": torch.arange(3)}) == "b"


def test_run_files_beside_the_log_belong_to_the_run(base, tmp_path, monkeypatch):
    """Issue 44's 7, 8, 9: ``--overwrite`` removes TensorBoard and profile directories with the run,
    a resume purges TensorBoard's steps after its checkpoint; links there or a linked meta.json are
    refused; ``--timeout`` bounds each collective, not the job."""
    from fmoe.training import outdir
    from fmoe.training.observe import Observer

    out = tmp_path / "out"
    shutil.copytree(base, out)
    for start, steps in ((0, (1, 2)), (1, (2, 3))):             # a run logs 1, 2; its resume from 1 logs 2, 3
        watch = Observer(str(out), 0, tensorboard=True, start=start)
        for step in steps:
            watch.write({"step": step, "loss": float(step + 10 * start), "maxvio": [0.5, 1.5], "pp_idle": [0.1, 0.2],
                         "rank_step_time": [0.3]})
        watch.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 12.0), (3, 13.0)]
    assert {"maxvio/layer-1", "pp_idle/stage-1", "rank_step_time/rank-0"} <= set(acc.Tags()["scalars"])   # by index
    (out / "profile").mkdir()
    assert {"tensorboard", "profile"} <= set(outdir.holds_run(str(out)))
    outdir.clear_run(str(out))
    assert os.listdir(out) == []
    linked = tmp_path / "linked"
    shutil.copytree(base, linked)
    os.symlink(tmp_path, linked / "profile")
    with pytest.raises(JobConfigError, match="profile is a symbolic link"):
        resolve(JobConfig(resume=str(linked), steps=3))
    meta = linked / "step-2" / "meta.json"
    shutil.move(meta, tmp_path / "outside.json")
    os.symlink(tmp_path / "outside.json", meta)
    from fmoe.checkpoint import training as ckpt
    with pytest.raises(ValueError, match="meta.json is a symbolic link"):
        ckpt.read_meta(str(linked / "step-2"))
    from fmoe.checkpoint import training as ckpt_module
    real, calls = ckpt_module.latest, []                        # a job pruning --keep-last removes the latest
    monkeypatch.setattr(ckpt_module, "latest", lambda p: calls.append(p) or (str(out / "step-9") if len(calls) == 1
                                                                               else real(p)))
    assert resolve(JobConfig(resume=base, steps=3, out=str(tmp_path / "reader"))).resume_path.endswith("step-2")
    monkeypatch.setattr(ckpt_module, "latest", real)
    import fmoe.launch
    seen = {}
    monkeypatch.setattr(fmoe.launch, "run", lambda fn, n, job, **kw: seen.update(kw) or [{}])
    fmoe.training.run(JobConfig(model="qwen3_moe", preset="tiny", nproc=2, steps=1, timeout=2, quiet=True,
                                out=str(tmp_path / "t")))
    assert seen["timeout"] == math.inf and seen["collective_timeout"] == 2.0


def test_small_usage_errors_name_the_field(tmp_path, capsys):
    """Issue 44's low items: one line naming the field or file, exit 2, before anything starts."""
    short = tmp_path / "short.txt"
    short.write_text("a text shorter than one row\n")
    cases = ((["--out", "a\0b"], "--out must not hold a NUL byte"),
             (["--data", str(short)], f"--data {str(short)!r} is too short for --seq 32: its training split"),
             (["--pp-layers", "²,1"], "--pp-layers must be comma-separated layer counts"),
             (["--profile-steps", "30:31", "--steps", "2"], "--profile-steps 30:31 is outside the steps"))
    for args, want in cases:
        got = train_cli(*BASE, *args, "--out", str(tmp_path / "x"), check=False) if "--out" not in args else \
            train_cli(*BASE, *args, check=False)
        assert got.returncode == 2 and want in got.stderr.splitlines()[-1], (args, got.stderr[-500:])
    from fmoe.cli import generate
    with pytest.raises(SystemExit) as e:                       # (before: an overflow's traceback)
        generate.main(["--ckpt", str(tmp_path), "--prompt", "hi", "--seed", str(10 ** 23)])
    assert e.value.code == 2 and "--seed must be an integer in [0, " in capsys.readouterr().err
    bad = tmp_path / "job.toml"
    bad.write_bytes(b'model = "qwen3_moe"\npreset = "\xff"\n')
    got = train_cli("--config", str(bad), check=False)
    assert got.returncode == 2 and f"--config {bad}: not UTF-8" in got.stderr.splitlines()[-1]
    job = tmp_path / "sp.toml"
    job.write_text("sp = true\noptim_in_backward = true\nmicrobatches = 2\n")
    from fmoe.cli.train import parse_args
    assert parse_args(["--config", str(job), "--no-sp", "--no-optim-in-backward"]) == JobConfig(
        sp=False, optim_in_backward=False, microbatches=2)
    assert parse_args(["--config", str(job), "--microbatches", "default"]).microbatches is None   # a number undone
    job.write_text("pp = 2\nnproc = 2\nmicrobatches = 2\nmodel = 'qwen3_moe'\npreset = 'tiny'\n")
    assert resolve(parse_args(["--config", str(job), "--pp", "1", "--microbatches", "default",
                               "--out", str(tmp_path / "m")])).microbatches is None      # (with 2: refused)
    import pathlib
    cfg = JobConfig(steps=np.int64(3), lr=np.float32(0.5), out=pathlib.Path(tmp_path), sp=np.bool_(False))
    assert (cfg.steps, cfg.lr, cfg.out, cfg.sp) == (3, 0.5, str(tmp_path), False) and type(cfg.steps) is int
    assert DEFAULTS["steps"] == 20 and JobConfig().steps is None
    from fmoe.data import write_shards                         # shards: their header's count, per data batch
    write_shards(str(tmp_path / "shards"), [np.arange(60, dtype=np.uint8)], vocab_size=256)
    job = dict(model="qwen3_moe", preset="tiny", seq=32, data=str(tmp_path / "shards"), out=str(tmp_path / "s"))
    assert resolve(JobConfig(**job)).data == str(tmp_path / "shards")       # 57 training tokens: 34 needed
    with pytest.raises(JobConfigError, match=r"is too short for --seq 32: its training split .* 28 per data-parallel "
                                             r"batch \(2 batches\); seq=32 needs at least 34"):
        resolve(JobConfig(**job, nproc=2))
    with pytest.raises(JobConfigError, match=r"--seq 32: its held-out split .* has 3 tokens"):
        resolve(JobConfig(**job, eval_every=1))


def test_fmoe_memory_refuses_what_the_job_refuses(capsys):
    """``fmoe memory`` builds its flags into the job's JobConfig and checks them by the job's rules
    (before: it planned ``--sp --seq 33``, ``--microbatches`` without a pipeline, ``--pp 2
    --grad-accum 2``, and named a micro-batch error for ``--pp 3`` on 2 ranks)."""
    from fmoe.cli import memory

    for args, want in ((["--nproc", "2", "--tp", "2", "--sp", "--seq", "33"], "it must also divide --seq 33"),
                       (["--microbatches", "2"], "--microbatches 2 splits the batch of a pipeline"),
                       (["--nproc", "2", "--pp", "2", "--grad-accum", "2"], "--grad-accum 2 with --pp 2"),
                       (["--nproc", "2", "--pp", "3"], "--nproc 2 must be divisible by --pp 3"),
                       (["--nproc", "2", "--pp", "2", "--pp-layers", "²,1"], "--pp-layers must be comma-separated")):
        with pytest.raises(SystemExit) as e:
            memory.main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and want in err[-1], (args, err[-1:])
    assert memory.main(["--nproc", "2", "--pp", "2", "--pp-layers", "1,1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["microbatches"] == 2


def test_generate_on_two_ranks_leaves_no_semaphore(base):
    """Issue 44's low item: ``fmoe generate --nproc 2`` ended with the resource tracker's "leaked
    semaphore" warning (tqdm's multiprocessing lock on each spawned rank)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fmoe", "generate", "--ckpt", base, "--prompt", "hi", "--bytes",
                          "--max-new-tokens", "2", "--nproc", "2", "--ep", "2"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "leaked semaphore" not in out.stderr, out.stderr[-2000:]


def test_sequences_past_max_position_embeddings_are_warned(base, tmp_path, capsys):
    """Issue 44's low item: ``--seq`` and a prompt plus its new tokens past the model's
    ``max_position_embeddings`` (256 in the tiny presets) ran without a word; now a warning each
    (not an error: transformers runs on too), and none at the limit."""
    from fmoe.cli import generate

    got = train_cli("--model", "llama", "--preset", "tiny", "--seq", "264", "--batch", "1", "--steps", "1", "--quiet",
                    "--threads", "1", "--out", str(tmp_path / "long"))
    assert "fmoe train: warning: --seq 264 is longer than the model's max_position_embeddings=256" in got.stderr
    argv = ["--ckpt", base, "--bytes", "--max-new-tokens", "2", "--json"]
    with pytest.warns(UserWarning, match=r"generate: 255 prompt \+ 2 new positions is longer than the model's "
                                         r"max_position_embeddings=256"):
        assert generate.main([*argv, "--prompt", "x" * 255]) == 0
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # 254 + 2 = 256 positions: within the limit
        assert generate.main([*argv, "--prompt", "x" * 254]) == 0
    capsys.readouterr()
